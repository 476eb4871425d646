"""A hardware / calibration YAML checked whole before any of it is used (given as `hardware.sku=FILE`
or found in the calibration cache).

A file with a `measurements` section must carry what it claims: `measured_fields` lists the DeviceSpec
fields it determined, each given in its spec; each measured section (`copy_bw_bytes_per_s`,
`gemm_flops`, `dlrm_mlp`, `collectives`, `step`) has its fields among them; every embedding profile
has all its figures; each sub-group collective (`collectives_subgroups`, absent in older files) has its
fit or the reason it was skipped; a spec anyrec.calibrate wrote comes with its measurements (the older
layout put the spec first). Every number is finite, rates and capacities positive, and every figure the
planner uses plausible (`PLAUSIBLE`). A file cut short, with a field deleted or with an absurd figure fails
here in one line, instead of planning with the base SKU's figures in its place (or predicting `inf` ms).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from anyrec.backends.specs import DeviceSpec

SPEC_FIELDS = {f.name: f for f in dataclasses.fields(DeviceSpec)}
# The trainer's framework costs (anyrec.calibration.step fits them, in this order).
STEP_FIELDS = ("step_fixed_s", "step_per_feature_s", "step_per_sample_s", "step_per_id_s", "step_per_value_s",
               "step_per_pair_s", "step_per_dense_tensor_s", "sharding_group_s", "replicated_table_s")
# measurements section -> the DeviceSpec fields a calibration derives from it.
SECTION_FIELDS: dict[str, tuple[str, ...]] = {
    "copy_bw_bytes_per_s": ("memory_bw_bytes_per_s",),
    "gemm_flops": ("peak_fp32_flops", "peak_bf16_flops"),
    "dlrm_mlp": ("dense_efficiency",),
    "step": STEP_FIELDS,
}
# How anyrec.calibrate's spec `source` begins: such a spec always comes with its measurements.
CALIBRATED_SOURCE = "anyrec.calibrate on "
PROFILE_FIELDS = ("bw_efficiency", "access_bytes", "per_row_s", "per_launch_s")
# Fields that are assumptions with a default, not figures a file must carry (files written before a field
# was added stay whole without it).
ASSUMED_FIELDS = ("runtime_reserved_bytes",)
# Fields that may be 0 meaning "unknown" (the planner then falls back or refuses host placement);
# every other number is a capacity, a rate or a width the planner divides by.
MAY_BE_ZERO = ("h2d_bw_bytes_per_s", "runtime_reserved_bytes", "host_memory_bytes",
               "host_memory_bw_bytes_per_s", "scale_up_latency_s", "scale_out_latency_s", "dense_efficiency",
               "comms_efficiency", *STEP_FIELDS)


# What a device can plausibly offer, per DeviceSpec number (units in the names): generous bounds, from a
# small CPU host under load to past today's largest accelerators by about 10x-100x. A figure outside them
# (a bandwidth of 1e-300 B/s, 1e300 FLOP/s) is a broken or forged file; planning with it would predict
# `inf` ms or 0 ms. 0 stays "unknown" where MAY_BE_ZERO says so.
BYTES = (1e6, 1e15)  # 1 MB to 1 PB of memory
BYTES_PER_S = (1e6, 1e14)  # 1 MB/s to 100 TB/s
FLOPS = (1e6, 1e17)  # 1 MFLOP/s to 100 PFLOP/s
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


def _unit(name: str) -> str:
    """The unit a figure's name carries, for messages."""
    units = (("_bytes_per_s", " bytes/s"), ("_bytes", " bytes"), ("_flops", " FLOP/s"), ("_s", " s"))
    for suffix, unit in units:
        if name.endswith(suffix):
            return unit
    return ""


def implausible(name: str, value: float, bounds: tuple[float, float], zero_ok: bool = False) -> str | None:
    """`name = value is implausible: expected ...` when a figure lies outside its plausible `bounds`."""
    low, high = bounds
    if low <= value <= high or (zero_ok and value == 0):
        return None
    unknown = " (or 0: unknown)" if zero_ok else ""
    return f"{name} = {value:g} is implausible: expected {low:g} to {high:g}{_unit(name)}{unknown}"


