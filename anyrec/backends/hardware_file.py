"""The hardware file's schema: what a hardware / calibration YAML holds, as typed records (written by
anyrec.calibrate, checked whole and read by `anyrec.backends.hardware`).

    sku: h200                # optional base: a SKU name or auto; omitted = `spec` is complete
    measurements: {...}      # optional: what anyrec.calibrate measured (`Measurements`)
    spec: {...}              # DeviceSpec fields (units in the names) replacing the base's

DeviceSpec fields may also sit at the top level (`base:` naming the SKU), and a cache entry ends with a
`cache:` section (anyrec's calibration cache checks it). Every number is finite, rates and capacities
positive, every figure the planner uses plausible (`PLAUSIBLE` and the records' ranges) and every list
and mapping bounded; unknown keys are refused. A file with `measurements` must carry what it claims:
`measured_fields` lists the DeviceSpec fields it determined, each given in its spec; each measured
section (`SECTION_FIELDS`, `collectives`) has its fields among them; every embedding profile has all its
figures; each sub-group collective has its fit or the reason it was skipped; a spec anyrec.calibrate
wrote comes with its measurements. A file cut short, with a field deleted or an absurd figure fails here
in one line, instead of planning with the base SKU's figures in its place (or predicting `inf` ms).
Measurements come before the spec in what anyrec writes: a file cut anywhere then lacks a figure it
claims or its spec altogether.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from anyrec.backends.records import RecordError, figure, implausible, items, non_finite, parse, text
from anyrec.backends.specs import AUTO_PRECISIONS, DeviceSpec

SPEC_FIELDS = {f.name: f for f in dataclasses.fields(DeviceSpec)}
# How anyrec.calibrate's spec `source` begins: such a spec always comes with its measurements.
CALIBRATED_SOURCE = "anyrec.calibrate on "
# Fields that are assumptions with a default, not figures a file must carry (files written before a field
# was added stay whole without it).
ASSUMED_FIELDS = ("runtime_reserved_bytes", "auto_precision")
STEP = ("step_fixed_s", "step_per_feature_s", "step_per_sample_s", "step_per_id_s", "step_per_value_s",
        "step_per_pair_s", "step_per_dense_tensor_s", "sharding_group_s", "replicated_table_s")
# Fields that may be 0 meaning "unknown" (the planner then falls back or refuses host placement);
# every other number is a capacity, a rate or a width the planner divides by.
MAY_BE_ZERO = ("h2d_bw_bytes_per_s", "runtime_reserved_bytes", "host_memory_bytes",
               "host_memory_bw_bytes_per_s", "scale_up_latency_s", "scale_out_latency_s", "dense_efficiency",
               "comms_efficiency", *STEP)
FILE_KEYS = ("sku", "base", "spec", "measurements", "cache")  # cache: what a cached calibration is for

# What a device can plausibly offer, per DeviceSpec number (units in the names): generous bounds, from a
# small CPU host under load to past today's largest accelerators by about 10x-100x. A figure outside them
# (a bandwidth of 1e-300 B/s, 1e300 FLOP/s) is a broken or forged file; planning with it would predict
# `inf` ms or 0 ms. 0 stays "unknown" where MAY_BE_ZERO says so.
BYTES = (1e6, 1e15)  # 1 MB to 1 PB of memory
BYTES_PER_S = (1e6, 1e14)  # 1 MB/s to 100 TB/s
FLOPS = (1e6, 1e17)  # 1 MFLOP/s to 100 PFLOP/s
SECONDS = (0.0, 86_400.0)  # a measurement's or a phase's time: at most a day
RATIO = (0.0, 1e6)  # spreads, fit errors and scales: relative, >= 0
PLAUSIBLE: dict[str, tuple[float, float]] = {
    "memory_bytes": BYTES,
    "memory_bw_bytes_per_s": BYTES_PER_S,
    "peak_bf16_flops": FLOPS,
    "peak_fp32_flops": FLOPS,
    "simd_width": (1, 1024),
    "scale_up_bw_bytes_per_s": BYTES_PER_S,
    "scale_out_bw_bytes_per_s": BYTES_PER_S,
    "h2d_bw_bytes_per_s": BYTES_PER_S,
    "host_memory_bytes": BYTES,
    "host_memory_bw_bytes_per_s": BYTES_PER_S,
    "runtime_reserved_bytes": (1, 1e13),
    "scale_up_latency_s": (1e-9, 1.0),  # one collective's fixed cost
    "scale_out_latency_s": (1e-9, 1.0),
    "dense_efficiency": (1e-4, 1.0),  # achieved / peak
    "comms_efficiency": (1e-4, 1.0),
    # framework costs of a step: per step and per sharding type or table at most a minute, per item a second
    "step_fixed_s": (0.0, 60.0),
    "step_per_feature_s": (0.0, 1.0),
    "step_per_sample_s": (0.0, 1.0),
    "step_per_id_s": (0.0, 1.0),
    "step_per_value_s": (0.0, 1.0),
    "step_per_pair_s": (0.0, 1.0),
    "step_per_dense_tensor_s": (0.0, 1.0),
    "sharding_group_s": (0.0, 60.0),
    "replicated_table_s": (0.0, 60.0),
}
# A measured embedding profile and a measured collective: the same idea
PROFILE_PLAUSIBLE: dict[str, tuple[float, float]] = {"bw_efficiency": (1e-6, 1.0), "access_bytes": (1, 1e6),
                                                     "per_row_s": (0.0, 1.0), "per_launch_s": (0.0, 1.0)}
LINK_PLAUSIBLE: dict[str, tuple[float, float]] = {"latency_s": (0.0, 1.0), "bus_bw_bytes_per_s": BYTES_PER_S}


def _step_field(name: str) -> Any:
    return figure(*PLAUSIBLE[name], required=True)


@dataclass(frozen=True, kw_only=True)
class StepFields:
    """The trainer's framework costs a calibration fitted (anyrec.calibration.step), in its order."""

    step_fixed_s: float = _step_field("step_fixed_s")
    step_per_feature_s: float = _step_field("step_per_feature_s")
    step_per_sample_s: float = _step_field("step_per_sample_s")
    step_per_id_s: float = _step_field("step_per_id_s")
    step_per_value_s: float = _step_field("step_per_value_s")
    step_per_pair_s: float = _step_field("step_per_pair_s")
    step_per_dense_tensor_s: float = _step_field("step_per_dense_tensor_s")
    sharding_group_s: float = _step_field("sharding_group_s")
    replicated_table_s: float = _step_field("replicated_table_s")


STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepFields))
assert STEP_FIELDS == STEP  # the DeviceSpec fields they set, in the fit's order
# measurements section -> the DeviceSpec fields a calibration derives from it.
SECTION_FIELDS: dict[str, tuple[str, ...]] = {
    "copy_bw_bytes_per_s": ("memory_bw_bytes_per_s",),
    "gemm_flops": ("peak_fp32_flops", "peak_bf16_flops"),
    "dlrm_mlp": ("dense_efficiency",),
    "step": STEP_FIELDS,
}
LINK_FIELDS = ("scale_up_bw_bytes_per_s", "scale_up_latency_s")  # from `collectives.all_to_all`


@dataclass(frozen=True, kw_only=True)
class Profile:
    """An embedding implementation's measured KernelProfile (anyrec.backends.dispatch), as written."""

    bw_efficiency: float = figure(*PROFILE_PLAUSIBLE["bw_efficiency"], required=True)
    access_bytes: int = figure(*PROFILE_PLAUSIBLE["access_bytes"], required=True)
    per_row_s: float = figure(*PROFILE_PLAUSIBLE["per_row_s"], required=True)
    source: str | None = text()
    per_launch_s: float = figure(*PROFILE_PLAUSIBLE["per_launch_s"], required=True)


@dataclass(frozen=True, kw_only=True)
class EmbeddingPoint:
    """One measured embedding step: its shape, the seconds measured and the profile's fit of them."""

    tables: int = figure(1, 1e6, required=True)
    rows: int = figure(1, 1e12, required=True)
    dim: int = figure(1, 1e6, required=True)
    batch: int = figure(1, 1e9, required=True)
    pooling: int = figure(1, 1e6, required=True)
    step_s: float = figure(*SECONDS, required=True)
    fit_s: float = figure(*SECONDS, required=True)
    spread: float | None = figure(*RATIO)


@dataclass(frozen=True, kw_only=True)
class Embedding:
    """One embedding implementation's measurements: its fitted profile, or why it was skipped."""

    profile: Profile | None = None
    points: list[EmbeddingPoint] | None = items(256)
    fit_max_rel_error: float | None = figure(*RATIO)
    skipped: str | None = text()

    def problem(self, at: str) -> str | None:
        """One line when the entry says neither what was measured nor why nothing was."""
        if self.profile is None and self.skipped is None:
            return f"{at} has neither a profile nor a reason it was skipped"
        return None


