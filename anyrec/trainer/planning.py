"""The trainer's sharding plan: chosen once on rank 0 by the configured planner, shared with every rank."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _remote_device
from torchrec.distributed.embedding import EmbeddingCollectionSharder
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
from anyrec.models.family import ModelFamily
from anyrec.planner.job import collection_configs, plan_model
from anyrec.planner.memory import MemoryPrediction, predict_memory
from anyrec.planner.report import format_group_choice, format_report
from anyrec.planner.simple import simple_table_shardings
from anyrec.planner.simple import to_sharding_plan as simple_sharding_plan
from anyrec.planner.torchrec_plan import to_sharding_plan
from anyrec.planner.twod import GroupLayout, choose_group_size, resolve_replica_update, sharding_group_size
from anyrec.planner.types import Perf, PlanResult, ReplicaUpdate, Topology
from anyrec.trainer.distributed import DistInfo, broadcast_from_main
from anyrec.trainer.twod import TwoDModelParallel

logger = logging.getLogger(__name__)


def sharders(embedding: Impl, static_graph: bool = True, pooled: bool = True) -> list[ModuleSharder]:
    """The sharders DistributedModelParallel uses: one for the selected embedding implementation.
    `static_graph=False` (the device cannot page-lock host memory) goes to a sharder that has the
    setting (anyrec's TBE: DDP of its data-parallel lookups; FBGEMM's never runs on such a device).
    `pooled=False`: torchrec's EmbeddingCollection sharder (sequence embeddings), whose fused kernels
    must be the implementation's (ValueError otherwise)."""
    if not pooled:
        return [sequence_sharder(embedding)]
    sharder = embedding_sharder(embedding)
    if hasattr(sharder, "static_graph"):
        sharder.static_graph = static_graph
    return [sharder]


def sequence_sharder(embedding: Impl) -> EmbeddingCollectionSharder:
    """torchrec's EmbeddingCollection sharder, for an implementation whose fused kernel it runs."""
    sharder = EmbeddingCollectionSharder()
    runs = {k for device in ("cpu", "cuda") for k in sharder.compute_kernels("table_wise", device)}
    if embedding.compute_kernel() not in runs:
        raise ValueError(f"backend.embedding_kernel={embedding.name} has no kernel for sequence embeddings "
                         f"(torchrec's EmbeddingCollection runs FBGEMM's fused TBE): use "
                         f"backend.embedding_kernel=fbgemm")
    return sharder


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


@dataclass
class GroupShardingPlan(ShardingPlan):
    """A sharding plan for one sharding group of `sharding_group_size` ranks (its ranks 0..size-1; torchrec's
    DMPCollection maps them onto each group's), replicated across the world's groups, which exchange their
    gradients every step or are averaged every `replica_sync_every` steps (`replica_update`); the groups
    are laid out as torchrec's `use_inter_host_allreduce` says (anyrec.planner.twod.GroupLayout)."""

    sharding_group_size: int = 1
    replica_sync_every: int = 1
    replica_update: ReplicaUpdate = ReplicaUpdate.AVERAGE
    use_inter_host_allreduce: bool = False


def shard_model(module: nn.Module, device: torch.device, plan: ShardingPlan, backend: Backend, info: DistInfo,
                embedding: Impl, static_graph: bool, pooled: bool = True) -> DistributedModelParallel:
    """`module` sharded by `plan`: torchrec's DistributedModelParallel over the whole world, or (a
    GroupShardingPlan for a group smaller than the world) its 2D DMPCollection, whose replicas exchange
    their gradients every step or are averaged every `plan.replica_sync_every` steps
    (`plan.replica_update`)."""
    group = getattr(plan, "sharding_group_size", info.world_size)
    wrapper = dense_wrapper(info.world_size, static_graph)
    if group == info.world_size:
        return DistributedModelParallel(module, device=device, plan=plan,
                                        sharders=sharders(embedding, static_graph, pooled),
                                        data_parallel_wrapper=wrapper)
    layout = GroupLayout(info.world_size, info.local_world_size, group, plan.use_inter_host_allreduce)
    model = TwoDModelParallel(module, device, plan, info.rank, info.world_size, group, dist.group.WORLD,
                              sharders(embedding, static_graph, pooled), wrapper,
                              place=lambda p: place_shards(p, backend, info.local_world_size),
                              sync_every=plan.replica_sync_every, node_group_size=layout.group_local_size,
                              replica_update=plan.replica_update,
                              use_inter_host_allreduce=layout.use_inter_host_allreduce)
    sharded = [name for m in plan.plan.values() for name, ps in m.items()
               if ps.sharding_type != "data_parallel"]
    if sharded and model.synced_tensors() == 0:
        raise ValueError(f"planner.sharding_group_size={group}: backend.embedding_kernel={embedding.name} "
                         f"has no kernel torchrec's 2D sync can average (tables {', '.join(sharded)})")
    if info.is_main:
        how = "exchange their embedding gradients every step"
        if plan.replica_update == ReplicaUpdate.AVERAGE:
            how = f"are averaged every {plan.replica_sync_every} step(s)"
        logger.info("2D: %d sharding groups of %d ranks, %s layout (use_inter_host_allreduce=%s); the "
                    "replicas %s", layout.replicas, group, layout.name, layout.use_inter_host_allreduce, how)
    return model


