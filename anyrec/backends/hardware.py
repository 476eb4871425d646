"""Resolving the `hardware` setting to a DeviceSpec: `auto`, a SKU name, or a hardware YAML file.

A hardware YAML (what `anyrec.calibrate` writes, and what `hardware.sku=FILE.yaml` reads) has the
shape of the `hardware` config group, so the same file also works as a group option:

    sku: h200                # optional base: a SKU name or auto; omitted = `spec` is complete
    spec:                    # DeviceSpec fields (units in the names) replacing the base's
      memory_bw_bytes_per_s: 4.18e+12
    measurements: {...}      # optional: what anyrec.calibrate measured (units in the key names)

Two parts of `measurements` feed the planner: `embedding.<impl>.profile` (a KernelProfile per
embedding implementation, registered over the built-in one when the file is resolved) and
`measured_fields` (which spec fields were measured rather than taken from the base SKU).

JSON is YAML too, and the flat form is accepted as well: DeviceSpec fields at the top level with
`base: <sku>` for the rest (`{"base": "h200", "memory_bw_bytes_per_s": 4.18e12}`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anyrec.backends.calfile import MAY_BE_ZERO, check_hardware_data
from anyrec.backends.dispatch import KernelProfile, find_impl, set_profile
from anyrec.backends.specs import SKUS, DeviceSpec, sku_key

if TYPE_CHECKING:
    from anyrec.backends.interface import Backend

_FIELDS = {f.name: f for f in dataclasses.fields(DeviceSpec)}
_FILE_KEYS = ("sku", "base", "spec", "measurements", "cache")  # cache: what keys a cached calibration


@dataclass(frozen=True)
class HardwareFile:
    """A parsed hardware YAML: the resolved spec and the free-form measurements that came with it."""

    spec: DeviceSpec
    measurements: dict[str, Any] = field(default_factory=dict)
    profiles: dict[str, KernelProfile] = field(default_factory=dict)  # embedding impl -> measured

    @property
    def measured_fields(self) -> list[str]:
        """Spec fields the file's calibration measured (the rest come from its base SKU)."""
        return [f for f in self.measurements.get("measured_fields", []) if f in _FIELDS]


def _profiles(measurements: dict[str, Any], where: str) -> dict[str, KernelProfile]:
    """The measured KernelProfile per embedding implementation; nonsense figures are a ValueError."""
    out = {}
    emb = measurements.get("embedding") or {}
    if not isinstance(emb, dict):
        raise ValueError(f"{where}: measurements.embedding must be a mapping")
    for name, entry in emb.items():
        fields = entry.get("profile") if isinstance(entry, dict) else None
        if fields is None:
            continue  # skipped on that machine
        if not isinstance(fields, dict):
            raise ValueError(f"{where}: measurements.embedding.{name}.profile must be a mapping")
        known = {"bw_efficiency", "access_bytes", "per_row_s", "per_launch_s", "source"}
        if set(fields) - known:
            raise ValueError(f"{where}: measurements.embedding.{name}.profile: unknown field(s) "
                             f"{', '.join(sorted(set(fields) - known))}")
        try:
            out[name] = KernelProfile(**{k: v if k == "source" else float(v) if k != "access_bytes"
                                         else int(v) for k, v in fields.items()})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: measurements.embedding.{name}.profile: {e}") from None
    return out


def apply_profiles(hw: HardwareFile) -> list[str]:
    """Register the file's measured embedding profiles over the registered ones; returns the
    implementations changed (ones not registered in this process are skipped)."""
    done = []
    for name, profile in hw.profiles.items():
        if find_impl("embedding", name) is not None:
            set_profile("embedding", name, profile)
            done.append(name)
    return done


def is_hardware_path(sku: str) -> bool:
    """Whether a `hardware` value names a file rather than a SKU (a .yaml/.yml name or a path)."""
    return sku.endswith((".yaml", ".yml", ".json")) or os.sep in sku or "/" in sku


def _coerce(name: str, value: Any) -> Any:
    """One DeviceSpec field from YAML: numbers may arrive as strings ('1.9e11' is a str in YAML 1.1)."""
    kind = _FIELDS[name].type
    try:
        if kind == "int":
            return int(float(value))
        if kind == "float":
            return float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"hardware field {name}: expected a number, got {value!r}") from None
    return str(value)


def check_spec(spec: DeviceSpec, where: str) -> DeviceSpec:
    """`spec` if every number in it is finite and positive (0 allowed where it means unknown)."""
    import math

    for name, f in _FIELDS.items():
        value = getattr(spec, name)
        if f.type not in ("int", "float"):
            continue
        if not math.isfinite(value) or value < 0 or (value == 0 and name not in MAY_BE_ZERO):
            need = ">= 0" if name in MAY_BE_ZERO else "> 0"
            raise ValueError(f"{where}: {name} must be a finite number {need}, got {value}")
    return spec


def apply_overrides(spec: DeviceSpec, overrides: dict[str, Any] | None,
                    where: str = "hardware.spec") -> DeviceSpec:
    """`spec` with some fields replaced; unknown field names are a ValueError naming `where`."""
    if not overrides:
        return spec
    unknown = sorted(set(overrides) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown DeviceSpec field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(_FIELDS)}")
    return check_spec(spec.replace(**{k: _coerce(k, v) for k, v in overrides.items()}), where)


