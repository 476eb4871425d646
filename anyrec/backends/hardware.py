"""Resolving the `hardware` setting to one `Hardware` value: `auto`, a SKU name, or a hardware YAML file.

A hardware YAML (what `anyrec.calibrate` writes, and what `hardware.sku=FILE.yaml` reads) has the
shape of the `hardware` config group, so the same file also works as a group option:

    sku: h200                # optional base: a SKU name or auto; omitted = `spec` is complete
    spec:                    # DeviceSpec fields (units in the names) replacing the base's
      memory_bw_bytes_per_s: 4.18e+12
    measurements: {...}      # optional: what anyrec.calibrate measured (units in the key names)

Three parts of `measurements` feed the planner, in the `Hardware` value `resolve_hardware` returns
(whoever plans passes it down; nothing is registered): `embedding.<impl>.profile` (a KernelProfile costed
instead of the Impl's built-in one), `measured_fields` (spec fields measured rather than taken from the
base) and `collectives_subgroups` (the collectives of 2D's sharding and replica groups, per group size).
The flat form is accepted too: DeviceSpec fields at the top level, `base: <sku>` for the rest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anyrec.backends.dispatch import TORCH_EMBEDDING, Impl, KernelProfile
from anyrec.backends.specs import SKUS, DeviceSpec, sku_key
from anyrec.calibration.fileformat import ASSUMED_FIELDS, SPEC_FIELDS, check_hardware_data, check_spec_value
from anyrec.safe_load import load_yaml

if TYPE_CHECKING:
    from anyrec.backends.interface import Backend

logger = logging.getLogger(__name__)
_FILE_KEYS = ("sku", "base", "spec", "measurements", "cache")  # cache: what a cached calibration is for


@dataclass(frozen=True)
class EmbeddingCost:
    """The planner's view of one embedding implementation on one `Hardware`: the Impl record (its
    placements, data-parallel support and state layout) and the profiles its lookups are costed with."""

    impl: Impl
    profile: KernelProfile  # the implementation's lookups: measured on the hardware, else built in
    dense_profile: KernelProfile  # data-parallel tables' plain embedding bags (the torch implementation's)

    @classmethod
    def builtin(cls, impl: Impl) -> EmbeddingCost:
        """`impl` costed with the built-in profiles (uncalibrated hardware)."""
        assert impl.profile is not None and TORCH_EMBEDDING.profile is not None  # embedding Impls carry one
        return cls(impl, impl.profile, TORCH_EMBEDDING.profile)

    @property
    def name(self) -> str:
        return self.impl.name

    def state_bytes_per_row(self, optimizer: str, dim: int) -> int:
        """Bytes of fused optimizer state one row of width `dim` keeps (as the Impl lays it out)."""
        return self.impl.optimizer_state_bytes_per_row(optimizer, dim)


@dataclass(frozen=True)
class LinkFit:
    """A collective fitted on measured ranks: seconds = latency_s + bus bytes / bus_bw_bytes_per_s."""

    latency_s: float
    bus_bw_bytes_per_s: float


@dataclass(frozen=True)
class SubgroupLinks:
    """The collectives 2D runs, measured on one host's ranks laid out as torchrec's DMPCollection lays
    them out: the all-to-all within a sharding group of `group_size` ranks and the all-reduce over a
    replica group of `replicas` ranks (None: not measured)."""

    group_size: int
    replicas: int
    all_to_all: LinkFit | None = None
    all_reduce_replicas: LinkFit | None = None


@dataclass(frozen=True)
class Hardware:
    """The device the planner reasons about, as one value: its spec (memory, compute and link figures),
    the embedding profiles a calibration measured, and which of the spec's figures were measured."""

    spec: DeviceSpec
    profiles: dict[str, KernelProfile] = field(default_factory=dict)  # embedding impl -> measured
    measured_fields: tuple[str, ...] = ()  # spec fields measured (the rest from the base SKU)
    measured_by: str = ""  # where the measurements come from (a file, the hardware config); "" = none
    subgroups: dict[int, SubgroupLinks] = field(default_factory=dict)  # group size -> 2D's collectives

    @property
    def link_source(self) -> str:
        """Where the spec's scale-up link figures come from (the whole job's collectives, or the base)."""
        if "scale_up_bw_bytes_per_s" in self.measured_fields:
            return f"from the world's figures (measured over the whole job, {self.measured_by})"
        return f"from the datasheet's figures ({self.spec.source or self.spec.name})"

    def embedding_cost(self, impl: Impl) -> EmbeddingCost:
        """What the planner costs `impl` with on this hardware: measured profiles where there are."""
        builtin = EmbeddingCost.builtin(impl)
        return EmbeddingCost(impl, self.profiles.get(impl.name, builtin.profile),
                             self.profiles.get(TORCH_EMBEDDING.name, builtin.dense_profile))