def shared_plan(cfg: AnyrecConfig, backend: Backend, info: DistInfo, model: nn.Module, family: ModelFamily,
                embedding: Impl, hardware: Hardware, resident_bytes: int = 0
                ) -> tuple[ShardingPlan, Perf | None, list[MemoryPrediction] | None]:
    """Rank 0 plans and every rank takes its plan, the predicted per-step cost of the plan's slowest
    rank and each rank's predicted peak memory (None from a planner that predicts nothing; with the
    `resident_bytes` the data sources keep on each device, which the plan must leave room for): ranks must
    never shard by different plans. A planning error on rank 0 (e.g. nothing fits) is raised on every
    rank, so none waits."""
    if info.world_size == 1:
        return _plan(cfg, backend, info, model, family, embedding, hardware, resident_bytes)
    result: Any = None
    if info.is_main:
        try:
            result = _plan(cfg, backend, info, model, family, embedding, hardware, resident_bytes)
        except ValueError as e:
            result = ValueError(str(e))
    result = broadcast_from_main(result, info)
    if isinstance(result, ValueError):
        raise result
    return result


def plan_and_predict(cfg: AnyrecConfig, backend: Backend, info: DistInfo, model: nn.Module,
                     family: ModelFamily, embedding: Impl, hardware: Hardware, resident_bytes: int = 0
                     ) -> tuple[ShardingPlan, Perf | None]:
    """The configured planner's plan for the embedding collection of the training module `model` (of
    `family`, which says where the collection sits and what the planner needs of the model) and the
    co-design planner's predicted cost of its slowest rank per step (None: simple), for the embedding
    implementation on `hardware` (its spec and measured profiles)."""
    plan, slowest, _ = _plan(cfg, backend, info, model, family, embedding, hardware, resident_bytes)
    return plan, slowest


def _plan(cfg: AnyrecConfig, backend: Backend, info: DistInfo, model: nn.Module, family: ModelFamily,
          embedding: Impl, hardware: Hardware, resident_bytes: int = 0
          ) -> tuple[ShardingPlan, Perf | None, list[MemoryPrediction] | None]:
    """plan_and_predict's plan and cost, and each rank's predicted peak memory (None: simple), for one
    sharding group (a GroupShardingPlan)."""
    group = sharding_group_size(cfg.planner.sharding_group_size, info.world_size)
    if group is None and cfg.planner.name != "codesign":
        raise ValueError("planner.sharding_group_size=auto needs planner=codesign (the cost model chooses)")
    if cfg.planner.replica_sync_every < 1:
        raise ValueError(f"planner.replica_sync_every must be >= 1, got {cfg.planner.replica_sync_every}")
    update = resolve_replica_update(cfg.planner.replica_update, cfg.optim.name,
                                    cfg.planner.replica_sync_every)
    plan, slowest, memory, layout = _plan_group(cfg, backend, info, model, family, embedding, hardware,
                                                group, resident_bytes, update)
    if memory is not None:  # world rank r runs its group's rank layout.group_rank(r)
        memory = [memory[layout.group_rank(r)] for r in range(info.world_size)]
    return (GroupShardingPlan(plan.plan, sharding_group_size=layout.group_size,
                              replica_sync_every=cfg.planner.replica_sync_every, replica_update=update,
                              use_inter_host_allreduce=layout.use_inter_host_allreduce),
            slowest, memory)