@dataclass(frozen=True, kw_only=True)
class Link:
    """A collective's seconds per size over some ranks, fitted into latency + bus bytes / bus bandwidth;
    or why it was skipped."""

    sizes_bytes: list[int] | None = items(64, low=1, high=1e12)
    seconds: list[float] | None = items(64, low=SECONDS[0], high=SECONDS[1])
    latency_s: float | None = figure(*LINK_PLAUSIBLE["latency_s"])
    bus_bw_bytes_per_s: float | None = figure(*LINK_PLAUSIBLE["bus_bw_bytes_per_s"])
    skipped: str | None = text()

    def problem(self, at: str) -> str | None:
        """One line when the entry has neither a whole fit nor a reason it was skipped."""
        if self.skipped is None and (self.bus_bw_bytes_per_s is None or self.latency_s is None):
            return f"{at} has neither a fit nor a reason it was skipped"
        return None


@dataclass(frozen=True, kw_only=True)
class Collectives:
    """The whole job's collectives (a world of 2+ ranks), each fitted (`Link`)."""

    world_size: int = figure(2, 1e6, required=True)
    all_to_all: Link | None = None
    all_reduce: Link | None = None
    reduce_scatter: Link | None = None


@dataclass(frozen=True, kw_only=True)
class Subgroup:
    """2D's collectives for one sharding group size: the all-to-all within each group and the all-reduce
    across each group's `replicas`, on a world of `world_size` ranks; or why the size was skipped."""

    world_size: int | None = figure(2, 1e6)
    replicas: int | None = figure(0, 1e6)
    all_to_all: Link | None = None
    all_reduce_replicas: Link | None = None
    skipped: str | None = text()

    def problem(self, at: str) -> str | None:
        """One line when the entry has neither its replicas nor why it was skipped, or lacks a fit."""
        if self.replicas is None:
            return None if self.skipped is not None else \
                f"{at} has neither its replicas nor a reason it was skipped"
        for op in ("all_to_all", "all_reduce_replicas"):
            if getattr(self, op) is None:
                return f"{at}.{op} has neither a fit nor a reason it was skipped"
        return None


@dataclass(frozen=True, kw_only=True)
class GemmFlops:
    """Achieved dense GEMM FLOP/s per dtype."""

    fp32: float = figure(*FLOPS, required=True)
    bf16: float = figure(*FLOPS, required=True)


@dataclass(frozen=True, kw_only=True)
class DlrmMlp:
    """A DLRM-shaped MLP's forward + backward: FLOP/s achieved, its size and its step."""

    flops: float = figure(*FLOPS, required=True)
    params: int = figure(1, 1e12, required=True)
    batch: int = figure(1, 1e9, required=True)
    step_s: float = figure(*SECONDS, required=True)


@dataclass(frozen=True, kw_only=True)
class StepPoint:
    """One trainer step point: its workload, the seconds measured, and the model's and the fit's."""

    name: str = text(256, required=True)
    tables: int | None = figure(1, 1e6)
    dim: int | None = figure(1, 1e6)
    batch: int | None = figure(1, 1e9)
    pooling: int | None = figure(1, 1e6)
    shardings: list[str] | None = items(64)
    measured_s: float = figure(*SECONDS, required=True)
    model_s: float | None = figure(*SECONDS)
    fit_s: float | None = figure(*SECONDS)
    spread: float | None = figure(*RATIO)


@dataclass(frozen=True, kw_only=True)
class Step:
    """The trainer's step points and the framework costs fitted from them (or the built-in ones scaled
    to the points measured in time, `builtin_scale`)."""

    fields: StepFields | None = None
    steps_per_point: int = figure(1, 1e6, required=True)
    passes: int = figure(0, 1e3, required=True)
    points: list[StepPoint] = items(256, required=True)
    fit_max_rel_error: float | None = figure(*RATIO)
    builtin_scale: float | None = figure(*RATIO)


