"""Errors the entry point turns into one `anyrec-train: error: ...` line and a non-zero exit.

Kept free of torch imports so `anyrec.train` can name them cheaply.
"""

from __future__ import annotations


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf (raised on every rank at the same step)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: corrupt, incomplete, or from an incompatible model."""
