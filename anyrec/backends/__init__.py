"""Backends: detection and lookup of the accelerator this process runs on."""

from __future__ import annotations

import logging

from anyrec.backends.cpu import CPUBackend
from anyrec.backends.cuda import CUDABackend
from anyrec.backends.interface import Backend, DeviceFacts
from anyrec.backends.rocm import ROCmBackend
from anyrec.backends.specs import SKUS, DeviceSpec, get_sku

logger = logging.getLogger(__name__)

# Detection order: most specific first; CPU always matches and comes last.
BACKENDS: dict[str, type[Backend]] = {"rocm": ROCmBackend, "cuda": CUDABackend, "cpu": CPUBackend}


def detect(facts: DeviceFacts) -> str:
    """Name of the backend that drives a machine with these facts (pure; no torch calls)."""
    gpu = [name for name, cls in BACKENDS.items() if name != "cpu" and cls.matches(facts)]
    if len(gpu) > 1:
        raise RuntimeError(f"ambiguous accelerator: backends {gpu} all match {facts}")
    return gpu[0] if gpu else "cpu"


def get_backend(name: str = "auto", facts: DeviceFacts | None = None) -> Backend:
    """The backend called `name`, or the detected one for 'auto'. Fails clearly if unusable."""
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    if facts is None:
        facts = (CUDABackend.probe_facts() if name in ("auto", "cuda", "rocm")
                 else CPUBackend.probe_facts())
        if name in ("auto", "cpu") and not (facts.cuda_available and facts.device_count):
            facts = CPUBackend.probe_facts()
    chosen = detect(facts) if name == "auto" else name
    cls = BACKENDS[chosen]
    if not cls.matches(facts):
        raise ValueError(f"backend={name} requested but this machine has no usable {name} device "
                         f"(facts: {facts})")
    if chosen == "cpu" and facts.cuda_available:
        facts = CPUBackend.probe_facts()
    return cls(facts)


__all__ = ["Backend", "DeviceFacts", "DeviceSpec", "SKUS", "get_sku", "detect", "get_backend", "BACKENDS"]
