"""Triton, probed once for every kernel module: the same names whether or not it imports.

`HAS_TRITON` says whether triton imported; kernels are defined only then, and the torch paths need
none of it.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "tl", "triton"]
