"""A simple balanced planner: big tables row-wise, the rest table-wise by greedy size balance (the fallback
next to the co-design planner, and the way tests force a sharding type)."""

from __future__ import annotations

from torch import nn
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from anyrec.backends.dispatch import DATA_PARALLEL_KERNEL, FBGEMM_EMBEDDING
from anyrec.planner.estimators import inexact_update_reason
from anyrec.planner.torchrec_plan import build_sharding_plan
from anyrec.planner.types import ShardingType

SHARDINGS = tuple(s.value for s in ShardingType)


def simple_table_shardings(tables: list[EmbeddingBagConfig], world_size: int, row_wise_min_rows: int = 10_000,
                           force: str = "auto",
                           optimizer: str | None = None) -> dict[str, tuple[str, list[int]]]:
    """Per table: (sharding type, ranks); table-wise ones by largest-first greedy balance of bytes. A forced
    sharding type that would change `optimizer`'s update raises ValueError; auto never picks one."""
    if force not in ("auto", *SHARDINGS):
        raise ValueError(f"unknown sharding {force!r}; choose auto or one of {', '.join(SHARDINGS)}")
    if force != "auto" and optimizer is not None and (reason := inexact_update_reason(optimizer, force)):
        raise ValueError(f"planner.sharding={force}: {reason}")
    load = [0] * world_size
    out: dict[str, tuple[str, list[int]]] = {}
    for t in sorted(tables, key=lambda t: t.num_embeddings * t.embedding_dim, reverse=True):
        kind = force if force != "auto" else (
            "row_wise" if world_size > 1 and t.num_embeddings >= row_wise_min_rows else "table_wise")
        if kind == "table_wise":
            r = min(range(world_size), key=lambda i: load[i])
            load[r] += t.num_embeddings * t.embedding_dim
            out[t.name] = (kind, [r])
        else:
            out[t.name] = (kind, list(range(world_size)))
    return out


def to_sharding_plan(ebc: nn.Module, shardings: dict[str, tuple[str, list[int]]], module_path: str,
                     world_size: int, local_world_size: int, device_type: str,
                     compute_kernel: str | None = None, sharder: ModuleSharder | None = None) -> ShardingPlan:
    """A torchrec ShardingPlan placing the tables of `ebc` (at `module_path` in the model), in device
    memory with torchrec compute kernel `compute_kernel` (default: FBGEMM's, from its Impl record)."""
    kernel = compute_kernel or FBGEMM_EMBEDDING.compute_kernel("hbm")
    per_table = {name: (kind, ranks, DATA_PARALLEL_KERNEL if kind == "data_parallel" else kernel)
                 for name, (kind, ranks) in shardings.items()}
    return build_sharding_plan(ebc, per_table, module_path, world_size, local_world_size, device_type,
                               sharder)