def measured(hardware: Hardware, measurements: dict[str, Any] | None, where: str) -> Hardware:
    """`hardware` with a calibration's `measurements` on top (checked whole by `check_hardware_data`)."""
    if not measurements:
        return hardware
    profiles = {name: KernelProfile(
        bw_efficiency=float(p["bw_efficiency"]), access_bytes=int(p["access_bytes"]),
        per_row_s=float(p["per_row_s"]), per_launch_s=float(p["per_launch_s"]), source=p.get("source", ""))
        for name, entry in (measurements.get("embedding") or {}).items()
        if (p := entry.get("profile")) is not None}  # None: skipped on that machine
    fields = tuple(f for f in measurements.get("measured_fields", []) if f in SPEC_FIELDS)
    return dataclasses.replace(hardware, profiles={**hardware.profiles, **profiles},
                               measured_fields=tuple(dict.fromkeys(hardware.measured_fields + fields)),
                               measured_by=where,
                               subgroups={**hardware.subgroups, **subgroup_links(measurements)})


def _fit(entry: Any) -> LinkFit | None:
    """One measured collective's fit, or None where it was skipped."""
    if not isinstance(entry, dict) or "bus_bw_bytes_per_s" not in entry:
        return None
    return LinkFit(float(entry["latency_s"]), float(entry["bus_bw_bytes_per_s"]))


def subgroup_links(measurements: dict[str, Any]) -> dict[int, SubgroupLinks]:
    """`collectives_subgroups` (checked by `check_hardware_data`) per group size; {} in files without it."""
    out = {}
    for key, entry in (measurements.get("collectives_subgroups") or {}).items():
        if "replicas" not in entry:  # skipped (the time limit): the world's figures price this size
            continue
        links = SubgroupLinks(int(key), int(entry["replicas"]), _fit(entry.get("all_to_all")),
                              _fit(entry.get("all_reduce_replicas")))
        if links.all_to_all is not None or links.all_reduce_replicas is not None:
            out[links.group_size] = links
    return out


def is_hardware_path(sku: str) -> bool:
    """Whether a `hardware` value names a file rather than a SKU (a .yaml/.yml name or a path)."""
    return sku.endswith((".yaml", ".yml", ".json")) or os.sep in sku or "/" in sku


def _coerce(name: str, value: Any) -> Any:
    """One DeviceSpec field from YAML: numbers may arrive as strings ('1.9e11' is a str in YAML 1.1)."""
    kind = SPEC_FIELDS[name].type
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
    for name in SPEC_FIELDS:
        check_spec_value(name, getattr(spec, name), where)
    return spec


