"""Backend detection is a pure function of device facts; the chosen backend drives the run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from anyrec.backends import DeviceFacts, detect, get_backend
from anyrec.backends.cpu import CPUBackend, core_share
from anyrec.backends.cuda import CUDABackend
from anyrec.backends.rocm import ROCmBackend
from anyrec.backends.specs import SKUS, get_sku

from .conftest import ROOT

H200 = DeviceFacts(cuda_available=True, hip_version=None, device_count=8, device_name="NVIDIA H200",
                   arch="sm_90", memory_bytes=150_000_000_000)
MI300X = DeviceFacts(cuda_available=True, hip_version="6.4.1", device_count=8,
                     device_name="AMD Instinct MI300X", arch="gfx942", memory_bytes=205_000_000_000)
MI355X = DeviceFacts(cuda_available=True, hip_version="7.0.0", device_count=8,
                     device_name="AMD Instinct MI355X", arch="gfx950", memory_bytes=309_000_000_000)
CPU_ONLY = DeviceFacts()
ROCM_BUILD_NO_GPU = DeviceFacts(cuda_available=False, hip_version="6.4.1")


@pytest.mark.parametrize(
    ("facts", "expected"),
    [(H200, "cuda"), (MI300X, "rocm"), (MI355X, "rocm"), (CPU_ONLY, "cpu"), (ROCM_BUILD_NO_GPU, "cpu")],
)
def test_detect(facts, expected):
    assert detect(facts) == expected


def test_rocm_keeps_cuda_device_type_and_nccl_name():
    b = get_backend("auto", facts=MI300X)
    assert isinstance(b, ROCmBackend)
    assert b.name == "rocm" and b.device_type == "cuda" and b.dist_backend == "nccl"


def test_cuda_backend():
    b = get_backend("auto", facts=H200)
    assert isinstance(b, CUDABackend) and b.device_type == "cuda" and b.dist_backend == "nccl"
    spec = b.device_spec()
    assert spec.name == "H200" and spec.memory_bytes == H200.memory_bytes
    assert b.device(3) == torch.device("cuda", 3)


def test_forced_backend_must_match_machine():
    with pytest.raises(ValueError, match="no usable rocm device"):
        get_backend("rocm", facts=H200)
    with pytest.raises(ValueError, match="no usable cuda device"):
        get_backend("cuda", facts=CPU_ONLY)
    with pytest.raises(ValueError, match="unknown backend"):
        get_backend("tpu", facts=CPU_ONLY)


def test_cpu_backend_on_this_machine():
    b = get_backend("cpu")
    assert isinstance(b, CPUBackend)
    assert b.device() == torch.device("cpu") and b.dist_backend == "gloo"
    assert b.device_spec().memory_bytes > 0


def test_core_share_splits_the_cores_between_local_ranks():
    assert [core_share(range(8), r, 2) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [core_share(range(5), r, 2) for r in range(2)] == [[0, 1], [2, 3, 4]]  # all used, disjoint
    assert [core_share([9, 2, 7, 5], r, 2) for r in range(2)] == [[2, 5], [7, 9]]  # the allowed set, sorted
    assert core_share([0, 1], 2, 3) is None  # fewer cores than ranks: no share of its own


# A child process binds (the test's own process keeps its affinity): a thread started before binding
# and one started after must both end on the rank's share, with torch's thread count set to its size.
BIND_CHILD = """
import json, os, sys, threading, logging
import torch
from anyrec.backends.cpu import CPUBackend
from anyrec.choices import Switch
logging.basicConfig(level=logging.INFO)
rank, world = int(sys.argv[1]), int(sys.argv[2])
bind = Switch.true if sys.argv[3] == "1" else Switch.false
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
share = CPUBackend().bind_local_rank(rank, world, bind).cores
after = threading.Thread(target=stop.wait); after.start()
masks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
stop.set(); before.join(); after.join()
print(json.dumps({"share": share, "masks": list(masks.values()), "threads": torch.get_num_threads()}))
"""


def _bind_child(rank: int, world: int, bind: bool) -> tuple[dict, str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", BIND_CHILD, str(rank), str(world), "1" if bind else "0"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.integration
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="binding local ranks to cores needs Linux and two cores")
def test_cpu_backend_binds_every_thread_of_a_local_rank_to_its_cores():
    allowed = sorted(os.sched_getaffinity(0))
    got, err = _bind_child(1, 2, True)
    share = core_share(allowed, 1, 2)
    assert got["share"] == share and len(got["masks"]) >= 3  # main thread + the two started
    assert all(mask == share for mask in got["masks"]), got["masks"]
    assert got["threads"] == len(share)
    assert f"local rank 1 of 2: threads bound to cores {','.join(map(str, share))}" in err
    # Switched off: threads keep every core, torch's thread count is still the rank's share.
    off, _ = _bind_child(1, 2, False)
    assert off["share"] is None and all(mask == allowed for mask in off["masks"])
    assert off["threads"] == len(share)
    # More ranks than cores: nothing bound, one thread each, and a warning says so.
    crowded, err = _bind_child(0, len(allowed) + 1, True)
    assert crowded["share"] is None and all(mask == allowed for mask in crowded["masks"])
    assert crowded["threads"] == 1 and "ranks share cores, threads not bound" in err


def test_unknown_gpu_gets_a_derived_spec(caplog):
    facts = DeviceFacts(cuda_available=True, device_count=1, device_name="NVIDIA Future X",
                        arch="sm_120", memory_bytes=96_000_000_000)
    spec = get_backend("cuda", facts=facts).device_spec()
    assert spec.memory_bytes == 96_000_000_000 and spec.arch == "sm_120"
    assert "unknown device" in caplog.text


def test_sku_table_density():
    assert get_sku("MI350X").memory_bytes / get_sku("B200").memory_bytes == pytest.approx(1.6)
    assert SKUS["mi300x"].simd_width == 64 and SKUS["h100"].simd_width == 32
    with pytest.raises(ValueError, match="unknown hardware SKU"):
        get_sku("tpu-v9")


# --- SKU table ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("sku", "memory_gb", "bw_tb_s", "simd", "arch"),
    [("mi300x", 192, 5.3, 64, "gfx942"), ("mi325x", 256, 6.0, 64, "gfx942"),
     ("mi350x", 288, 8.0, 64, "gfx950"), ("mi355x", 288, 8.0, 64, "gfx950"),
     ("h100", 80, 3.35, 32, "sm_90"), ("h200", 141, 4.8, 32, "sm_90"),
     ("b200", 180, 8.0, 32, "sm_100"), ("gb200", 186, 8.0, 32, "sm_100")],
)
def test_sku_table_values(sku, memory_gb, bw_tb_s, simd, arch):
    spec = get_sku(sku)
    assert spec.memory_bytes == memory_gb * 10**9
    assert spec.memory_bw_bytes_per_s == pytest.approx(bw_tb_s * 1e12)
    assert (spec.simd_width, spec.arch) == (simd, arch)
    assert spec.peak_bf16_flops > spec.peak_fp32_flops > 0
    assert spec.scale_up_bw_bytes_per_s > spec.scale_out_bw_bytes_per_s > 0
    assert spec.h2d_bw_bytes_per_s > 0 and spec.source


def test_cpu_sku_and_name_spellings():
    assert SKUS["cpu"].vendor == "cpu" and SKUS["cpu"].memory_bytes > 0
    assert get_sku("H100-SXM5") is SKUS["h100"] and get_sku("MI355X") is SKUS["mi355x"]


# --- detection from device facts (injected: name, arch, memory) ------------------------------------

GIB = 2**30


def _gpu(name: str, arch: str, mem: int, hip: str | None = None) -> DeviceFacts:
    return DeviceFacts(cuda_available=True, hip_version=hip, device_count=8, device_name=name,
                       arch=arch, memory_bytes=mem, multiprocessors=100)


@pytest.mark.parametrize(
    ("facts", "backend", "sku"),
    [
        (_gpu("AMD Instinct MI300X", "gfx942:sramecc+:xnack-", 192 * GIB, "6.4"), "rocm", "MI300X"),
        (_gpu("AMD Instinct MI325X", "gfx942", 256 * GIB, "6.4"), "rocm", "MI325X"),
        (_gpu("AMD Instinct MI350X", "gfx950", 288 * GIB, "7.0"), "rocm", "MI350X"),
        (_gpu("AMD Instinct MI355X", "gfx950", 288 * GIB, "7.0"), "rocm", "MI355X"),
        (_gpu("NVIDIA H100 80GB HBM3", "sm_90", 80 * GIB), "cuda", "H100"),
        (_gpu("NVIDIA H200", "sm_90", 141 * 10**9), "cuda", "H200"),
        (_gpu("NVIDIA B200", "sm_100", 180 * 10**9), "cuda", "B200"),
        (_gpu("NVIDIA GB200", "sm_100", 186 * 10**9), "cuda", "GB200"),
        # No marketing name (some ROCm builds report only "AMD Radeon Graphics"): arch + memory.
        (_gpu("AMD Radeon Graphics", "gfx942", 192 * GIB, "6.4"), "rocm", "MI300X"),
        (_gpu("AMD Radeon Graphics", "gfx942", 256 * GIB, "6.4"), "rocm", "MI325X"),
        (_gpu("AMD Radeon Graphics", "gfx950", 288 * GIB, "7.0"), "rocm", "MI350X"),
        (_gpu("NVIDIA Graphics Device", "sm_90", 143 * 10**9), "cuda", "H200"),
    ],
)
def test_detection_maps_each_sku(facts, backend, sku):
    b = get_backend("auto", facts=facts)
    assert b.name == backend and b.device_type == "cuda"
    spec = b.device_spec()
    assert spec.name == sku and spec.memory_bytes == facts.memory_bytes


@pytest.mark.parametrize("name", ["NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA GH200 480GB"])
def test_variants_with_other_specs_are_not_taken_for_the_sxm_part(name, caplog):
    spec = get_backend("cuda", facts=_gpu(name, "sm_90", 94 * 10**9)).device_spec()
    assert spec.name == name and "uncalibrated" in spec.source
    assert "unknown device" in caplog.text


def test_rocm_is_told_apart_at_run_time_not_by_build():
    # A ROCm build of torch that sees an NVIDIA-looking device is not ROCm, and a HIP build with no
    # device falls back to the CPU.
    assert detect(_gpu("NVIDIA H200", "sm_90", 141 * 10**9, hip="6.4")) == "cpu"
    assert detect(DeviceFacts(cuda_available=True, hip_version="6.4", device_count=0)) == "cpu"


def test_unknown_amd_device_is_derived_and_warned_once(caplog):
    from anyrec.backends import _gpu as gpu

    gpu._warned_unknown.clear()
    facts = _gpu("AMD Radeon PRO W7900", "gfx1100", 48 * 10**9, "6.4")  # RDNA3: wave32
    b = get_backend("auto", facts=facts)
    spec, again = b.device_spec(), b.device_spec()
    assert b.name == "rocm" and spec == again
    assert spec.memory_bytes == 48 * 10**9 and spec.vendor == "amd" and spec.simd_width == 32
    # FLOP/s scale with the compute units the device reports (100 vs MI300X's 304).
    assert spec.peak_bf16_flops == pytest.approx(SKUS["mi300x"].peak_bf16_flops * 100 / 304)
    assert caplog.text.count("unknown device") == 1 and "anyrec.calibrate" in caplog.text


# --- registry and plugins ------------------------------------------------------------------------

class _EP:
    """A stand-in for importlib.metadata.EntryPoint: name, value, load()."""

    def __init__(self, name, value, obj=None, error=None):
        self.name, self.value, self._obj, self._error = name, value, obj, error

    def load(self):
        if self._error:
            raise self._error
        return self._obj


class _FakeAccel(CPUBackend):
    name = "fakeaccel"

    @classmethod
    def matches(cls, facts):
        return facts.device_name == "FakeAccel"


def test_plugins_register_like_builtins_and_detect_before_cpu():
    from anyrec.backends import BUILTINS, discover_plugins

    eps = [_EP("cpu", "anyrec.backends.cpu:CPUBackend", CPUBackend),  # the built-in's own entry point
           _EP("fakeaccel", "x:FakeAccel", _FakeAccel),
           _EP("broken", "y:Broken", error=ImportError("no module y"))]
    plugins = discover_plugins(eps)
    assert plugins == {"fakeaccel": _FakeAccel}
    backends = {**plugins, **BUILTINS}
    assert list(backends)[-1] == "cpu"
    assert detect(DeviceFacts(device_name="FakeAccel"), backends) == "fakeaccel"
    assert detect(CPU_ONLY, backends) == "cpu"


def test_plugin_name_clash_and_ambiguity_raise():
    from anyrec.backends import BUILTINS, discover_plugins

    with pytest.raises(RuntimeError, match="two backends are named 'cuda'"):
        discover_plugins([_EP("cuda", "z:Other", _FakeAccel)])

    class _Greedy(_FakeAccel):
        @classmethod
        def matches(cls, facts):
            return True

    with pytest.raises(RuntimeError, match="ambiguous accelerator"):
        detect(H200, {"fakeaccel": _Greedy, **BUILTINS})


def test_a_simulation_is_chosen_by_name_never_detected():
    """A backend with auto_detect off (simdev) is not picked by backend=auto on a machine it matches,
    so installing it leaves the CPU job on the CPU; by name it is there."""
    from anyrec.backends import BUILTINS

    class _Simulated(_FakeAccel):
        auto_detect = False

    backends = {"fakeaccel": _Simulated, **BUILTINS}
    assert _Simulated.matches(DeviceFacts(device_name="FakeAccel"))
    assert detect(DeviceFacts(device_name="FakeAccel"), backends) == "cpu"
    assert detect(DeviceFacts(device_name="FakeAccel"), {"fakeaccel": _FakeAccel, **BUILTINS}) == "fakeaccel"


def test_the_host_and_a_device_torch_cannot_pin_for_get_pageable_memory():
    """Backend.pin and pinned_empty page-lock only where torch pins for this backend's device type (its
    current accelerator): the host's tensors, and those of a device that is not it, pass through."""
    t = torch.ones(3)
    for backend in (CPUBackend(), CUDABackend(H200)):
        if backend.device_type != "cpu" and torch.accelerator.is_available():
            continue  # a real accelerator here: this checks the host-only case
        assert backend.pins_host_memory() is False
        assert backend.pin(t) is t
        assert not backend.pinned_empty(4, dtype=torch.int64).is_pinned()
        assert backend.pinned_empty(4, dtype=torch.int64).dtype == torch.int64


