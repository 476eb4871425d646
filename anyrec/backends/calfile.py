"""A hardware / calibration YAML checked whole before any of it is used: the one check every such file
passes, whether given as `hardware.sku=FILE.yaml` or found in the calibration cache.

A file may be a plain spec (a base SKU and some fields, or a complete spec). A file with a
`measurements` section claims what it measured, and then must carry it: `measured_fields` lists the
DeviceSpec fields it determined, each of them given in the file's spec; each measured section
(`copy_bw_bytes_per_s`, `gemm_flops`, `dlrm_mlp`, `collectives`, `step`) has its fields among them;
every embedding profile has all its figures. Every number anywhere in the file is finite, rates and
capacities are positive. A file cut short or with a field deleted therefore fails here, in one line
naming the file and what is missing, instead of planning with the base SKU's figures in its place.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from anyrec.backends.specs import DeviceSpec

SPEC_FIELDS = {f.name: f for f in dataclasses.fields(DeviceSpec)}
# The trainer's framework costs (anyrec.calibrate_step fits them, in this order).
STEP_FIELDS = ("step_fixed_s", "step_per_feature_s", "step_per_sample_s", "step_per_id_s", "step_per_value_s",
               "step_per_pair_s", "step_per_dense_tensor_s", "sharding_group_s", "replicated_table_s")
# measurements section -> the DeviceSpec fields a calibration derives from it.
SECTION_FIELDS: dict[str, tuple[str, ...]] = {
    "copy_bw_bytes_per_s": ("memory_bw_bytes_per_s",),
    "gemm_flops": ("peak_fp32_flops", "peak_bf16_flops"),
    "dlrm_mlp": ("dense_efficiency",),
    "step": STEP_FIELDS,
}
PROFILE_FIELDS = ("bw_efficiency", "access_bytes", "per_row_s", "per_launch_s")
# Fields that may be 0 meaning "unknown" (the planner then falls back or refuses host placement);
# every other number is a capacity, a rate or a width the planner divides by.
MAY_BE_ZERO = ("h2d_bw_bytes_per_s", "host_memory_bytes", "host_memory_bw_bytes_per_s",
               "scale_up_latency_s", "scale_out_latency_s", "dense_efficiency", "comms_efficiency",
               *STEP_FIELDS)


class HardwareFileError(ValueError):
    """A hardware / calibration file that is incomplete or holds a number that cannot be right."""


def _non_finite(value: Any, path: str) -> str | None:
    """The dotted path of the first NaN or infinite number in `value`, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        found = _non_finite(v, f"{path}.{k}" if path else str(k))
        if found:
            return found
    return None


def check_spec_value(name: str, value: Any, where: str) -> None:
    """One DeviceSpec number: finite, and positive unless 0 means unknown for it."""
    if SPEC_FIELDS[name].type not in ("int", "float"):
        return
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise HardwareFileError(f"{where}: {name}: expected a number, got {value!r}") from None
    zero_ok = name in MAY_BE_ZERO
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        raise HardwareFileError(f"{where}: {name} must be a finite number {'>= 0' if zero_ok else '> 0'}, "
                                f"got {value}")


def check_profile(name: str, fields: Any, where: str) -> None:
    """An embedding implementation's measured KernelProfile: every figure present, finite, in range."""
    at = f"{where}: measurements.embedding.{name}.profile"
    if not isinstance(fields, dict):
        raise HardwareFileError(f"{at} must be a mapping")
    missing = [k for k in PROFILE_FIELDS if k not in fields]
    if missing:
        raise HardwareFileError(f"{at} lacks {', '.join(missing)}")
    unknown = sorted(set(fields) - {*PROFILE_FIELDS, "source"})
    if unknown:
        raise HardwareFileError(f"{at}: unknown field(s) {', '.join(unknown)}")
    for k in PROFILE_FIELDS:
        v = fields[k]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise HardwareFileError(f"{at}.{k} must be a finite number, got {v!r}")
    if not 0 < fields["bw_efficiency"] <= 1 or fields["access_bytes"] <= 0 or fields["per_row_s"] < 0 \
            or not 0 <= fields["per_launch_s"] < 1:
        raise HardwareFileError(f"{at}: needs 0 < bw_efficiency <= 1, access_bytes > 0, per_row_s >= 0 and "
                                f"0 <= per_launch_s < 1 s; got {fields}")


def check_hardware_data(data: dict[str, Any], spec_fields: dict[str, Any], where: str) -> None:
    """Raise HardwareFileError (one line naming `where`) unless the parsed file `data`, whose DeviceSpec
    fields (from `spec:` and the top level) are `spec_fields`, is whole and every number in it sane."""
    for name, value in spec_fields.items():
        if name in SPEC_FIELDS:
            check_spec_value(name, value, where)
    bad = _non_finite(data, "")
    if bad:
        raise HardwareFileError(f"{where}: {bad} is not a finite number")
    if "measurements" not in data:
        return
    m = data["measurements"]
    if not isinstance(m, dict) or not m:
        raise HardwareFileError(f"{where}: `measurements` is empty or not a mapping")
    measured = m.get("measured_fields")
    if not isinstance(measured, list) or not all(isinstance(f, str) for f in measured):
        raise HardwareFileError(f"{where}: claims measurements but lacks measurements.measured_fields "
                                "(cut short?)")
    unknown = [f for f in measured if f not in SPEC_FIELDS]
    if unknown:
        raise HardwareFileError(f"{where}: measured_fields names unknown DeviceSpec field(s) "
                                f"{', '.join(unknown)}")
    absent = [f for f in measured if f not in spec_fields]
    if absent:
        raise HardwareFileError(f"{where}: claims to have measured {', '.join(absent)} but its spec lacks "
                                f"{'it' if len(absent) == 1 else 'them'}")
    for section, fields in SECTION_FIELDS.items():
        if section in m:
            lacking = [f for f in fields if f not in measured]
            if lacking:
                raise HardwareFileError(f"{where}: measured {section} but measured_fields lacks "
                                        f"{', '.join(lacking)}")
    step = m.get("step")
    if step is not None:
        got = step.get("fields") if isinstance(step, dict) else None
        if not isinstance(got, dict) or any(f not in got for f in STEP_FIELDS):
            raise HardwareFileError(f"{where}: measurements.step lacks fields ({', '.join(STEP_FIELDS)})")
    coll = m.get("collectives")
    if isinstance(coll, dict):
        a2a = coll.get("all_to_all", {})
        if isinstance(a2a, dict) and "bus_bw_bytes_per_s" in a2a:
            lacking = [f for f in ("scale_up_bw_bytes_per_s", "scale_up_latency_s") if f not in measured]
            if lacking:
                raise HardwareFileError(f"{where}: measured collectives but measured_fields lacks "
                                        f"{', '.join(lacking)}")
    emb = m.get("embedding")
    if emb is not None:
        if not isinstance(emb, dict):
            raise HardwareFileError(f"{where}: measurements.embedding must be a mapping")
        for name, entry in emb.items():
            if not isinstance(entry, dict) or ("profile" not in entry and "skipped" not in entry):
                raise HardwareFileError(f"{where}: measurements.embedding.{name} has neither a profile "
                                        "nor a reason it was skipped")
            if "profile" in entry:
                check_profile(name, entry["profile"], where)
