"""The NVIDIA CUDA backend."""

from __future__ import annotations

from anyrec.backends._gpu import GPUBackend
from anyrec.backends.interface import DeviceFacts


class CUDABackend(GPUBackend):
    """NVIDIA GPUs through torch's CUDA build; NCCL collectives."""

    name = "cuda"

    @classmethod
    def matches(cls, facts: DeviceFacts) -> bool:
        return facts.cuda_available and facts.hip_version is None and facts.device_count > 0
