"""The `hardware` config group to a DeviceSpec (SKU name, calibrated file, or the current device)."""

from __future__ import annotations

from anyrec.backends import Backend
from anyrec.backends.specs import DeviceSpec
from anyrec.config import HardwareConfig


def resolve_device(cfg: HardwareConfig, backend: Backend | None) -> DeviceSpec:
    """`auto` asks the backend; anything else is a SKU name or a hardware file."""
    from anyrec.planner.cli import load_device_spec

    if cfg.sku == "auto":
        if backend is None:
            raise ValueError("hardware=auto needs a backend to ask for the current device")
        spec = backend.device_spec()
    else:
        spec = load_device_spec(cfg.sku)
    return spec.replace(**cfg.spec) if cfg.spec else spec
