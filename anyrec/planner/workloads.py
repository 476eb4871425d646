"""Table sets the planner is benchmarked and tested on: MLPerf DLRMv2 (from its model config) and
synthetic mixes."""

from __future__ import annotations

import math
import random

from anyrec.planner.types import TableSpec
from anyrec.schema import load_model_config, sparse_features

# DLRMv2 dense part (DCNv2): bottom MLP 13-512-256-128, 3 low-rank (512) cross layers over the
# 27 x 128 = 3456-wide interaction, top MLP 3456-1024-1024-512-256-1. Parameters (weights + biases).
DLRMV2_DENSE_PARAMS: int = (
    (13 * 512 + 512) + (512 * 256 + 256) + (256 * 128 + 128)  # bottom MLP
    + 3 * (3456 * 512 + 512 * 3456 + 3456)  # cross layers
    + (3456 * 1024 + 1024) + (1024 * 1024 + 1024) + (1024 * 512 + 512) + (512 * 256 + 256) + (256 + 1)  # top
)


def dlrmv2_tables(dim: int = 128, weight_dtype: str = "fp32") -> list[TableSpec]:
    """The 26 MLPerf DLRMv2 tables of `configs/model/dlrmv2.yaml`, named as the trainer names them."""
    return [TableSpec(f.table, f.num_rows, dim, float(f.ids_per_sample), [f.name], weight_dtype)
            for f in sparse_features(load_model_config("dlrmv2"))]


def synthetic_tables(n: int, seed: int = 0, min_rows: int = 100, max_rows: int = 10_000_000,
                     dims: tuple[int, ...] = (16, 32, 64, 128, 256)) -> list[TableSpec]:
    """`n` mixed tables: log-uniform rows in [min_rows, max_rows], dims from `dims`, pooling 1-30."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rows = int(round(10 ** rng.uniform(math.log10(min_rows), math.log10(max_rows))))
        rows = max(min_rows, min(max_rows, rows))
        pooling = float(rng.choice((1, 1, 2, 3, 5, 8, 10, 20, 30)))
        out.append(TableSpec(f"table_{i}", rows, rng.choice(dims), pooling, [f"feature_{i}"]))
    return out
