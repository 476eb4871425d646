"""What the CUDA and ROCm backends share: torch's `cuda` device API (HIP reuses it)."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

import torch

from anyrec.backends.interface import Backend, DeviceFacts
from anyrec.backends.specs import SKUS, DeviceSpec, match_sku

logger = logging.getLogger(__name__)


# The caching allocator's settings anyrec runs with: expandable segments, which the planner's reserved-memory
# model assumes (anyrec.planner.memory). torch reads them from the environment when the allocator starts;
# PYTORCH_ALLOC_CONF is the device-neutral name (torch >= 2.9), the others the CUDA and HIP builds' own.
ALLOCATOR_SETTING = "expandable_segments:True"
ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def configure_allocator(hip: bool, environ: MutableMapping[str, str] = os.environ) -> bool:
    """Switch on expandable segments for this process's CUDA (or HIP) caching allocator, before its first
    allocation, by its build's variable (PYTORCH_HIP_ALLOC_CONF on ROCm, PYTORCH_CUDA_ALLOC_CONF else),
    other settings kept. A user's own `expandable_segments` is left as it is (warned when off). Returns
    whether expandable segments are on."""
    for name in ALLOC_CONF_NAMES:
        value = environ.get(name, "")
        if "expandable_segments" in value:
            on = "expandable_segments:True" in value.replace(" ", "")
            if not on:
                logger.warning("%s=%s turns expandable segments off: the planner's reserved-memory "
                               "prediction assumes them, so an accepted plan may run out of memory",
                               name, value)
            return on
    name = "PYTORCH_HIP_ALLOC_CONF" if hip else "PYTORCH_CUDA_ALLOC_CONF"
    environ[name] = ",".join(filter(None, (environ.get(name, ""), ALLOCATOR_SETTING)))
    return True


def probe_torch_cuda_facts() -> DeviceFacts:
    """Facts from torch's cuda module; on ROCm builds this is HIP under the same API. The allocator is
    configured (configure_allocator) before the first call that starts CUDA."""
    hip = getattr(torch.version, "hip", None)
    if not torch.cuda.is_available():
        return DeviceFacts(cuda_available=False, hip_version=hip)
    configure_allocator(hip is not None)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    arch = getattr(props, "gcnArchName", "") or ""
    if hip is None or not arch:
        arch = f"sm_{props.major}{props.minor}"
    return DeviceFacts(cuda_available=True, hip_version=hip, device_count=torch.cuda.device_count(),
                       device_name=props.name, arch=arch.split(":")[0],  # "gfx942:sramecc+:xnack-": gfx942
                       memory_bytes=int(props.total_memory), multiprocessors=int(props.multi_processor_count))


# Compute units of the base SKUs an unknown device is scaled from (datasheets: MI300X 304 CUs,
# H100 SXM 132 SMs, B200 148 SMs).
_BASE_COMPUTE_UNITS = {"mi300x": 304, "h100": 132, "b200": 148}
_warned_unknown: set[tuple[str, str]] = set()


def _warn_once(facts: DeviceFacts, msg: str, *args: object) -> None:
    if (facts.device_name, facts.arch) not in _warned_unknown:
        _warned_unknown.add((facts.device_name, facts.arch))
        logger.warning(msg, *args)


def derived_spec(facts: DeviceFacts, vendor: str) -> DeviceSpec:
    """An unknown GPU's spec: its family's nearest SKU, memory its own, FLOP/s scaled by compute units."""
    arch = facts.arch.lower()
    if vendor == "amd":
        base = "mi300x"
    else:
        major = int(arch[3:-1]) if arch.startswith("sm_") and arch[3:-1].isdigit() else 9
        base = "b200" if major >= 10 else "h100"
    spec = SKUS[base]
    scale = facts.multiprocessors / _BASE_COMPUTE_UNITS[base] if facts.multiprocessors else 1.0
    # CDNA (gfx9xx) runs 64-wide wavefronts; RDNA (gfx1xxx) and NVIDIA run 32-wide.
    simd = 64 if arch.startswith("gfx9") else 32
    _warn_once(facts, "unknown device %r (%s, %.0f GB): spec derived from its properties and %s's figures; "
               "run `python -m anyrec.calibrate calibrate.output=FILE.yaml` and pass hardware.sku=FILE.yaml "
               "for accurate planning", facts.device_name, facts.arch, facts.memory_bytes / 1e9, spec.name)
    return spec.replace(
        name=facts.device_name or vendor, vendor=vendor, arch=facts.arch,
        memory_bytes=facts.memory_bytes or spec.memory_bytes,
        peak_bf16_flops=spec.peak_bf16_flops * scale, peak_fp32_flops=spec.peak_fp32_flops * scale,
        simd_width=simd, source=f"derived from device properties and {spec.name} (uncalibrated)",
    )


class GPUBackend(Backend):
    """Common parts of CUDA and ROCm: torch device type `cuda`, one device per local rank."""

    device_type = "cuda"
    dist_backend = "nccl"  # RCCL answers to the same name on ROCm
    kernel_order = {**Backend.kernel_order, "collectives": ("nccl", "gloo")}

    @classmethod
    def probe_facts(cls) -> DeviceFacts:
        return probe_torch_cuda_facts()

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank % max(1, self.facts.device_count))

    def set_device(self, local_rank: int = 0) -> None:
        torch.cuda.set_device(self.device(local_rank))

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated())

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated())

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved())

    def max_memory_reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved())

    def memory_capacity_bytes(self) -> int:
        return int(torch.cuda.mem_get_info()[1])

    def memory_stats(self) -> dict[str, int]:
        return dict(torch.cuda.memory_stats())

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def device_spec(self) -> DeviceSpec:
        facts = self.facts
        sku, how = match_sku(facts.device_name, facts.arch, facts.memory_bytes)
        if sku is None:
            return derived_spec(facts, "amd" if self.name == "rocm" else "nvidia")
        if how != "name":
            _warn_once(facts, "device %r not known by name: taken as %s from its arch %s and %.0f GB; pass "
                       "hardware=<sku> if that is wrong", facts.device_name, SKUS[sku].name, facts.arch,
                       facts.memory_bytes / 1e9)
        # The runtime's capacity is what we can actually allocate.
        return SKUS[sku].replace(memory_bytes=facts.memory_bytes or SKUS[sku].memory_bytes)