def _plan_group(cfg: AnyrecConfig, backend: Backend, info: DistInfo, model: nn.Module, family: ModelFamily,
                embedding: Impl, hardware: Hardware, group: int | None, resident_bytes: int = 0,
                update: ReplicaUpdate = ReplicaUpdate.AVERAGE
                ) -> tuple[ShardingPlan, Perf | None, list[MemoryPrediction] | None, GroupLayout]:
    """The plan of one sharding group of `group` ranks (the whole world in 1D; None: the co-design
    planner chooses), its cost and memory (the replicas kept one model by `update`), and the groups'
    layout (the co-design planner chooses among torchrec's two; the simple planner keeps its default)."""
    ebc, module_path = family.sparse_module(model), family.sparse_path
    if cfg.planner.name == "simple":
        if cfg.planner.sharding == "data_parallel" and not embedding.data_parallel:
            raise ValueError(f"planner.sharding=data_parallel cannot run with "
                             f"backend.embedding_kernel={embedding.name}")
        layout = GroupLayout(info.world_size, info.local_world_size, group)  # torchrec's default layout
        shardings = simple_table_shardings(collection_configs(ebc), group,
                                           force=cfg.planner.sharding, optimizer=cfg.optim.name)
        plan = simple_sharding_plan(ebc, shardings, module_path, group, layout.group_local_size,
                                    backend.device_type, sharder=sharders(embedding, True, family.pooled)[0],
                                    compute_kernel=embedding.compute_kernel())
        return place_shards(plan, backend, info.local_world_size), None, None, layout
    if cfg.planner.name != "codesign":
        raise ValueError(f"unknown planner {cfg.planner.name!r}; choose codesign or simple")
    batch = resolve_batch_size(cfg.data, info.world_size).batch_size

    def plan_for(topology: Topology) -> PlanResult:
        return plan_model(model, ebc, family.workload_facts(cfg.model), cfg.planner, cfg.optim.name, topology,
                          batch, hardware.embedding_cost(embedding), id_zipf_exponent=id_skew(cfg),
                          resident_bytes=resident_bytes)

    if group == info.world_size:  # 1D
        layout = GroupLayout(info.world_size, info.local_world_size, group)
        result = plan_for(Topology(hardware.spec, info.world_size, info.local_world_size,
                                   backend.device_type))
    else:
        choice = choose_group_size(info.world_size, info.local_world_size, hardware.spec, backend.device_type,
                                   plan_for, None if group is None else [group],
                                   cfg.planner.replica_sync_every, hardware.subgroups, hardware.link_source,
                                   update)
        result = choice.plan
        layout = GroupLayout(info.world_size, info.local_world_size, choice.chosen,
                             choice.use_inter_host_allreduce)
        if info.is_main:
            logger.info("2D: %s", format_group_choice(choice).splitlines()[-1])
            logger.debug("sharding group sizes weighed:\n%s", format_group_choice(choice))
    if info.is_main:  # the console has the planner's line and the notes; the log file the whole report
        logger.debug("co-design plan:\n%s", format_report(result, advice=False))
        for note in result.notes:
            logger.info("plan note: %s", note)
    slowest = max(result.rank_perf, key=lambda p: p.total_s)  # its total_s is result.predicted_step_s
    plan = to_sharding_plan(result, module_path, ebc, backend.device_type)
    memory = predict_memory(result, resident_bytes)
    return place_shards(plan, backend, info.local_world_size), slowest, memory, layout


def unsharded_memory(cfg: AnyrecConfig, backend: Backend, model: nn.Module, family: ModelFamily,
                     embedding: Impl, hardware: Hardware, resident_bytes: int = 0) -> list[MemoryPrediction]:
    """The predicted peak memory of one rank that runs every table itself (no torchrec sharding): the
    co-design planner's costing of all tables table-wise on that rank, without the all-to-alls."""
    ebc = family.sparse_module(model)
    topology = Topology(hardware.spec, 1, 1, backend.device_type)
    batch = resolve_batch_size(cfg.data, 1).batch_size
    planner_cfg = PlannerConfig(sharding="table_wise", allow_uvm=False,
                                memory_reserve_fraction=cfg.planner.memory_reserve_fraction)
    result = plan_model(model, ebc, family.workload_facts(cfg.model), planner_cfg, cfg.optim.name, topology,
                        batch, hardware.embedding_cost(embedding), id_zipf_exponent=id_skew(cfg))
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