def _spec_from_fields(fields: dict[str, Any], where: str) -> DeviceSpec:
    missing = [n for n, f in _FIELDS.items()
               if n not in fields and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where}: no `sku:` base and spec lacks {', '.join(missing)}")
    return check_spec(DeviceSpec(**{k: _coerce(k, v) for k, v in fields.items()}), where)


def _yaml_loader():
    """A safe YAML loader that also reads `4.8e12` as a number (YAML 1.1 wants `4.8e+12`)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$"),
        list("-+0123456789"),
    )
    return Loader


def load_hardware_file(path: str | os.PathLike, backend: Backend | None = None) -> HardwareFile:
    """Parse a hardware YAML into a spec (base SKU + overrides, or a complete spec)."""
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"hardware file {str(p)!r} does not exist")
    try:
        data = yaml.load(p.read_text(), Loader=_yaml_loader()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"hardware file {p}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"hardware file {p}: expected a mapping with keys {', '.join(_FILE_KEYS)}")
    data.pop("defaults", None)  # present when the file doubles as a Hydra group option
    unknown = sorted(set(data) - set(_FILE_KEYS) - set(_FIELDS))
    if unknown:
        raise ValueError(f"hardware file {p}: unknown key(s) {', '.join(unknown)}; expected "
                         f"{', '.join(_FILE_KEYS)} or DeviceSpec fields")
    fields = data.get("spec") or {}
    if not isinstance(fields, dict):
        raise ValueError(f"hardware file {p}: `spec` must be a mapping of DeviceSpec fields")
    flat = {k: v for k, v in data.items() if k in _FIELDS}
    if set(flat) & set(fields):
        raise ValueError(f"hardware file {p}: {', '.join(sorted(set(flat) & set(fields)))} given twice")
    fields = {**fields, **flat}
    check_hardware_data(data, fields, f"hardware file {p}")  # whole, before any of it is used
    if "sku" in data and "base" in data:
        raise ValueError(f"hardware file {p}: give the base SKU once (`sku:` or `base:`)")
    base = data.get("sku", data.get("base"))
    if base is None:
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise ValueError(f"hardware file {p}: unknown DeviceSpec field(s) {', '.join(unknown)}")
        spec = _spec_from_fields(fields, f"hardware file {p}")
    else:
        if is_hardware_path(str(base)):
            raise ValueError(f"hardware file {p}: `sku: {base}` must be a SKU name or auto, not a file")
        spec = apply_overrides(resolve_hardware(str(base), backend=backend), fields, f"hardware file {p}")
    measurements = data.get("measurements") or {}
    if not isinstance(measurements, dict):
        raise ValueError(f"hardware file {p}: `measurements` must be a mapping")
    return HardwareFile(spec, measurements, _profiles(measurements, f"hardware file {p}"))


def resolve_hardware(sku: str, overrides: dict[str, Any] | None = None,
                     backend: Backend | None = None) -> DeviceSpec:
    """The DeviceSpec for a `hardware` setting: 'auto', a SKU name, or a path to a hardware YAML.

    `overrides` (the config's `hardware.spec`) replace fields last. 'auto' asks `backend` (or the
    detected one) for its device. A file's measured embedding profiles are registered (they are what
    the planner costs lookups with). Unknown names, missing files and bad fields raise ValueError.
    """
    sku = str(sku).strip()
    if sku == "auto":
        if backend is None:
            from anyrec.backends import get_backend  # the package imports this module first

            backend = get_backend("auto")
        spec = check_spec(backend.device_spec(), f"the {backend.name} backend's device spec")
    elif is_hardware_path(sku):
        hw = load_hardware_file(sku, backend)
        apply_profiles(hw)
        spec = hw.spec
    else:
        key = sku_key(sku)
        if key is None:
            raise ValueError(f"unknown hardware {sku!r}: use auto, a SKU ({', '.join(sorted(SKUS))}) "
                             "or a path to a hardware .yaml")
        spec = SKUS[key]
    return apply_overrides(spec, overrides)


def rewrite_hardware_argv(argv: list[str]) -> list[str]:
    """Let entry points accept `hardware=FILE.yaml`: Hydra only knows group options, so a file
    path given to the `hardware` group is rewritten to the equivalent `hardware.sku=FILE.yaml`."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in ("hardware", "+hardware") and is_hardware_path(value):
            arg = f"hardware.sku={value}"
        out.append(arg)
    return out


def figure_sources(sku: str, spec: DeviceSpec, kernel: str) -> list[str]:
    """Where the planner's figures for `spec` (from the `hardware` setting `sku`) and embedding
    implementation `kernel` come from: measured by a calibration file, or the SKU table's source."""
    profile = find_impl("embedding", kernel)
    lines = []
    if is_hardware_path(str(sku)):
        hw = load_hardware_file(sku)
        measured = hw.measured_fields
        rest = [f for f in _FIELDS if f not in measured and f not in ("name", "vendor", "arch", "source")]
        lines.append(f"measured ({sku}): {', '.join(measured) or 'none'}")
        lines.append(f"from the base spec: {', '.join(rest)}")
    else:
        lines.append(f"all device figures from the SKU table: {spec.source or spec.name}")
    if profile is not None and profile.profile is not None:
        lines.append(f"embedding {kernel} profile: {profile.profile.source or 'no source given'}")
    return lines