def _non_finite(value: Any, path: str) -> str | None:
    """The dotted path of the first NaN or infinite number in `value`, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return next((bad for k, v in items if (bad := _non_finite(v, f"{path}.{k}" if path else str(k)))), None)


def check_spec_value(name: str, value: Any, where: str) -> None:
    """One DeviceSpec number: finite, and positive unless 0 means unknown for it."""
    if SPEC_FIELDS[name].type not in ("int", "float"):
        return
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name}: expected a number, got {value!r}") from None
    zero_ok = name in MAY_BE_ZERO
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        raise ValueError(f"{where}: {name} must be a finite number {'>= 0' if zero_ok else '> 0'}, "
                         f"got {value}")
    problem = implausible(name, number, PLAUSIBLE[name], zero_ok)
    if problem:
        raise ValueError(f"{where}: {problem}")


def check_profile(name: str, fields: Any, where: str) -> None:
    """An embedding implementation's measured KernelProfile: every figure present, finite, in range."""
    at = f"{where}: measurements.embedding.{name}.profile"
    if not isinstance(fields, dict):
        raise ValueError(f"{at} must be a mapping")
    missing = [k for k in PROFILE_FIELDS if k not in fields]
    if missing:
        raise ValueError(f"{at} lacks {', '.join(missing)}")
    unknown = sorted(set(fields) - {*PROFILE_FIELDS, "source"})
    if unknown:
        raise ValueError(f"{at}: unknown field(s) {', '.join(unknown)}")
    for k in PROFILE_FIELDS:
        v = fields[k]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"{at}.{k} must be a finite number, got {v!r}")
    if not 0 < fields["bw_efficiency"] <= 1 or fields["access_bytes"] <= 0 or fields["per_row_s"] < 0 \
            or not 0 <= fields["per_launch_s"] < 1:
        raise ValueError(f"{at}: needs 0 < bw_efficiency <= 1, access_bytes > 0, per_row_s >= 0 and "
                         f"0 <= per_launch_s < 1 s; got {fields}")
    for k, bounds in PROFILE_PLAUSIBLE.items():
        problem = implausible(k, fields[k], bounds)
        if problem:
            raise ValueError(f"{at}.{problem}")


SUBGROUP_OPS = ("all_to_all", "all_reduce_replicas")


def _positive_int(value: Any) -> int | None:
    """`value` as a positive int (YAML keys may arrive as int or as digits), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return int(value) if int(value) > 0 else None
    return None


def check_subgroups(subgroups: Any, where: str) -> None:
    """`measurements.collectives_subgroups`: per group size (a proper divisor of the world, >= 2), the
    replica count and each collective's fit (latency >= 0, bus bandwidth > 0) or why it was skipped."""
    at = f"{where}: measurements.collectives_subgroups"
    if not isinstance(subgroups, dict):
        raise ValueError(f"{at} must be a mapping of group size to measurements")
    for key, entry in subgroups.items():
        group = _positive_int(key)
        if group is None or group < 2:
            raise ValueError(f"{at}: group size {key!r} is not an integer >= 2")
        if not isinstance(entry, dict):
            raise ValueError(f"{at}.{key} must be a mapping")
        if "replicas" not in entry:
            if not isinstance(entry.get("skipped"), str):
                raise ValueError(f"{at}.{key} has neither its replicas nor a reason it was skipped")
            continue
        replicas, world = _positive_int(entry["replicas"]), _positive_int(entry.get("world_size"))
        if replicas is None or replicas < 2 or world != group * replicas:
            raise ValueError(f"{at}.{key}: needs replicas >= 2 and world_size = {key} x replicas, got "
                             f"replicas {entry['replicas']!r}, world_size {entry.get('world_size')!r}")
        for op in SUBGROUP_OPS:
            fit = entry.get(op)
            if not isinstance(fit, dict) or ("skipped" not in fit and "bus_bw_bytes_per_s" not in fit):
                raise ValueError(f"{at}.{key}.{op} has neither a fit nor a reason it was skipped")
            if "skipped" in fit:
                continue
            lat, bw = fit.get("latency_s"), fit["bus_bw_bytes_per_s"]
            if any(isinstance(v, bool) or not isinstance(v, int | float) for v in (lat, bw)) \
                    or lat < 0 or bw <= 0:
                raise ValueError(f"{at}.{key}.{op}: needs latency_s >= 0 and bus_bw_bytes_per_s > 0, got "
                                 f"{lat!r} and {bw!r}")
            for k, bounds in LINK_PLAUSIBLE.items():
                problem = implausible(k, fit[k], bounds)
                if problem:
                    raise ValueError(f"{at}.{key}.{op}.{problem}")


