"""From a job config to planner inputs: the one place the trainer and `anyrec-plan` share."""

from __future__ import annotations

from anyrec.backends.specs import DeviceSpec
from anyrec.config import AnyrecConfig, ModelConfig, PlannerConfig
from anyrec.models.dlrm import dense_param_count, feature_names
from anyrec.planner.planner import CoDesignPlanner, PlanResult
from anyrec.planner.types import Placement, ShardingType, TableSpec, Topology


def tables_from_model(cfg: ModelConfig) -> list[TableSpec]:
    """One TableSpec per model table (`t_cat_<i>`, feature `cat_<i>`), pooling = ids per sample."""
    multi_hot = list(cfg.multi_hot) or [1] * len(cfg.table_rows)
    if len(multi_hot) != len(cfg.table_rows):
        raise ValueError(f"model {cfg.name}: multi_hot has {len(multi_hot)} entries for "
                         f"{len(cfg.table_rows)} tables")
    return [
        TableSpec(name=f"t_{f}", num_rows=rows, embedding_dim=cfg.embedding_dim,
                  pooling_factor=float(pool), feature_names=[f])
        for f, rows, pool in zip(feature_names(len(cfg.table_rows)), cfg.table_rows, multi_hot, strict=True)
    ]


def plan_options(cfg: PlannerConfig, kernel: str) -> dict[str, object]:
    """PlanOptions fields from the `planner` config group."""
    from anyrec.backends.sharders import supported_placements, supports_data_parallel

    # Only what the selected embedding implementation can run is offered to the search.
    placements = tuple(p for p in Placement if p.value in supported_placements(kernel))
    shardings = tuple(s for s in ShardingType
                      if s != ShardingType.DATA_PARALLEL or supports_data_parallel(kernel))
    opts: dict[str, object] = {
        "kernel": kernel,
        "uvm_cache_ratio": cfg.uvm_cache_ratio,
        "reserve_fraction": cfg.memory_reserve_fraction,
        "allowed_placements": placements if cfg.allow_uvm else (Placement.HBM,),
        "allowed_shardings": shardings,
    }
    if cfg.sharding != "auto":
        valid = [s.value for s in ShardingType]
        if cfg.sharding not in valid:
            raise ValueError(f"planner.sharding={cfg.sharding!r} is not one of auto, {', '.join(valid)}")
        if ShardingType(cfg.sharding) not in shardings:
            raise ValueError(f"planner.sharding={cfg.sharding} cannot run with "
                             f"backend.embedding_kernel={kernel}")
        opts["allowed_shardings"] = (ShardingType(cfg.sharding),)
    return opts


def plan_job(cfg: AnyrecConfig, device: DeviceSpec, world_size: int, local_world_size: int | None,
             batch_size_per_rank: int, compute_device: str | None = None, kernel: str = "fbgemm",
             planner: CoDesignPlanner | None = None) -> PlanResult:
    """Plan the job's tables on `world_size` x `device` with the co-design planner."""
    topo = Topology(device, world_size, local_world_size, compute_device)
    return (planner or CoDesignPlanner()).plan(
        tables_from_model(cfg.model), topo, batch_size_per_rank, cfg.optim.name,
        dense_param_count(cfg.model), **plan_options(cfg.planner, kernel),
    )
