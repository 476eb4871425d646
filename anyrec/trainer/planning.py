"""The trainer's sharding plan: chosen once on rank 0 by the configured planner, shared with every rank."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _remote_device
from torchrec.distributed.model_parallel import (
    DataParallelWrapper,
    DefaultDataParallelWrapper,
    DistributedModelParallel,
)
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan

from anyrec.backends import Backend, Hardware
from anyrec.backends.dispatch import Impl
from anyrec.backends.sharders import collection_sharder
from anyrec.config import AnyrecConfig, PlannerConfig, Precision
from anyrec.data import resolve_batch_size
from anyrec.models.family import ModelFamily
from anyrec.planner.job import plan_model
from anyrec.planner.memory import MemoryPrediction, predict_memory
from anyrec.planner.planned import PlannedJob, id_skew, plan_job
from anyrec.planner.types import Topology
from anyrec.runtime.distributed import DistInfo, broadcast_from_main
from anyrec.trainer.twod import TwoDModelParallel

logger = logging.getLogger(__name__)


def sharders(embedding: Impl, static_graph: bool = True, pooled: bool = True) -> list[ModuleSharder]:
    """The sharders DistributedModelParallel uses: one for the selected embedding implementation.
    `static_graph=False` (the device cannot page-lock host memory) goes to a sharder that has the
    setting (anyrec's TBE: DDP of its data-parallel lookups; FBGEMM's never runs on such a device).
    `pooled=False`: torchrec's EmbeddingCollection sharder (sequence embeddings), whose fused kernels
    must be the implementation's (ValueError otherwise)."""
    sharder = collection_sharder(embedding, pooled)
    if hasattr(sharder, "static_graph"):
        sharder.static_graph = static_graph
    return [sharder]


class NoDataParallelWrapper(DataParallelWrapper):
    """Leaves the dense modules as they are: with one rank DDP's gradient all-reduce averages nothing
    but still runs every step (buckets, a gloo all-reduce of the whole dense gradient, bookkeeping)."""

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        pass


BROADCAST_BUFFERS_WARNING = "`broadcast_buffers` is deprecated"


class DenseDataParallelWrapper(DefaultDataParallelWrapper):
    """torchrec's DDP of the dense modules, which must not sync buffers at init (the sharded modules'
    are rank-local): only the deprecated `broadcast_buffers=False` says so until torch's DDP takes
    `init_sync_buffers` (its FutureWarning's own advice), so that one warning is ours to silence."""

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=BROADCAST_BUFFERS_WARNING, category=FutureWarning)
            super().wrap(dmp, env, device)


def dense_wrapper(world_size: int, static_graph: bool = True) -> DataParallelWrapper:
    """DistributedModelParallel's data-parallel wrapper: none at world size 1, torchrec's DDP otherwise
    (`static_graph` off where the device cannot page-lock the host memory DDP's static graph uses)."""
    if world_size == 1:
        return NoDataParallelWrapper()
    return DenseDataParallelWrapper(static_graph=static_graph)


def shard_model(module: nn.Module, device: torch.device, planned: PlannedJob, backend: Backend,
                info: DistInfo, embedding: Impl, static_graph: bool, pooled: bool = True
                ) -> DistributedModelParallel:
    """`module` sharded as `planned` says: torchrec's DistributedModelParallel over the whole world (1D),
    or torchrec's 2D DMPCollection (the layout's groups smaller than the world), whose replicas exchange
    their gradients every step or are averaged every `replica_sync_every` steps (`replica_update`)."""
    layout = planned.layout
    wrapper = dense_wrapper(info.world_size, static_graph)
    if not layout.is_2d:
        return DistributedModelParallel(module, device=device, plan=planned.plan,
                                        sharders=sharders(embedding, static_graph, pooled),
                                        data_parallel_wrapper=wrapper)
    model = TwoDModelParallel(module, device, planned.plan, info.rank, layout, dist.group.WORLD,
                              sharders(embedding, static_graph, pooled), wrapper,
                              place=lambda p: place_shards(p, backend, info.local_world_size))
    sharded = [name for m in planned.plan.plan.values() for name, ps in m.items()
               if ps.sharding_type != "data_parallel"]
    if sharded and model.synced_tensors() == 0:
        raise ValueError(f"planner.sharding_group_size={layout.group_size}: backend.embedding_kernel="
                         f"{embedding.name} has no kernel torchrec's 2D sync can average (tables "
                         f"{', '.join(sharded)})")
    if info.is_main:
        logger.info("%s", layout.describe())
    return model


def shared_plan(cfg: AnyrecConfig, backend: Backend, info: DistInfo, model: nn.Module, family: ModelFamily,
                embedding: Impl, hardware: Hardware, precision: Precision, resident_bytes: int = 0,
                attention: Impl | None = None) -> PlannedJob:
    """Rank 0 plans the job (`plan_job`, its dense part in `precision`, with the `resident_bytes` the data
    sources keep on each device, which the plan must leave room for) and every rank takes the same
    PlannedJob: ranks must never shard by different plans. A planning error on rank 0 (e.g. nothing fits)
    is raised on every rank, so none waits."""
    args = (cfg, backend, info, model, family, embedding, hardware, precision, resident_bytes, attention)
    if info.world_size == 1:
        return _plan(*args)
    result: Any = None
    if info.is_main:
        try:
            result = _plan(*args)
        except ValueError as e:
            result = ValueError(str(e))
    result = broadcast_from_main(result, info)
    if isinstance(result, ValueError):
        raise result
    return result


def _plan(cfg: AnyrecConfig, backend: Backend, info: DistInfo, model: nn.Module, family: ModelFamily,
          embedding: Impl, hardware: Hardware, precision: Precision, resident_bytes: int,
          attention: Impl | None) -> PlannedJob:
    """This process's job planned: its world, its batch per rank, its backend's device type and devices, the
    attention implementation the model runs (an HSTU model's)."""
    return plan_job(cfg, model, family.sparse_module(model), family.sparse_path,
                    family.workload_facts(cfg.model), hardware, embedding, info.world_size,
                    info.local_world_size,
                    resolve_batch_size(cfg.data, info.world_size).batch_size, backend.device_type,
                    resident_bytes, place=lambda p: place_shards(p, backend, info.local_world_size),
                    log=info.is_main, attention=attention.name if attention is not None else None,
                    precision=precision)


def unsharded_memory(cfg: AnyrecConfig, backend: Backend, model: nn.Module, family: ModelFamily,
                     embedding: Impl, hardware: Hardware, precision: Precision,
                     resident_bytes: int = 0) -> list[MemoryPrediction]:
    """The predicted peak memory of one rank that runs every table itself (no torchrec sharding): the
    co-design planner's costing of all tables table-wise on that rank (its dense part in `precision`),
    without the all-to-alls."""
    ebc = family.sparse_module(model)
    topology = Topology(hardware.spec, 1, 1, backend.device_type)
    batch = resolve_batch_size(cfg.data, 1).batch_size
    planner_cfg = PlannerConfig(sharding="table_wise", allow_uvm=False,
                                memory_reserve_fraction=cfg.planner.memory_reserve_fraction)
    result = plan_model(model, ebc, family.workload_facts(cfg.model), planner_cfg, cfg.optim.name, topology,
                        batch, hardware.embedding_cost(embedding), id_zipf_exponent=id_skew(cfg),
                        precision=precision)
    return predict_memory(result, resident_bytes, sharded=False)


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
