"""Table sets the planner is benchmarked and tested on: MLPerf DLRMv2 and synthetic mixes."""

from __future__ import annotations

import math
import random

from anyrec.planner.types import TableSpec

# MLPerf DLRMv2 (Criteo 1TB multi-hot): rows per table and multi-hot size (ids per sample) per feature.
DLRMV2_ROWS: tuple[int, ...] = (
    40000000,
    39060,
    17295,
    7424,
    20265,
    3,
    7122,
    1543,
    63,
    40000000,
    3067956,
    405282,
    10,
    2209,
    11938,
    155,
    4,
    976,
    14,
    40000000,
    40000000,
    40000000,
    590152,
    12973,
    108,
    36,
)
DLRMV2_MULTI_HOT: tuple[int, ...] = (
    3,
    2,
    1,
    2,
    6,
    1,
    1,
    1,
    1,
    7,
    3,
    8,
    1,
    6,
    9,
    5,
    1,
    1,
    1,
    12,
    100,
    27,
    10,
    3,
    1,
    1,
)
# DLRMv2 dense part (DCNv2): bottom MLP 13-512-256-128, 3 low-rank (512) cross layers over the
# 27 x 128 = 3456-wide interaction, top MLP 3456-1024-1024-512-256-1. Parameters (weights + biases).
DLRMV2_DENSE_PARAMS: int = (
    (13 * 512 + 512)
    + (512 * 256 + 256)
    + (256 * 128 + 128)
    + 3 * (3456 * 512 + 512 * 3456 + 3456)
    + (3456 * 1024 + 1024)
    + (1024 * 1024 + 1024)
    + (1024 * 512 + 512)
    + (512 * 256 + 256)
    + (256 + 1)
)


def dlrmv2_tables(dim: int = 128, weight_dtype: str = "fp32") -> list[TableSpec]:
    """The 26 DLRMv2 tables, named as the trainer names them (t_cat_i with feature cat_i)."""
    return [
        TableSpec(f"t_cat_{i}", rows, dim, float(hot), [f"cat_{i}"], weight_dtype)
        for i, (rows, hot) in enumerate(zip(DLRMV2_ROWS, DLRMV2_MULTI_HOT, strict=False))
    ]


def synthetic_tables(
    n: int,
    seed: int = 0,
    min_rows: int = 100,
    max_rows: int = 10_000_000,
    dims: tuple[int, ...] = (16, 32, 64, 128, 256),
) -> list[TableSpec]:
    """`n` mixed tables: log-uniform rows in [min_rows, max_rows], dims from `dims`, pooling 1-30."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rows = int(round(10 ** rng.uniform(math.log10(min_rows), math.log10(max_rows))))
        rows = max(min_rows, min(max_rows, rows))
        pooling = float(rng.choice((1, 1, 2, 3, 5, 8, 10, 20, 30)))
        out.append(TableSpec(f"table_{i}", rows, rng.choice(dims), pooling, [f"feature_{i}"]))
    return out
