"""Triton, probed once for every kernel module: the same names whether or not it imports. Kernels are
defined only where it did (`HAS_TRITON`); the torch paths need none of it."""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    triton = None
    tl = None
    HAS_TRITON = False


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter: TRITON_INTERPRET read as Triton 3.x reads it (1,
    true, on or yes, any case; set before triton is imported), the one place anyrec reads it."""
    return HAS_TRITON and os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


__all__ = ["HAS_TRITON", "interpreter_enabled", "tl", "triton"]