def apply_overrides(spec: DeviceSpec, overrides: dict[str, Any] | None,
                    where: str = "hardware.spec") -> DeviceSpec:
    """`spec` with some fields replaced; unknown field names are a ValueError naming `where`."""
    if not overrides:
        return spec
    unknown = sorted(set(overrides) - set(SPEC_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown DeviceSpec field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(SPEC_FIELDS)}")
    return check_spec(spec.replace(**{k: _coerce(k, v) for k, v in overrides.items()}), where)


def load_hardware_file(path: str | os.PathLike, backend: Backend | None = None) -> Hardware:
    """A hardware YAML (base SKU + overrides, or a complete spec; measurements) as a Hardware value."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"hardware file {str(p)!r} does not exist")
    where = f"hardware file {p}"
    return hardware_from_data(load_yaml(p, where), where, str(p), backend)  # bounded: size, depth, aliases


def hardware_from_data(data: Any, where: str, source: str, backend: Backend | None = None) -> Hardware:
    """A parsed hardware file (`where` names it in errors, `source` in the Hardware) as a Hardware value,
    checked whole first."""
    data = data or {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping with keys {', '.join(_FILE_KEYS)}")
    data = dict(data)
    data.pop("defaults", None)  # present when the file doubles as a Hydra group option
    unknown = sorted(set(data) - set(_FILE_KEYS) - set(SPEC_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; expected "
                         f"{', '.join(_FILE_KEYS)} or DeviceSpec fields")
    fields = data.get("spec") or {}
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: `spec` must be a mapping of DeviceSpec fields")
    flat = {k: v for k, v in data.items() if k in SPEC_FIELDS}
    if set(flat) & set(fields):
        raise ValueError(f"{where}: {', '.join(sorted(set(flat) & set(fields)))} given twice")
    fields = {**fields, **flat}
    check_hardware_data(data, fields, where)  # whole, before any of it is used
    if "sku" in data and "base" in data:
        raise ValueError(f"{where}: give the base SKU once (`sku:` or `base:`)")
    base = data.get("sku", data.get("base"))
    if base is not None:
        if is_hardware_path(str(base)):
            raise ValueError(f"{where}: `sku: {base}` must be a SKU name or auto, not a file")
        base_spec = resolve_hardware(str(base), backend=backend).spec
        from_base = [f for f in SPEC_FIELDS if f not in fields and f not in ("name", "source")]
        if from_base:
            logger.info("%s: %d figure(s) from the base %s (%s): %s", where, len(from_base), base,
                        base_spec.source or "SKU table", ", ".join(from_base))
        spec = apply_overrides(base_spec, fields, where)
        return measured(Hardware(spec), data.get("measurements"), source)
    unknown = sorted(set(fields) - set(SPEC_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown DeviceSpec field(s) {', '.join(unknown)}")
    # Without a base every figure must be there (assumptions keep their defaults): a spec cut short (the
    # older layout wrote the spec first) would otherwise plan with defaults in place of the figures it lost.
    missing = [n for n in SPEC_FIELDS if n not in fields and n not in ASSUMED_FIELDS]
    if missing:
        raise ValueError(f"{where}: no `sku:` base and spec lacks {', '.join(missing[:6])}"
                         f"{f' (+{len(missing) - 6} more)' if len(missing) > 6 else ''}: cut short or "
                         "written by an older anyrec (calibrate again), or name a base with `sku:`")
    spec = check_spec(DeviceSpec(**{k: _coerce(k, v) for k, v in fields.items()}), where)
    return measured(Hardware(spec), data.get("measurements"), source)


def resolve_hardware(sku: str, overrides: dict[str, Any] | None = None, backend: Backend | None = None,
                     measurements: dict[str, Any] | None = None) -> Hardware:
    """The Hardware for a `hardware.sku` setting: 'auto' (asks `backend`), a SKU name, or a path to a
    hardware YAML. `overrides` (`hardware.spec`) replace spec fields last; `measurements`
    (`hardware.measurements`, set where a calibrated YAML is a group option) count as the file's would."""
    sku = str(sku).strip()
    if sku == "auto":
        if backend is None:
            raise ValueError("hardware.sku=auto needs the backend whose device it describes")
        hardware = Hardware(check_spec(backend.device_spec(), f"the {backend.name} backend's device spec"))
    elif is_hardware_path(sku):
        hardware = load_hardware_file(sku, backend)
    else:
        key = sku_key(sku)
        if key is None:
            raise ValueError(f"unknown hardware {sku!r}: use auto, a SKU ({', '.join(sorted(SKUS))}) "
                             "or a path to a hardware .yaml")
        hardware = Hardware(SKUS[key])
    if measurements:  # a calibrated YAML used as a group option: checked as the file would be
        check_hardware_data({"spec": overrides or {}, "measurements": measurements}, overrides or {},
                            "hardware.measurements")
    hardware = dataclasses.replace(hardware, spec=apply_overrides(hardware.spec, overrides))
    return measured(hardware, measurements, "hardware.measurements")


def figure_sources(hardware: Hardware, cost: EmbeddingCost) -> list[str]:
    """Where the planner's figures come from: which spec fields and embedding profiles `hardware`'s
    calibration measured, and the source of the rest (the SKU table or the base spec)."""
    lines = []
    if hardware.measured_by:
        done = hardware.measured_fields
        rest = [f for f in SPEC_FIELDS if f not in done and f not in ("name", "vendor", "arch", "source")]
        lines.append(f"measured ({hardware.measured_by}): {', '.join(done) or 'no device figure'}")
        lines.append(f"from the base spec ({hardware.spec.source or hardware.spec.name}): {', '.join(rest)}")
    else:
        lines.append(f"all device figures from the SKU table (datasheet): "
                     f"{hardware.spec.source or hardware.spec.name}")
    profiles = [("embedding", cost.name, cost.profile)]
    if cost.name != TORCH_EMBEDDING.name:
        profiles.append(("data-parallel tables'", TORCH_EMBEDDING.name, cost.dense_profile))
    for what, name, profile in profiles:
        how = (f"measured ({hardware.measured_by}{', ' + profile.source if profile.source else ''})"
               if name in hardware.profiles else f"built in ({profile.source or 'no source given'})")
        lines.append(f"{what} {name} profile: {how}")
    return lines
