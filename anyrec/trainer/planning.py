"""The trainer's sharding plan: chosen once on rank 0 by the configured planner, shared with every rank."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
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
from anyrec.backends.sharders import embedding_sharder
from anyrec.config import AnyrecConfig, PlannerConfig
from anyrec.data import resolve_batch_size
from anyrec.planner.job import plan_model
from anyrec.planner.memory import MemoryPrediction, predict_memory
from anyrec.planner.report import format_report
from anyrec.planner.simple import simple_table_shardings
from anyrec.planner.simple import to_sharding_plan as simple_sharding_plan
from anyrec.planner.torchrec_plan import to_sharding_plan
from anyrec.planner.types import Perf, Topology
from anyrec.trainer.distributed import DistInfo, broadcast_from_main

logger = logging.getLogger(__name__)


def sharders(embedding: Impl, static_graph: bool = True) -> list[ModuleSharder]:
    """The sharders DistributedModelParallel uses: one for the selected embedding implementation.
    `static_graph=False` (the device cannot page-lock host memory) goes to a sharder that has the
    setting (anyrec's TBE: DDP of its data-parallel lookups; FBGEMM's never runs on such a device)."""
    sharder = embedding_sharder(embedding)
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


def shared_plan(cfg: AnyrecConfig, backend: Backend, info: DistInfo, model: nn.Module, module_path: str,
                embedding: Impl, hardware: Hardware, resident_bytes: int = 0
                ) -> tuple[ShardingPlan, Perf | None, list[MemoryPrediction] | None]:
    """Rank 0 plans and every rank takes its plan, the predicted per-step cost of the plan's slowest
    rank and each rank's predicted peak memory (None from a planner that predicts nothing; with the
    `resident_bytes` the data sources keep on each device, which the plan must leave room for): ranks must
    never shard by different plans. A planning error on rank 0 (e.g. nothing fits) is raised on every
    rank, so none waits."""
    if info.world_size == 1:
        return _plan(cfg, backend, info, model, module_path, embedding, hardware, resident_bytes)
    result: Any = None
    if info.is_main:
        try:
            result = _plan(cfg, backend, info, model, module_path, embedding, hardware, resident_bytes)
        except ValueError as e:
            result = ValueError(str(e))
    result = broadcast_from_main(result, info)
    if isinstance(result, ValueError):
        raise result
    return result


def plan_and_predict(cfg: AnyrecConfig, backend: Backend, info: DistInfo, model: nn.Module,
                     module_path: str, embedding: Impl, hardware: Hardware, resident_bytes: int = 0
                     ) -> tuple[ShardingPlan, Perf | None]:
    """The configured planner's plan for the EmbeddingBagCollection at `module_path` of `model` and the
    co-design planner's predicted cost of its slowest rank per step (None: simple), for the embedding
    implementation on `hardware` (its spec and measured profiles)."""
    plan, slowest, _ = _plan(cfg, backend, info, model, module_path, embedding, hardware, resident_bytes)
    return plan, slowest


def _plan(cfg: AnyrecConfig, backend: Backend, info: DistInfo, model: nn.Module, module_path: str,
          embedding: Impl, hardware: Hardware, resident_bytes: int = 0
          ) -> tuple[ShardingPlan, Perf | None, list[MemoryPrediction] | None]:
    """plan_and_predict's plan and cost, and each rank's predicted peak memory (None: simple)."""
    ebc = model.sparse_arch
    if cfg.planner.name == "simple":
        if cfg.planner.sharding == "data_parallel" and not embedding.data_parallel:
            raise ValueError(f"planner.sharding=data_parallel cannot run with "
                             f"backend.embedding_kernel={embedding.name}")
        shardings = simple_table_shardings(ebc.embedding_bag_configs(), info.world_size,
                                           force=cfg.planner.sharding, optimizer=cfg.optim.name)
        plan = simple_sharding_plan(ebc, shardings, module_path, info.world_size, info.local_world_size,
                                    backend.device_type, sharder=sharders(embedding)[0],
                                    compute_kernel=embedding.compute_kernel())
        return place_shards(plan, backend, info.local_world_size), None, None
    if cfg.planner.name != "codesign":
        raise ValueError(f"unknown planner {cfg.planner.name!r}; choose codesign or simple")
    topology = Topology(hardware.spec, info.world_size, info.local_world_size, backend.device_type)
    batch = resolve_batch_size(cfg.data, info.world_size).batch_size
    result = plan_model(model, ebc, cfg.model, cfg.planner, cfg.optim.name, topology, batch,
                        hardware.embedding_cost(embedding), id_zipf_exponent=id_skew(cfg),
                        resident_bytes=resident_bytes)
    if info.is_main:  # the console has the planner's line and the notes; the log file the whole report
        logger.debug("co-design plan:\n%s", format_report(result, advice=False))
        for note in result.notes:
            logger.info("plan note: %s", note)
    slowest = max(result.rank_perf, key=lambda p: p.total_s)  # its total_s is result.predicted_step_s
    plan = to_sharding_plan(result, module_path, ebc, backend.device_type)
    return place_shards(plan, backend, info.local_world_size), slowest, predict_memory(result, resident_bytes)


def unsharded_memory(cfg: AnyrecConfig, backend: Backend, model: nn.Module, embedding: Impl,
                     hardware: Hardware, resident_bytes: int = 0) -> list[MemoryPrediction]:
    """The predicted peak memory of one rank that runs every table itself (no torchrec sharding): the
    co-design planner's costing of all tables table-wise on that rank, without the all-to-alls."""
    ebc = model.sparse_arch
    topology = Topology(hardware.spec, 1, 1, backend.device_type)
    batch = resolve_batch_size(cfg.data, 1).batch_size
    planner_cfg = PlannerConfig(sharding="table_wise", allow_uvm=False,
                                memory_reserve_fraction=cfg.planner.memory_reserve_fraction)
    result = plan_model(model, ebc, cfg.model, planner_cfg, cfg.optim.name, topology, batch,
                        hardware.embedding_cost(embedding), id_zipf_exponent=id_skew(cfg))
    return predict_memory(result, resident_bytes, sharded=False)


def id_skew(cfg: AnyrecConfig) -> float:
    """The ids' Zipf exponent where the data source sets it (synthetic data); 0 (uniform ids, the most
    rows touched per step) for files, whose skew is unknown before reading them."""
    return float(cfg.data.zipf_exponent) if cfg.data.name == "synthetic" else 0.0


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
