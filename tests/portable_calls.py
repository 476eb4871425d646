"""Counting the calls anyrec's portable sparse-op kernels serve (a test instrument, not in anyrec)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

from anyrec.backends import sparse_ops


def _counted(name: str, kernel: Callable[..., Any], calls: Counter) -> Callable[..., Any]:
    def kernel_counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return kernel(*args, **kwargs)

    return kernel_counted


def counted_ops(calls: Counter) -> dict[str, sparse_ops.SparseOp]:
    """`SPARSE_OPS` with every kernel wrapped to count its calls, by op name, into `calls`; put
    them in place of `sparse_ops.SPARSE_OPS`' entries before the kernels are registered."""
    return {name: dataclasses.replace(op, kernel=_counted(name, op.kernel, calls))
            for name, op in sparse_ops.SPARSE_OPS.items()}
