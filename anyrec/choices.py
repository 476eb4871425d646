"""Closed choices every layer may hold: `Switch` (auto, or forced on or off), parsed once where a config is
built (`parse_switch`) and handed down as the value, never re-read from its text."""

from __future__ import annotations

from enum import StrEnum

Switch = StrEnum("Switch", "auto true false")  # auto, or forced on or off
# The dense part's precision: `auto` as configured (bf16 autocast on an accelerator that has it, fp32 on a
# CPU), resolved to bf16 or fp32 once for the device a job runs on (Backend.dense_precision)
Precision = StrEnum("Precision", "auto bf16 fp32")


def parse_switch(key: str, value: object) -> Switch:
    """An auto|true|false option (a bool, or its word in any case) as a Switch; ValueError naming `key`."""
    if isinstance(value, Switch):
        return value
    word = str(value).strip().lower()
    if word not in Switch.__members__:
        raise ValueError(f"{key}={value!r}: choose auto, true or false")
    return Switch[word]
