"""Triton, probed once for every kernel module: the same names whether or not it imports.

`HAS_TRITON` says whether triton imported; kernels are defined only then, and the torch paths need
none of it. `interpreter_enabled()` is the one place anyrec reads TRITON_INTERPRET.
"""

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
    """Whether Triton runs kernels in its CPU interpreter: TRITON_INTERPRET read as Triton 3.x reads it
    (1, true, on or yes, any case); it must be set before triton is imported."""
    return HAS_TRITON and os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


__all__ = ["HAS_TRITON", "interpreter_enabled", "tl", "triton"]
