"""The `hardware` config group to a DeviceSpec (SKU name, calibrated file, or the current device)."""

from __future__ import annotations

from anyrec.backends import Backend, resolve_hardware
from anyrec.backends.specs import DeviceSpec
from anyrec.config import HardwareConfig


def resolve_device(cfg: HardwareConfig, backend: Backend | None) -> DeviceSpec:
    """`auto` asks the backend; anything else is a SKU name or a hardware file (see resolve_hardware)."""
    return resolve_hardware(cfg.sku, cfg.spec, backend)
