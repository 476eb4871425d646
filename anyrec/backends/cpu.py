"""The CPU backend: host memory is the device, gloo does the collectives."""

from __future__ import annotations

import os
import platform

import torch

from anyrec.backends.interface import Backend, DeviceFacts
from anyrec.backends.specs import SKUS, DeviceSpec


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return SKUS["cpu"].memory_bytes


class CPUBackend(Backend):
    """Runs everything on the host; always available."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    # Triton reaches the CPU only through its interpreter: never chosen by auto, only when forced.
    kernel_order = {
        "embedding": ("fbgemm", "torch", "triton"),
        "interaction": ("torch", "triton"),
        "dcn_cross": ("torch", "triton"),
        "collectives": ("gloo",),
        "sparse_ops": ("fbgemm", "portable"),
    }

    @classmethod
    def probe_facts(cls) -> DeviceFacts:
        return DeviceFacts(
            device_count=1,
            device_name=platform.processor() or platform.machine(),
            arch=platform.machine(),
            memory_bytes=_host_memory_bytes(),
            multiprocessors=os.cpu_count() or 1,
        )

    @classmethod
    def matches(cls, facts: DeviceFacts) -> bool:
        return True

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def device_spec(self) -> DeviceSpec:
        mem = self.facts.memory_bytes or SKUS["cpu"].memory_bytes
        return SKUS["cpu"].replace(
            arch=self.facts.arch or SKUS["cpu"].arch, memory_bytes=mem, host_memory_bytes=mem
        )
