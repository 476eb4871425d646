"""What the CUDA and ROCm backends share: torch's `cuda` device API (HIP reuses it)."""

from __future__ import annotations

import logging

import torch

from anyrec.backends.interface import Backend, DeviceFacts
from anyrec.backends.specs import SKUS, DeviceSpec

logger = logging.getLogger(__name__)


def probe_torch_cuda_facts() -> DeviceFacts:
    """Facts from torch's cuda module; on ROCm builds this is HIP under the same API."""
    hip = getattr(torch.version, "hip", None)
    if not torch.cuda.is_available():
        return DeviceFacts(cuda_available=False, hip_version=hip)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    arch = getattr(props, "gcnArchName", "") or ""
    if hip is None or not arch:
        arch = f"sm_{props.major}{props.minor}"
    return DeviceFacts(
        cuda_available=True,
        hip_version=hip,
        device_count=torch.cuda.device_count(),
        device_name=props.name,
        arch=arch.split(":")[0],  # "gfx942:sramecc+:xnack-" -> "gfx942"
        memory_bytes=int(props.total_memory),
        multiprocessors=int(props.multi_processor_count),
    )


# (substring of the marketing name, arch prefix) -> SKU key; first match wins, most specific first.
_NAME_TO_SKU: list[tuple[str, str]] = [
    ("mi355", "mi355x"), ("mi350", "mi350x"), ("mi325", "mi325x"), ("mi300x", "mi300x"),
    ("gb200", "gb200"), ("b200", "b200"), ("h200", "h200"), ("h100", "h100"),
]


def sku_from_facts(facts: DeviceFacts) -> str | None:
    """Map a device's reported name to a SKU key, or None for an unknown device."""
    name = facts.device_name.lower().replace(" ", "").replace("-", "")
    for needle, sku in _NAME_TO_SKU:
        if needle in name:
            return sku
    return None


class GPUBackend(Backend):
    """Common parts of CUDA and ROCm: torch device type `cuda`, one device per local rank."""

    device_type = "cuda"
    dist_backend = "nccl"  # RCCL answers to the same name on ROCm

    @classmethod
    def probe_facts(cls) -> DeviceFacts:
        return probe_torch_cuda_facts()

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank % max(1, self.facts.device_count))

    def set_device(self, local_rank: int = 0) -> None:
        torch.cuda.set_device(self.device(local_rank))

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated())

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def device_spec(self) -> DeviceSpec:
        facts = self.facts
        sku = sku_from_facts(facts)
        if sku is not None:
            spec = SKUS[sku]
            # The runtime's capacity is what we can actually allocate.
            return spec.replace(memory_bytes=facts.memory_bytes or spec.memory_bytes)
        logger.warning(
            "unknown device %r (%s): spec derived from its properties; run anyrec.calibrate "
            "and pass hardware=FILE.yaml for accurate planning", facts.device_name, facts.arch,
        )
        base = SKUS["mi300x"] if self.name == "rocm" else SKUS["h100"]
        return base.replace(
            name=facts.device_name or self.name, arch=facts.arch,
            memory_bytes=facts.memory_bytes or base.memory_bytes,
            source="derived from device properties (uncalibrated)",
        )