def test_the_host_measures_no_device_memory():
    cpu = CPUBackend()
    assert cpu.memory_allocated() is cpu.max_memory_allocated() is cpu.memory_reserved() is None
    assert cpu.max_memory_reserved() is cpu.memory_capacity_bytes() is None and cpu.memory_stats() == {}
    cpu.reset_peak_memory_stats()
    cpu.empty_cache()


# Page-locking, streams and memory statistics through the current accelerator pick whatever device is
# registered (a plugin's, once installed): outside anyrec/backends/ everything asks its Backend.
IMPLICIT_ACCELERATOR = re.compile(r"pin_memory\(\)|pin_memory=True|torch\.cuda\.|torch\.accelerator|"
                                  r"current_accelerator|get_device_module")


def implicit_accelerator_lines(root) -> list[str]:
    """`path:line: text` of each implicit use of the current accelerator in anyrec outside its backends."""
    hits = []
    for path in sorted((root / "anyrec").rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[:2] == ("anyrec", "backends"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if IMPLICIT_ACCELERATOR.search(line):
                hits.append(f"{rel}:{n}: {line.strip()}")
    return hits


def test_only_the_backends_reach_the_current_accelerator(tmp_path):
    assert implicit_accelerator_lines(ROOT) == []
    (tmp_path / "anyrec" / "backends").mkdir(parents=True)
    (tmp_path / "anyrec" / "backends" / "ok.py").write_text("x.pin_memory()\n")
    (tmp_path / "anyrec" / "data.py").write_text("def f(b):\n    return b.pin_memory()\n")
    assert implicit_accelerator_lines(tmp_path) == ["anyrec/data.py:2: return b.pin_memory()"]