@dataclass(frozen=True, kw_only=True)
class TrustVerdict:
    """Whether the figures are this machine's (anyrec's calibration trust verdict), as written."""

    trusted: bool = field()
    reasons: list[str] | None = items(64)
    other_cores: float | None = figure(0.0, 1e6, null=True)
    cores: int | None = figure(0, 1e6)
    median_spread: float | None = figure(*RATIO, null=True)


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """What a calibration measured, in the order it writes them (units in the key names)."""

    copy_bw_bytes_per_s: float | None = figure(*BYTES_PER_S)
    h2d_bw_bytes_per_s: float | None = figure(*BYTES_PER_S)
    h2d_pageable_bw_bytes_per_s: float | None = figure(*BYTES_PER_S)
    gemm_flops: GemmFlops | None = None
    dlrm_mlp: DlrmMlp | None = None
    embedding: dict[str, Embedding] | None = items(64)
    collectives: Collectives | None = None
    collectives_subgroups: dict[int, Subgroup] | None = items(
        64, key_min=2, key_label="group size", shape="of group size to measurements")
    step: Step | None = None
    step_unused: Step | None = None  # step points too few to fit: kept for the record
    phase_s: dict[str, float] | None = items(16, low=SECONDS[0], high=SECONDS[1])
    threads: int | None = figure(1, 1e6)
    bind_cores: bool | None = None
    spread: dict[str, float] | None = items(low=RATIO[0], high=RATIO[1])
    bind_rule: str | None = text()
    trust: TrustVerdict | None = None
    measured_fields: list[str] = items(len(SPEC_FIELDS), required=True)  # DeviceSpec fields measured
    seconds: float | None = figure(*SECONDS)  # the whole calibration's time

    def problem(self, at: str) -> str | None:
        """One line when the measurements do not carry what they claim."""
        unknown = [f for f in self.measured_fields if f not in SPEC_FIELDS]
        if unknown:
            return f"measured_fields names unknown DeviceSpec field(s) {', '.join(unknown)}"
        claims = {section: fields for section, fields in SECTION_FIELDS.items()
                  if getattr(self, section) is not None}
        if self.collectives is not None and self.collectives.all_to_all is not None \
                and self.collectives.all_to_all.bus_bw_bytes_per_s is not None:
            claims["collectives"] = LINK_FIELDS
        for section, fields in claims.items():
            lacking = [f for f in fields if f not in self.measured_fields]
            if lacking:
                return f"measured {section} but measured_fields lacks {', '.join(lacking)}"
        if self.step is not None and self.step.fields is None:
            return f"{at}.step lacks fields ({', '.join(STEP_FIELDS)})"
        for group, entry in (self.collectives_subgroups or {}).items():
            replicas = entry.replicas
            if replicas is not None and (replicas < 2 or entry.world_size != group * replicas):
                return (f"{at}.collectives_subgroups.{group}: needs replicas >= 2 and world_size = {group} x "
                        f"replicas, got replicas {entry.replicas}, world_size {entry.world_size}")
        return None


@dataclass(frozen=True, kw_only=True)
class HardwareFile:
    """A whole hardware file: the base SKU, if any, the measurements and the DeviceSpec fields."""

    sku: str | None = None  # the base: a SKU name or auto; None: `spec` is complete
    measurements: Measurements | None = None
    spec: dict[str, Any] = field(default_factory=dict)  # DeviceSpec fields, typed as DeviceSpec types them
    cache: Any = None  # a cache entry's own section (anyrec's calibration cache checks it)


def check_spec_value(name: str, value: Any, where: str) -> None:
    """One DeviceSpec number: finite, and positive unless 0 means unknown for it, and plausible."""
    if SPEC_FIELDS[name].type not in ("int", "float"):
        return
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RecordError(f"{where}: {name}: expected a number, got {value!r}") from None
    zero_ok = name in MAY_BE_ZERO
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        raise RecordError(f"{where}: {name} must be a finite number {'>= 0' if zero_ok else '> 0'}, "
                          f"got {value}")
    problem = implausible(name, number, PLAUSIBLE[name], zero_ok)
    if problem:
        raise RecordError(f"{where}: {problem}")


def spec_value(name: str, value: Any, where: str) -> Any:
    """One DeviceSpec field from YAML, checked and typed as DeviceSpec types it (numbers may arrive as
    strings: '1.9e11' is a str in YAML 1.1)."""
    check_spec_value(name, value, where)
    kind = SPEC_FIELDS[name].type
    if kind == "int":
        return int(float(value))
    if kind == "float":
        return float(value)
    if isinstance(value, dict | list) or len(str(value)) > 4096:
        raise RecordError(f"{where}: {name} must be a short string, got {type(value).__name__}")
    if name == "auto_precision" and value not in AUTO_PRECISIONS:
        raise RecordError(f"{where}: auto_precision must be one of {', '.join(AUTO_PRECISIONS)}, got "
                          f"{value!r}")
    return str(value)


