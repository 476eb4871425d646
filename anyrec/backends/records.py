"""Typed records read from untrusted YAML: frozen dataclasses whose fields say what each key holds.

A record's fields carry the checks: the type (`float`, `int`, `bool`, `str`, `X | None`, `list[X]`,
`dict[str, X]`, `dict[int, X]`, a nested record, or `Any` for an opaque part another module checks), a
plausible range for numbers (`figure`), a bound on sizes (`items`, `text`), and a field without a default
is required. `parse` checks a mapping against a record whole (types, finiteness, ranges, nesting, unknown
and missing keys, sizes, then the record's own cross-field `problem`) and returns the value or raises
`RecordError`, one line naming the file and the dotted path; `to_data` writes a value back as plain data
in field order (a None field left out unless it is written as null).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import MISSING, field
from typing import Any

MAX_ITEMS = 4096  # entries of a list or mapping, unless its field says otherwise
MAX_CHARS = 4096  # characters of a string, unless its field says otherwise


class RecordError(ValueError):
    """A file's content does not match its record: one line naming the file and where in it."""


def figure(low: float, high: float, *, zero_ok: bool = False, required: bool = False,
           null: bool = False) -> Any:
    """A number field plausible between `low` and `high` (units in its name); `zero_ok`: 0 also allowed
    (it means unknown); `required`: no default; `null`: None is written as null rather than left out."""
    return field(default=MISSING if required else None,
                 metadata={"range": (low, high), "zero_ok": zero_ok, "null": null})


def items(max_items: int = MAX_ITEMS, *, required: bool = False, key_min: int | None = None,
          key_label: str = "key", shape: str = "", **number: Any) -> Any:
    """A list or mapping field of at most `max_items` entries; `key_min`: integer keys at least that
    (`key_label` names them in errors); `shape`: what a mapping maps, for errors; `number`: `figure`'s
    range (`low`, `high`, `zero_ok`) for the numbers it holds."""
    meta: dict[str, Any] = {"max_items": max_items, "key_min": key_min, "key_label": key_label,
                            "shape": shape}
    if number:
        meta.update(range=(number["low"], number["high"]), zero_ok=number.get("zero_ok", False))
    return field(default=MISSING if required else None, metadata=meta)


def text(max_chars: int = MAX_CHARS, *, required: bool = False) -> Any:
    """A string field of at most `max_chars` characters."""
    return field(default=MISSING if required else None, metadata={"max_chars": max_chars})


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


def non_finite(value: Any, path: str) -> str | None:
    """The dotted path of the first NaN or infinite number in `value`, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    entries = (value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list)
               else ())
    return next((bad for k, v in entries if (bad := non_finite(v, f"{path}.{k}" if path else str(k)))), None)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse(cls: type, data: Any, at: str, where: str) -> Any:
    """`data` checked whole against record `cls` (`at`: its dotted path in the file named by `where`)."""
    if not isinstance(data, dict):
        raise RecordError(f"{where}: {at} must be a mapping")
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    unknown = sorted(str(k) for k in data if k not in names)
    if unknown:
        raise RecordError(f"{where}: {at}: unknown field(s) {', '.join(unknown)}")
    missing = [f.name for f in fields if f.default is MISSING and f.default_factory is MISSING
               and f.name not in data]
    if missing:
        raise RecordError(f"{where}: {at} lacks {', '.join(missing)}")
    hints = _hints(cls)
    value = cls(**{f.name: _value(hints[f.name], data[f.name], f"{at}.{f.name}", f.metadata, where)
                   for f in fields if f.name in data})
    problem = value.problem(at) if hasattr(value, "problem") else None
    if problem:
        raise RecordError(f"{where}: {problem}")
    return value


def from_data(tp: Any, data: Any, at: str, where: str = "measured") -> Any:
    """Plain data (`to_data`'s, perhaps through JSON: integer keys as digits) as a value of type `tp` (a
    record, or a list or mapping of them), checked as `parse` checks a file's part at `at`."""
    return _value(tp, data, at, {}, where)


