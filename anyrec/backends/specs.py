"""Device specs per SKU: the numbers the planner and the backends reason with.

Figures are vendor datasheet values (dense, no sparsity) unless marked "measured" or "empirical".
Link bandwidths are stored ONE-WAY per device: vendors quote bidirectional aggregates, halved here.
Capacities are decimal (1 GB = 1e9 bytes), as the datasheets state them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from anyrec.choices import Precision

GB = 1e9
TB = 1e12
GF = 1e9  # FLOP/s
AUTO_PRECISIONS = tuple(str(p) for p in Precision if p is not Precision.auto)  # auto_precision's values


@dataclass(frozen=True)
class DeviceSpec:
    """What one accelerator (or CPU host) offers: capacity, bandwidths, FLOP/s and SIMD width."""

    name: str  # SKU name, e.g. "MI350X"
    vendor: str  # "amd" | "nvidia" | "cpu" | plugin-defined
    arch: str  # "gfx950", "sm_90", "x86_64", ...
    memory_bytes: int  # device memory (HBM) capacity
    memory_bw_bytes_per_s: float  # device memory bandwidth
    peak_bf16_flops: float  # dense bf16 FLOP/s
    peak_fp32_flops: float  # dense fp32 (vector) FLOP/s
    simd_width: int  # threads per warp / wavefront: 32 NVIDIA, 64 AMD CDNA
    scale_up_bw_bytes_per_s: float  # intra-node link per device, one way
    scale_out_bw_bytes_per_s: float  # inter-node NIC bandwidth per device, one way
    h2d_bw_bytes_per_s: float  # host <-> device, one way, pinned memory
    host_memory_bytes: int = 0  # host DDR available to this device's process (0: unknown)
    host_memory_bw_bytes_per_s: float = 0.0  # host DDR bandwidth seen by this device
    # Device memory the framework's allocator never gets: the runtime's context and the libraries' own
    # allocations outside torch's caching allocator (CUDA/HIP context, NCCL/RCCL channels). assumed: the
    # planner keeps it free; a device whose allocator owns all of its memory says 0.
    runtime_reserved_bytes: int = 2 * 10**9
    source: str = ""  # where the figures come from
    # Fixed cost of one collective on each link, seconds (a collective costs latency + bytes / bw);
    # 0: the planner's default (DEFAULT_*_LATENCY_S below).
    scale_up_latency_s: float = 0.0
    scale_out_latency_s: float = 0.0
    # Achieved / peak, where measured (anyrec.calibrate); 0: the planner's empirical defaults.
    dense_efficiency: float = 0.0  # DLRM-shape MLP GEMMs (forward + backward) vs peak_*_flops
    comms_efficiency: float = 0.0  # all-to-all bus bandwidth vs the link bandwidth
    # Framework costs of the trainer's step (Python, torchrec's awaitables and KJT handling, DDP,
    # optimizers, data, loss), seconds, measured by anyrec.calibrate's step points; 0: not modelled.
    step_fixed_s: float = 0.0  # per step
    step_per_feature_s: float = 0.0  # per sparse feature
    step_per_sample_s: float = 0.0  # per local sample
    step_per_id_s: float = 0.0  # per local id
    step_per_value_s: float = 0.0  # per pooled value (local batch x sum of feature dims)
    # per entry of the dot interaction's matrix, local batch x (features + 1)^2 (bmm, gather, backward)
    step_per_pair_s: float = 0.0
    step_per_dense_tensor_s: float = 0.0  # per dense parameter tensor (gradient, DDP copy, update)
    sharding_group_s: float = 0.0  # per sharding type used (its own input and output all-to-alls)
    replicated_table_s: float = 0.0  # per data-parallel table
    # The dense part's precision under trainer.mixed_precision=auto, for planning the device where it is
    # not at hand (its backend decides where it is): "bf16" where the device has bf16 autocast, "fp32" on
    # a CPU (anyrec does not autocast there) and on a device without it.
    auto_precision: str = "bf16"

    def __post_init__(self) -> None:
        if self.auto_precision not in AUTO_PRECISIONS:
            raise ValueError(f"DeviceSpec {self.name}: auto_precision must be one of "
                             f"{', '.join(AUTO_PRECISIONS)}, got {self.auto_precision!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
                raise ValueError(f"DeviceSpec {self.name}: {f.name} must be >= 0, got {v}")
        for f in ("memory_bytes", "memory_bw_bytes_per_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"DeviceSpec {self.name}: {f} must be > 0")
        for f in ("dense_efficiency", "comms_efficiency"):
            if getattr(self, f) > 1.0:
                raise ValueError(f"DeviceSpec {self.name}: {f} is a fraction of peak, got {getattr(self, f)}")

    @property
    def torch_device_type(self) -> str:
        """The torch device type that plans for this spec assume when no backend names one (offline
        planning of a SKU): "cpu" for the host, else "cuda" (ROCm keeps torch's "cuda")."""
        return "cpu" if self.vendor == "cpu" else "cuda"

    def replace(self, **changes: object) -> DeviceSpec:
        """A copy with some fields changed (e.g. calibrated bandwidths)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Host side of a typical 8-GPU node: 2 sockets x 12 DDR5 channels; split evenly per device.
_HOST_DDR_PER_DEVICE = int(2048 * GB / 8)  # 2 TB DDR per 8-GPU node
_HOST_DDR_BW_PER_DEVICE = 2 * 460 * GB / 8  # two sockets, ~460 GB/s each (12ch DDR5-4800)
_NIC_400G = 400e9 / 8  # one 400 Gb/s NIC per GPU (ConnectX-7 / Pollara 400)
_PCIE5_X16 = 55 * GB  # measured on an H200 (2026-11-30) from pinned memory, 2026-11-30
_NIC_800G = 800e9 / 8  # ConnectX-8 per GPU on B200/GB200 systems
# Per-collective latency when a spec gives none (seconds). nccl-tests report small-message all-reduce
# and all-to-all latencies of ~10-30 us inside an NVLink/xGMI node and ~20-60 us over 400G RoCE/IB;
# gloo on loopback (CPU ranks): measured by anyrec.calibrate's fit on 2 ranks of a loaded 2-core host
# (2026-11-30): all-to-all 202 us, reduce-scatter 426 us, all-reduce 411 us (= two stages). Replace
# them with anyrec.calibrate's alpha-beta fit on the machine at hand.
DEFAULT_SCALE_UP_LATENCY_S = 20e-6
DEFAULT_SCALE_OUT_LATENCY_S = 40e-6
DEFAULT_CPU_LATENCY_S = 200e-6

# AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s, 1307.4 TF bf16, 163.4 TF fp32,
# 7 Infinity Fabric links x 128 GB/s = 896 GB/s aggregate bidirectional.
_MI300X = DeviceSpec(
    "MI300X", "amd", "gfx942", memory_bytes=int(192 * GB), memory_bw_bytes_per_s=5.3 * TB,
    peak_bf16_flops=1307.4 * TB, peak_fp32_flops=163.4 * TB, simd_width=64,
    scale_up_bw_bytes_per_s=896 * GB / 2, scale_out_bw_bytes_per_s=_NIC_400G, h2d_bw_bytes_per_s=_PCIE5_X16,
    host_memory_bytes=_HOST_DDR_PER_DEVICE, host_memory_bw_bytes_per_s=_HOST_DDR_BW_PER_DEVICE,
    source="AMD MI300X datasheet")
# AMD Instinct MI350X (CDNA4): 288 GB HBM3E, 8 TB/s, ~2.3 PF bf16 dense, ~144 TF fp32, IF4 ~1075 GB/s bidir.
_MI350X = _MI300X.replace(
    name="MI350X", arch="gfx950", memory_bytes=int(288 * GB), memory_bw_bytes_per_s=8.0 * TB,
    peak_bf16_flops=2300 * TB, peak_fp32_flops=144.2 * TB, scale_up_bw_bytes_per_s=1075 * GB / 2,
    source="AMD MI350X datasheet (compute figures approximate)")
# NVIDIA H100 SXM5: 80 GB HBM3, 3.35 TB/s, 989 TF bf16, 67 TF fp32, NVLink4 900 GB/s bidir.
_H100 = _MI300X.replace(
    name="H100", vendor="nvidia", arch="sm_90", memory_bytes=int(80 * GB), memory_bw_bytes_per_s=3.35 * TB,
    peak_bf16_flops=989 * TB, peak_fp32_flops=67 * TB, simd_width=32, scale_up_bw_bytes_per_s=900 * GB / 2,
    source="NVIDIA H100 SXM datasheet")
# NVIDIA B200 (HGX): 180 GB HBM3E, ~8 TB/s, 2.25 PF bf16 dense, 80 TF fp32, NVLink5 1.8 TB/s bidir.
_B200 = _H100.replace(
    name="B200", arch="sm_100", memory_bytes=int(180 * GB), memory_bw_bytes_per_s=8.0 * TB,
    peak_bf16_flops=2250 * TB, peak_fp32_flops=80 * TB, scale_up_bw_bytes_per_s=1800 * GB / 2,
    scale_out_bw_bytes_per_s=_NIC_800G, h2d_bw_bytes_per_s=2 * _PCIE5_X16, source="NVIDIA HGX B200 datasheet")

SKUS: dict[str, DeviceSpec] = {
    "mi300x": _MI300X,
    # AMD Instinct MI325X datasheet: 256 GB HBM3E, 6.0 TB/s; compute and links as MI300X.
    "mi325x": _MI300X.replace(name="MI325X", memory_bytes=int(256 * GB), memory_bw_bytes_per_s=6.0 * TB,
                              source="AMD MI325X datasheet"),
    "mi350x": _MI350X,
    # AMD Instinct MI355X: as MI350X at higher clocks: ~2.5 PF bf16, ~157 TF fp32.
    "mi355x": _MI350X.replace(name="MI355X", peak_bf16_flops=2500 * TB, peak_fp32_flops=157.3 * TB,
                              source="AMD MI355X datasheet (compute figures approximate)"),
    "h100": _H100,
    # NVIDIA H200 SXM: 141 GB HBM3E, 4.8 TB/s; compute and NVLink as H100.
    "h200": _H100.replace(name="H200", memory_bytes=int(141 * GB), memory_bw_bytes_per_s=4.8 * TB,
                          source="NVIDIA H200 datasheet"),
    "b200": _B200,
    # NVIDIA GB200 NVL72, per GPU: 186 GB HBM3E, 8 TB/s, 2.5 PF bf16, 90 TF fp32, NVLink5 1.8 TB/s
    # bidir in a 72-GPU domain; host is a Grace CPU over NVLink-C2C (900 GB/s bidir, shared by 2 GPUs).
    "gb200": _B200.replace(
        name="GB200", memory_bytes=int(186 * GB), peak_bf16_flops=2500 * TB, peak_fp32_flops=90 * TB,
        h2d_bw_bytes_per_s=900 * GB / 2 / 2, host_memory_bytes=int(480 * GB / 2),
        host_memory_bw_bytes_per_s=512 * GB / 2, source="NVIDIA GB200 NVL72 datasheet"),
    # A generic CPU host: the 'device' is host DDR. Empirical: the quick calibration of the default 2-rank
    # job on a quiet 2-core x86_64 host (2026-12-07; anyrec.calibrate measures the machine at hand). The
    # framework costs (step_*) matter most: without them the default jobs were predicted 7-20x too fast.
    "cpu": DeviceSpec(
        "CPU", "cpu", "x86_64", memory_bytes=int(16 * GB), memory_bw_bytes_per_s=88 * GB,
        peak_bf16_flops=105 * GF, peak_fp32_flops=92 * GF, simd_width=16, scale_up_bw_bytes_per_s=4.7 * GB,
        scale_out_bw_bytes_per_s=4.7 * GB, h2d_bw_bytes_per_s=88 * GB, host_memory_bytes=int(16 * GB),
        host_memory_bw_bytes_per_s=88 * GB, dense_efficiency=0.7,
        source="generic host, empirical (a quiet 2-core host); calibrate with anyrec.calibrate",
        scale_up_latency_s=170e-6, scale_out_latency_s=DEFAULT_CPU_LATENCY_S,
        step_fixed_s=1.85e-3, step_per_feature_s=1.3e-4, step_per_sample_s=1.0e-6, step_per_pair_s=1.4e-9,
        sharding_group_s=5.1e-3, replicated_table_s=0.98e-3, auto_precision="fp32"),
}

def sku_key(name: str) -> str | None:
    """The SKUS key for a name such as 'MI350X', 'h200', 'H100-SXM5'; None when unknown."""
    key = name.lower().replace("-", "").replace("_", "").replace(" ", "")
    key = key.removesuffix("sxm5").removesuffix("sxm").removesuffix("hgx")
    return key if key in SKUS else None


def get_sku(name: str) -> DeviceSpec:
    """Look up a SKU by name (case-insensitive, e.g. 'mi350x', 'H200')."""
    key = sku_key(name)
    if key is None:
        raise ValueError(f"unknown hardware SKU {name!r}; known: {', '.join(sorted(SKUS))}")
    return SKUS[key]


# Device name (lower case, no spaces or dashes) -> SKU; first match wins, most specific first.
# Variants with other memory or links than the SXM/OAM part are excluded and stay "unknown".
_NAME_RULES: list[tuple[str, str]] = [
    ("mi355", "mi355x"), ("mi350", "mi350x"), ("mi325", "mi325x"), ("mi300x", "mi300x"),
    ("gb200", "gb200"), ("b200", "b200"), ("h200", "h200"), ("h100", "h100"),
]
_NAME_EXCLUDES = ("pcie", "nvl", "mi300a", "mi308", "h800", "gh200")

# Arch -> SKUs sharing it, told apart by reported memory: (sku, min bytes, max bytes).
# torch reports binary capacity (MI300X: 192 GiB = 206e9 B), so windows sit between the SKUs.
_ARCH_RULES: dict[str, list[tuple[str, int, int]]] = {
    "gfx942": [("mi300x", int(180 * GB), int(230 * GB)), ("mi325x", int(230 * GB), int(300 * GB))],
    "gfx950": [("mi350x", int(280 * GB), int(330 * GB))],  # MI355X only by name (same memory)
    "sm_90": [("h100", int(75 * GB), int(100 * GB)), ("h200", int(130 * GB), int(160 * GB))],
    "sm_100": [("b200", int(170 * GB), int(195 * GB))],  # GB200 only by name
}


def match_sku(device_name: str, arch: str = "", memory_bytes: int = 0) -> tuple[str | None, str]:
    """(SKU key or None, how: 'name' | 'arch+memory' | why none); pure: testable without the device."""
    name = device_name.lower().replace(" ", "").replace("-", "").replace("_", "")
    excluded = next((x for x in _NAME_EXCLUDES if x in name), None)
    if excluded is None:
        for needle, sku in _NAME_RULES:
            if needle in name:
                return sku, "name"
    arch = arch.split(":")[0].lower()
    for sku, lo, hi in _ARCH_RULES.get(arch, []) if excluded is None else []:
        if lo <= memory_bytes < hi:
            return sku, "arch+memory"
    why = f"name contains {excluded!r}" if excluded else f"no SKU for {device_name!r} ({arch or '-'})"
    return None, why