def spec_fields(fields: dict[str, Any], where: str) -> dict[str, Any]:
    """DeviceSpec `fields` (a file's `spec`, or overrides) checked and typed; unknown names refused."""
    unknown = sorted(str(k) for k in set(fields) - set(SPEC_FIELDS))
    if unknown:
        raise RecordError(f"{where}: unknown DeviceSpec field(s) {', '.join(unknown)}; "
                          f"known: {', '.join(SPEC_FIELDS)}")
    return {name: spec_value(name, value, where) for name, value in fields.items()}


def read_measurements(data: Any, spec: dict[str, Any], where: str) -> Measurements:
    """A file's `measurements` checked whole, with the DeviceSpec fields `spec` it comes with."""
    if not isinstance(data, dict) or not data:
        raise RecordError(f"{where}: `measurements` is empty or not a mapping")
    measured = data.get("measured_fields")
    if not isinstance(measured, list) or not all(isinstance(f, str) for f in measured):
        raise RecordError(f"{where}: claims measurements but lacks measurements.measured_fields (cut short?)")
    m = parse(Measurements, data, "measurements", where)
    absent = [f for f in m.measured_fields if f not in spec]
    if absent:
        raise RecordError(f"{where}: claims to have measured {', '.join(absent)} but its spec lacks "
                          f"{'it' if len(absent) == 1 else 'them'}")
    return m


def is_hardware_path(sku: str) -> bool:
    """Whether a `hardware` value names a file rather than a SKU (a .yaml/.yml name or a path)."""
    return sku.endswith((".yaml", ".yml", ".json")) or os.sep in sku or "/" in sku


def read_hardware_file(data: Any, where: str) -> HardwareFile:
    """A parsed hardware file (`where` names it in errors) checked whole: its keys, its spec's fields and
    numbers, its measurements and what they claim, and without a base SKU, a complete spec."""
    data = data or {}
    if not isinstance(data, dict):
        raise RecordError(f"{where}: expected a mapping with keys {', '.join(FILE_KEYS)}")
    data = dict(data)
    data.pop("defaults", None)  # present when the file doubles as a Hydra group option
    unknown = sorted(str(k) for k in set(data) - set(FILE_KEYS) - set(SPEC_FIELDS))
    if unknown:
        raise RecordError(f"{where}: unknown key(s) {', '.join(unknown)}; expected "
                          f"{', '.join(FILE_KEYS)} or DeviceSpec fields")
    given = data.get("spec") or {}
    if not isinstance(given, dict):
        raise RecordError(f"{where}: `spec` must be a mapping of DeviceSpec fields")
    flat = {k: v for k, v in data.items() if k in SPEC_FIELDS}
    if set(flat) & set(given):
        raise RecordError(f"{where}: {', '.join(sorted(set(flat) & set(given)))} given twice")
    spec = spec_fields({**given, **flat}, where)
    bad = non_finite(data.get("cache"), "cache")
    if bad:
        raise RecordError(f"{where}: {bad} is not a finite number")
    if "sku" in data and "base" in data:
        raise RecordError(f"{where}: give the base SKU once (`sku:` or `base:`)")
    base = data.get("sku", data.get("base"))
    if base is not None and (isinstance(base, dict | list) or is_hardware_path(str(base))):
        raise RecordError(f"{where}: `sku: {base}` must be a SKU name or auto, not a file")
    if "measurements" in data:
        measurements = read_measurements(data["measurements"], spec, where)
    elif str(spec.get("source", "")).startswith(CALIBRATED_SOURCE):
        raise RecordError(f"{where}: its spec says anyrec.calibrate measured it, but the file has no "
                          "`measurements` (cut short?); calibrate again")
    else:
        measurements = None
    # Without a base every figure must be there (assumptions keep their defaults): a spec cut short (the
    # older layout wrote the spec first) would otherwise plan with defaults in place of the figures it lost.
    missing = [n for n in SPEC_FIELDS if n not in spec and n not in ASSUMED_FIELDS]
    if base is None and missing:
        raise RecordError(f"{where}: no `sku:` base and spec lacks {', '.join(missing[:6])}"
                          f"{f' (+{len(missing) - 6} more)' if len(missing) > 6 else ''}: cut short or "
                          "written by an older anyrec (calibrate again), or name a base with `sku:`")
    return HardwareFile(sku=None if base is None else str(base), measurements=measurements, spec=spec,
                        cache=data.get("cache"))