def _number(v: Any, at: str, meta: typing.Mapping[str, Any], where: str, kind: type) -> int | float:
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise RecordError(f"{where}: {at} must be a finite number, got {v!r}")
    if isinstance(v, str):  # an integer written as digits (a YAML key, a hand-edited file)
        if kind is not int or not v.isdigit():
            raise RecordError(f"{where}: {at} must be a finite number, got {v!r}")
        v = int(v)
    if isinstance(v, float) and not math.isfinite(v):
        raise RecordError(f"{where}: {at} is not a finite number")
    if kind is int:
        if isinstance(v, float) and not v.is_integer():
            raise RecordError(f"{where}: {at} must be an integer, got {v!r}")
        v = int(v)
    else:
        v = float(v)
    if "range" in meta:
        problem = implausible(at, v, meta["range"], meta.get("zero_ok", False))
        if problem:
            raise RecordError(f"{where}: {problem}")
    return v


def _sized(v: Any, at: str, meta: typing.Mapping[str, Any], where: str) -> None:
    limit = meta.get("max_items", MAX_ITEMS)
    if len(v) > limit:
        raise RecordError(f"{where}: {at} has {len(v)} entries, more than the {limit} allowed")


def _value(tp: Any, v: Any, at: str, meta: typing.Mapping[str, Any], where: str) -> Any:
    """One field's value `v` checked against its type `tp` (and `meta`), converted (lists to tuples)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:  # opaque: another module reads it; still finite and bounded
        bad = non_finite(v, at)
        if bad:
            raise RecordError(f"{where}: {bad} is not a finite number")
        return v
    if origin in (types.UnionType, typing.Union):
        if v is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _value(inner, v, at, meta, where)
    if dataclasses.is_dataclass(tp):
        return parse(tp, v, at, where)
    if tp is bool:
        if not isinstance(v, bool):
            raise RecordError(f"{where}: {at} must be true or false, got {v!r}")
        return v
    if tp in (int, float):
        return _number(v, at, meta, where, tp)
    if tp is str:
        if not isinstance(v, str):
            raise RecordError(f"{where}: {at} must be a string, got {v!r}")
        limit = meta.get("max_chars", MAX_CHARS)
        if len(v) > limit:
            raise RecordError(f"{where}: {at} is longer than {limit} characters")
        return v
    if origin in (list, tuple):
        if not isinstance(v, list):
            raise RecordError(f"{where}: {at} must be a list")
        _sized(v, at, meta, where)
        return tuple(_value(args[0], x, f"{at}.{i}", meta, where) for i, x in enumerate(v))
    if origin is dict:
        if not isinstance(v, dict):
            shape = f" {meta['shape']}" if meta.get("shape") else ""
            raise RecordError(f"{where}: {at} must be a mapping{shape}")
        _sized(v, at, meta, where)
        return {_key(args[0], k, at, meta, where): _value(args[1], x, f"{at}.{k}", meta, where)
                for k, x in v.items()}
    raise TypeError(f"record field {at}: unsupported type {tp}")  # a schema bug, not a file's


def _key(tp: Any, k: Any, at: str, meta: typing.Mapping[str, Any], where: str) -> Any:
    if tp is str:
        if not isinstance(k, str) or len(k) > MAX_CHARS:
            raise RecordError(f"{where}: {at}: key {k!r} is not a string")
        return k
    low = meta.get("key_min")
    number = None if isinstance(k, bool) else k if isinstance(k, int) else \
        int(k) if isinstance(k, str) and k.isdigit() else None
    if number is None or (low is not None and number < low):
        at_least = f" >= {low}" if low is not None else ""
        raise RecordError(f"{where}: {at}: {meta.get('key_label', 'key')} {k!r} is not an integer{at_least}")
    return number


def to_data(value: Any, _seen: dict[int, Any] | None = None) -> Any:
    """A record (or what it holds) as plain data for YAML: mappings in field order, tuples as lists, a
    None field left out unless its field says it is written as null. A list held twice is written once
    and referred to (as YAML writes one object it meets twice)."""
    seen = {} if _seen is None else _seen
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_data(getattr(value, f.name), seen) for f in dataclasses.fields(value)
                if getattr(value, f.name) is not None or f.metadata.get("null")}
    if isinstance(value, list | tuple | dict):
        if id(value) not in seen:
            seen[id(value)] = ({k: to_data(x, seen) for k, x in value.items()} if isinstance(value, dict)
                               else [to_data(x, seen) for x in value])
        return seen[id(value)]
    return value
