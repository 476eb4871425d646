"""Backends: the registry (built-ins and `anyrec.backends` entry-point plugins), detection, lookup.

Detection is lazy, ordered and raises on ambiguity: plugins first (in name order), then ROCm, CUDA,
and CPU last, which always matches. Plugins are discovered on first use, not at import.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Iterable
from typing import Any

from anyrec.backends.cpu import CPUBackend
from anyrec.backends.cuda import CUDABackend
from anyrec.backends.dispatch import load_entry_points
from anyrec.backends.hardware import EmbeddingCost, Hardware, load_hardware_file, resolve_hardware
from anyrec.backends.interface import Backend, DeviceFacts
from anyrec.backends.rocm import ROCmBackend
from anyrec.backends.specs import SKUS, DeviceSpec, get_sku

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "anyrec.backends"
# Built-ins are registered here as well as through setup.py's entry points, so a source checkout
# that was never installed still has them; their entry points are recognised and skipped.
BUILTINS: dict[str, type[Backend]] = {"rocm": ROCmBackend, "cuda": CUDABackend, "cpu": CPUBackend}

_registry: dict[str, type[Backend]] | None = None
_plugin_errors: dict[str, str] = {}


def discover_plugins(entry_points: Iterable[Any] | None = None) -> dict[str, type[Backend]]:
    """Plugin backends of the `anyrec.backends` entry-point group (name -> Backend subclass): one that
    fails to load is left out with a warning; a name taken twice raises (detection could not tell)."""
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if entry_points is None else entry_points
    found: dict[str, type[Backend]] = {}
    ours = {f"{b.__module__}:{b.__qualname__}" for b in BUILTINS.values()}
    plugins = [ep for ep in eps if not (ep.name in BUILTINS and ep.value in ours)]
    for ep, cls in load_entry_points(plugins, _plugin_errors, "backend"):
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise TypeError(f"backend plugin {ep.name} ({ep.value}) is not a Backend subclass")
        if ep.name in BUILTINS or ep.name in found:
            raise RuntimeError(f"two backends are named {ep.name!r}: {ep.value} and "
                               f"{(BUILTINS.get(ep.name) or found[ep.name]).__module__}")
        if cls.name != ep.name:
            raise RuntimeError(f"backend plugin {ep.value}: entry point {ep.name!r} but class "
                               f"name {cls.name!r}")
        found[ep.name] = cls
    return found


def registry() -> dict[str, type[Backend]]:
    """Every backend in detection order: plugins, then the built-ins (CPU last). Built once."""
    global _registry
    if _registry is None:
        _registry = {**discover_plugins(), **BUILTINS}
    return _registry


def detect(facts: DeviceFacts, backends: dict[str, type[Backend]] | None = None) -> str:
    """Name of the backend that drives a machine with these facts (pure; no torch calls)."""
    return _detect(lambda cls: facts, registry() if backends is None else backends)[0]


def _detect(facts_of: Callable[[type[Backend]], DeviceFacts],
            backends: dict[str, type[Backend]]) -> tuple[str, DeviceFacts | None]:
    """The one accelerator backend that matches its `facts_of` (else cpu, with no facts), and those facts;
    a backend with `auto_detect` off (a simulation) is never asked."""
    found = [(name, facts) for name, cls in backends.items()
             if name != "cpu" and cls.auto_detect and cls.matches(facts := facts_of(cls))]
    if len(found) > 1:
        raise RuntimeError(f"ambiguous accelerator: backends {[n for n, _ in found]} all match this "
                           f"machine ({found[0][1]}); choose one with backend.name=")
    return found[0] if found else ("cpu", None)


def _detect_live() -> tuple[str, DeviceFacts | None]:
    """Detection on this machine: each backend reads facts with its own probe (shared when equal)."""
    facts_by_probe: dict[Any, DeviceFacts] = {}

    def facts_of(cls: type[Backend]) -> DeviceFacts:
        probe = cls.probe_facts.__func__  # CUDA and ROCm share one probe: read the device once
        if probe not in facts_by_probe:
            facts_by_probe[probe] = cls.probe_facts()
        return facts_by_probe[probe]

    return _detect(facts_of, registry())


def get_backend(name: str = "auto", facts: DeviceFacts | None = None) -> Backend:
    """The backend called `name`, or the detected one for 'auto'. Fails clearly if unusable."""
    backends = registry()
    if name not in ("auto", *backends):
        hint = f" (plugin failed to load: {_plugin_errors[name]})" if name in _plugin_errors else ""
        raise ValueError(f"unknown backend {name!r}{hint}; choose one of auto, {', '.join(backends)}")
    if name == "auto":
        name, facts = _detect_live() if facts is None else (detect(facts), facts)
    cls = backends[name]
    if facts is None or (name == "cpu" and facts.cuda_available):
        facts = cls.probe_facts()
    if not cls.matches(facts):
        raise ValueError(f"backend={name} requested but this machine has no usable {name} device "
                         f"(facts: {facts})")
    backend = cls(facts)
    logger.debug("backend %s selected", backend.describe())
    return backend


__all__ = [
    "Backend", "DeviceFacts", "DeviceSpec", "SKUS", "get_sku", "detect", "get_backend",
    "BUILTINS", "registry", "discover_plugins", "Hardware", "EmbeddingCost",
    "resolve_hardware", "load_hardware_file", "ENTRY_POINT_GROUP",
]