def check_hardware_data(data: dict[str, Any], spec_fields: dict[str, Any], where: str) -> None:
    """Raise ValueError (one line naming `where`) unless the parsed file `data`, whose DeviceSpec
    fields (from `spec:` and the top level) are `spec_fields`, is whole and every number in it sane."""
    for name, value in spec_fields.items():
        if name in SPEC_FIELDS:
            check_spec_value(name, value, where)
    bad = _non_finite(data, "")
    if bad:
        raise ValueError(f"{where}: {bad} is not a finite number")
    if "measurements" not in data:
        if str(spec_fields.get("source", "")).startswith(CALIBRATED_SOURCE):
            raise ValueError(f"{where}: its spec says anyrec.calibrate measured it, but the file has no "
                             "`measurements` (cut short?); calibrate again")
        return
    m = data["measurements"]
    if not isinstance(m, dict) or not m:
        raise ValueError(f"{where}: `measurements` is empty or not a mapping")
    measured = m.get("measured_fields")
    if not isinstance(measured, list) or not all(isinstance(f, str) for f in measured):
        raise ValueError(f"{where}: claims measurements but lacks measurements.measured_fields (cut short?)")
    unknown = [f for f in measured if f not in SPEC_FIELDS]
    if unknown:
        raise ValueError(f"{where}: measured_fields names unknown DeviceSpec field(s) {', '.join(unknown)}")
    absent = [f for f in measured if f not in spec_fields]
    if absent:
        raise ValueError(f"{where}: claims to have measured {', '.join(absent)} but its spec lacks "
                         f"{'it' if len(absent) == 1 else 'them'}")
    claims = {section: fields for section, fields in SECTION_FIELDS.items() if section in m}
    coll = m.get("collectives")
    if isinstance(coll, dict) and isinstance(coll.get("all_to_all"), dict) \
            and "bus_bw_bytes_per_s" in coll["all_to_all"]:
        claims["collectives"] = ("scale_up_bw_bytes_per_s", "scale_up_latency_s")
    for section, fields in claims.items():
        lacking = [f for f in fields if f not in measured]
        if lacking:
            raise ValueError(f"{where}: measured {section} but measured_fields lacks {', '.join(lacking)}")
    if "collectives_subgroups" in m:
        check_subgroups(m["collectives_subgroups"], where)
    step = m.get("step")
    if step is not None:
        got = step.get("fields") if isinstance(step, dict) else None
        if not isinstance(got, dict) or any(f not in got for f in STEP_FIELDS):
            raise ValueError(f"{where}: measurements.step lacks fields ({', '.join(STEP_FIELDS)})")
    emb = m.get("embedding")
    if emb is not None:
        if not isinstance(emb, dict):
            raise ValueError(f"{where}: measurements.embedding must be a mapping")
        for name, entry in emb.items():
            if not isinstance(entry, dict) or ("profile" not in entry and "skipped" not in entry):
                raise ValueError(f"{where}: measurements.embedding.{name} has neither a profile nor a "
                                 "reason it was skipped")
            if "profile" in entry:
                check_profile(name, entry["profile"], where)
