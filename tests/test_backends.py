"""Backend detection is a pure function of device facts; the chosen backend drives the run."""

from __future__ import annotations

import pytest
import torch

from anyrec.backends import DeviceFacts, detect, get_backend
from anyrec.backends.cpu import CPUBackend
from anyrec.backends.cuda import CUDABackend
from anyrec.backends.rocm import ROCmBackend
from anyrec.backends.specs import SKUS, get_sku

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
