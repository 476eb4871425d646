"""The trainer's sharding plan: chosen once on rank 0 by the configured planner, shared with every rank."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed import _remote_device
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from anyrec.backends import Backend, resolve_hardware
from anyrec.backends.sharders import compute_kernel, embedding_sharder
from anyrec.config import AnyrecConfig
from anyrec.data import resolve_batch_size
from anyrec.planner.job import plan_model
from anyrec.planner.report import format_report
from anyrec.planner.simple import simple_table_shardings
from anyrec.planner.simple import to_sharding_plan as simple_sharding_plan
from anyrec.planner.torchrec_plan import to_sharding_plan
from anyrec.planner.types import Perf, Topology
from anyrec.trainer.distributed import DistInfo

logger = logging.getLogger(__name__)


def sharders(embedding_kernel: str) -> list[ModuleSharder]:
    """The sharders DistributedModelParallel uses: one for the selected embedding implementation."""
    return [embedding_sharder(embedding_kernel)]


def shared_plan(cfg: AnyrecConfig, backend: Backend, info: DistInfo, model: nn.Module, module_path: str,
                embedding_kernel: str) -> tuple[ShardingPlan, Perf | None]:
    """Rank 0 plans and every rank takes its plan and the predicted per-step cost of the plan's slowest
    rank (None from a planner that predicts nothing): ranks must never shard by different plans.

    A planning error on rank 0 (e.g. nothing fits) is raised on every rank, so none waits.
    """
    args = (cfg, backend, info, model, module_path, embedding_kernel)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return plan_and_predict(*args)
    box: list[Any] = [None]
    if info.is_main:
        try:
            box[0] = plan_and_predict(*args)
        except ValueError as e:
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], ValueError):
        raise ValueError(str(box[0]))
    return box[0]


def plan_sharding(cfg: AnyrecConfig, backend: Backend, info: DistInfo, model: nn.Module, module_path: str,
                  embedding_kernel: str) -> ShardingPlan:
    """The plan for the EmbeddingBagCollection `model.sparse_arch` (at `module_path`) from the configured
    planner (co-design by default); tables and the dense parameter count are read from `model`."""
    return plan_and_predict(cfg, backend, info, model, module_path, embedding_kernel)[0]


def plan_and_predict(cfg: AnyrecConfig, backend: Backend, info: DistInfo, model: nn.Module,
                     module_path: str, embedding_kernel: str) -> tuple[ShardingPlan, Perf | None]:
    """`plan_sharding`'s plan and the co-design planner's predicted cost of its slowest rank per step
    (None: simple)."""
    ebc = model.sparse_arch
    if cfg.planner.name == "simple":
        shardings = simple_table_shardings(ebc.embedding_bag_configs(), info.world_size,
                                           force=cfg.planner.sharding, optimizer=cfg.optim.name)
        plan = simple_sharding_plan(ebc, shardings, module_path, info.world_size, info.local_world_size,
                                    backend.device_type, sharder=sharders(embedding_kernel)[0],
                                    compute_kernel=compute_kernel(embedding_kernel))
        return place_shards(plan, backend, info.local_world_size), None
    if cfg.planner.name != "codesign":
        raise ValueError(f"unknown planner {cfg.planner.name!r}; choose codesign or simple")
    device = resolve_hardware(cfg.hardware.sku, cfg.hardware.spec, backend)
    topology = Topology(device, info.world_size, info.local_world_size, backend.device_type)
    batch = resolve_batch_size(cfg.data, info.world_size).batch_size
    result = plan_model(model, ebc, cfg.model, cfg.planner, cfg.optim.name, topology, batch, embedding_kernel)
    if info.is_main:
        logger.info("co-design plan:\n%s", format_report(result, advice=False))
    slowest = max(result.rank_perf, key=lambda p: p.total_s)  # its total_s is result.predicted_step_s
    plan = to_sharding_plan(result, module_path, ebc, backend.device_type)
    return place_shards(plan, backend, info.local_world_size), slowest


def place_shards(plan: ShardingPlan, backend: Backend, local_world_size: int) -> ShardingPlan:
    """Name in each shard's placement the device its rank trains on (`backend.device`). torchrec's
    `sharding_plan.placement` adds a device index for cuda, mtia and tpu only, so on any other
    accelerator a shard's placement (`rank:1/simdev`) would not match its tensor's device."""
    for module_plan in plan.plan.values():
        for ps in module_plan.values():
            for shard in getattr(ps.sharding_spec, "shards", None) or []:
                rank = shard.placement.rank()
                shard.placement = _remote_device(f"rank:{rank}/{backend.device(rank % local_world_size)}")
    return plan
