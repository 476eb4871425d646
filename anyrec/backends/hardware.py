"""Resolving the `hardware` setting to a DeviceSpec: `auto`, a SKU name, or a hardware YAML file.

A hardware YAML (what `anyrec.calibrate` writes, and what `hardware.sku=FILE.yaml` reads) has the
shape of the `hardware` config group, so the same file also works as a group option:

    sku: h200                # optional base: a SKU name or auto; omitted = `spec` is complete
    spec:                    # DeviceSpec fields (units in the names) replacing the base's
      memory_bw_bytes_per_s: 4.18e+12
    measurements: {...}      # optional, free-form: per-kernel lookup bandwidths etc.

JSON is YAML too, and the flat form is accepted as well: DeviceSpec fields at the top level with
`base: <sku>` for the rest (`{"base": "h200", "memory_bw_bytes_per_s": 4.18e12}`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anyrec.backends.specs import SKUS, DeviceSpec, sku_key

if TYPE_CHECKING:
    from anyrec.backends.interface import Backend

_FIELDS = {f.name: f for f in dataclasses.fields(DeviceSpec)}
_FILE_KEYS = ("sku", "base", "spec", "measurements")


@dataclass(frozen=True)
class HardwareFile:
    """A parsed hardware YAML: the resolved spec and the free-form measurements that came with it."""

    spec: DeviceSpec
    measurements: dict[str, Any] = field(default_factory=dict)


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
    except (TypeError, ValueError):
        raise ValueError(f"hardware field {name}: expected a number, got {value!r}") from None
    return str(value)


def apply_overrides(spec: DeviceSpec, overrides: dict[str, Any] | None,
                    where: str = "hardware.spec") -> DeviceSpec:
    """`spec` with some fields replaced; unknown field names are a ValueError naming `where`."""
    if not overrides:
        return spec
    unknown = sorted(set(overrides) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown DeviceSpec field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(_FIELDS)}")
    return spec.replace(**{k: _coerce(k, v) for k, v in overrides.items()})


def _spec_from_fields(fields: dict[str, Any], where: str) -> DeviceSpec:
    missing = [n for n, f in _FIELDS.items()
               if n not in fields and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where}: no `sku:` base and spec lacks {', '.join(missing)}")
    return DeviceSpec(**{k: _coerce(k, v) for k, v in fields.items()})


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
    return HardwareFile(spec, measurements)


def resolve_hardware(sku: str, overrides: dict[str, Any] | None = None,
                     backend: Backend | None = None) -> DeviceSpec:
    """The DeviceSpec for a `hardware` setting: 'auto', a SKU name, or a path to a hardware YAML.

    `overrides` (the config's `hardware.spec`) replace fields last. 'auto' asks `backend` (or the
    detected one) for its device. Unknown names, missing files and bad fields raise ValueError.
    """
    sku = str(sku).strip()
    if sku == "auto":
        if backend is None:
            from anyrec.backends import get_backend  # the package imports this module first

            backend = get_backend("auto")
        spec = backend.device_spec()
    elif is_hardware_path(sku):
        spec = load_hardware_file(sku, backend).spec
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
