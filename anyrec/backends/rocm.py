"""The AMD ROCm backend: torch's device type stays `cuda`; only the name says rocm."""

from __future__ import annotations

from anyrec.backends._gpu import GPUBackend
from anyrec.backends.interface import DeviceFacts


class ROCmBackend(GPUBackend):
    """AMD Instinct GPUs through torch's ROCm (HIP) build; RCCL collectives under the nccl name."""

    name = "rocm"

    @classmethod
    def matches(cls, facts: DeviceFacts) -> bool:
        # Told apart at run time: a HIP build *and* an AMD device (gfx arch) visible.
        return (facts.cuda_available and facts.hip_version is not None and facts.device_count > 0
                and (facts.arch.startswith("gfx") or "amd" in facts.device_name.lower()))
