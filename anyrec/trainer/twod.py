"""2D sparse parallelism with torchrec's own DMPCollection, on any device.

torchrec's `DMPCollection` shards the tables within a sharding group of ranks and keeps one replica of
that group's shards in every other group; `sync()` averages the replicas' embedding weights and fused
optimizer state over each replica group (an all-reduce of `world / group` ranks). Its `__init__` starts
with an assert that the device is NVIDIA's or MTIA, although nothing after it is device-specific
(its DeviceMesh takes the device type, its collectives are the process group's). `TwoDModelParallel`
runs the body of that `__init__` for the one configuration anyrec uses (the DEFAULT strategy, one
context, no submodule configs, no sharded relay), calling torchrec's own helpers for every step:
`_create_process_groups`, `_remap_sharding_plan`, `ShardingEnv2D`, `DistributedModelParallel.__init__`,
`_group_sharded_modules`, `_cache_sync_tensors`. Every other method (`_shard_modules_impl`, state
dicts) is DMPCollection's, and `sync` is too unless the replicas exchange their gradients instead
(`ReplicaUpdate.GRADIENTS`, anyrec/trainer/replica_exchange.py). anyrec/internals.py pins the
torchrec source this reproduces; a test fails when torchrec's changes (docs/planning.md, "2D sparse
parallelism").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import (
    DataParallelWrapper,
    DistributedModelParallel,
    DMPCollection,
)
from torchrec.distributed.types import (
    DMPCollectionContext,
    ModuleSharder,
    ShardingEnv2D,
    ShardingPlan,
    ShardingStrategy,
)

from anyrec.kernels.tbe import TritonTableBatchedEmbedding
from anyrec.planner.planned import ParallelLayout
from anyrec.planner.types import ReplicaUpdate
from anyrec.trainer.replica_exchange import exchange_gradients


class TwoDModelParallel(DMPCollection):
    """torchrec's DMPCollection (tables sharded within the layout's groups, replicated across groups,
    replicas averaged by `sync()`) built on any device: DMPCollection.__init__'s body without its
    CUDA/MTIA assert, for the groups `layout` says (anyrec.planner.planned.ParallelLayout). `place` names
    each shard's device after torchrec remaps the plan to this rank's group (its remap writes
    `<type>:<local index>`, which only indexed devices have). The train pipeline averages the replicas
    every `layout.sync_every` steps. torchrec's `node_group_size` is the group's ranks on one host,
    which table-row-wise sharding keeps a table's rows within (torchrec's default, the ranks per host, is
    the group's only where one host holds the whole group). `layout.replica_update`: AVERAGE is
    torchrec's sync(); GRADIENTS exchanges each step's embedding gradients over the replica group before
    the fused update (anyrec.trainer.replica_exchange), so the replicas stay equal and sync() has
    nothing to do. `layout.use_inter_host_allreduce`: torchrec's layout of the groups (False: strided
    groups, replicas on neighbouring ranks; True: contiguous groups)."""

    def __init__(self, module: nn.Module, device: torch.device, plan: ShardingPlan, rank: int,
                 layout: ParallelLayout, global_pg: dist.ProcessGroup,
                 sharders: list[ModuleSharder[nn.Module]], data_parallel_wrapper: DataParallelWrapper,
                 place: Callable[[ShardingPlan], ShardingPlan]) -> None:
        world_size, sharding_group_size = layout.world_size, layout.group_size
        node_group_size, use_inter_host_allreduce = layout.group_local_size, layout.use_inter_host_allreduce
        # DMPCollection.__init__ from here, for ShardingStrategy.DEFAULT and no submodule configs
        self._device = device
        self._pg = global_pg
        self._global_rank = rank  # this rank in `global_pg`, the job's (DistInfo's)
        self._custom_all_reduce = None
        self._all_reduce_hook = None
        self._sharder_map = {sharder.module_type: sharder for sharder in sharders}
        ctx = DMPCollectionContext(module=None, plan=plan, sharding_group_size=sharding_group_size,
                                   node_group_size=node_group_size,
                                   use_inter_host_allreduce=use_inter_host_allreduce,
                                   sharding_strategy=ShardingStrategy.DEFAULT)
        self._default_ctx, self._submodule_ctxs, self._ctxs = ctx, [], [ctx]
        ctx.device_mesh, ctx.sharding_pg, ctx.replica_pg = self._create_process_groups(
            global_rank=self._global_rank, world_size=world_size, local_size=sharding_group_size,
            use_inter_host_allreduce=use_inter_host_allreduce)
        self._remap_sharding_plan(plan=plan, rank=self._global_rank, step=world_size // sharding_group_size,
                                  sharding_group_size=sharding_group_size,
                                  use_inter_host_allreduce=use_inter_host_allreduce)
        plan = place(plan)
        env = ShardingEnv2D(global_pg=self._pg, sharding_pg=ctx.sharding_pg, replica_pg=ctx.replica_pg,
                            device_mesh=ctx.device_mesh, node_group_size=node_group_size,
                            use_inter_host_allreduce=use_inter_host_allreduce,
                            sharding_strategy=ShardingStrategy.DEFAULT)
        DistributedModelParallel.__init__(self, module, env, device, plan, sharders, True, True,
                                          data_parallel_wrapper)
        self._group_sharded_modules(self._ctxs)
        self._cache_sync_tensors(self._ctxs)
        self._use_sharded_relay = False
        self._sharded_relay_state = None
        # DMPCollection.__init__ ends here.
        self._add_anyrec_kernels(ctx)
        self.layout = layout
        self.exchanged_kernels = 0
        if layout.replica_update == ReplicaUpdate.GRADIENTS:
            # the replicas' batches merge in world-rank order: interleaved per group rank where the groups
            # are strided, one replica's whole batch after another's where they are contiguous
            interleave = 1 if use_inter_host_allreduce else sharding_group_size
            self.exchanged_kernels = exchange_gradients(
                _with_lookups(self), ctx.replica_pg, world_size // sharding_group_size, interleave)

    def sync(self, include_optimizer_state: bool = True) -> None:
        """torchrec's averaging of the replicas; nothing with exchanged gradients, where every replica
        applied the same update from the same state (averaging equal values would only round them)."""
        if self.layout.replica_update == ReplicaUpdate.GRADIENTS:
            return
        super().sync(include_optimizer_state)

    def _add_anyrec_kernels(self, ctx: DMPCollectionContext) -> None:
        """torchrec's sync collects FBGEMM's TBE kernels; anyrec's own TBE (the triton and torch
        implementations) joins the same per-dtype lists, so the same `sync()` averages its weights and
        optimizer state."""
        weights, states = ctx.weights_by_dtype, ctx.optimizer_tensors_by_dtype
        for module in _with_lookups(self):
            if isinstance(module, TritonTableBatchedEmbedding):
                weights.setdefault(module.weight.dtype, []).append(module.weight)  # every table, flat
                for name in ("momentum1", "momentum2"):  # the optimizer's state, where it has any
                    if hasattr(module, name):
                        state = getattr(module, name)
                        states.setdefault(state.dtype, []).append(state)

    def synced_tensors(self) -> int:
        """How many weight tensors `sync()` averages (0 would mean replicas drifting apart unseen)."""
        return sum(len(ts) for ts in self._default_ctx.weights_by_dtype.values())


def _with_lookups(root: nn.Module) -> list[nn.Module]:
    """Every module under `root`, the sharded modules' `_lookups` included: torchrec keeps them in a plain
    list, not as children (its own search for kernels to average walks them the same way)."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        out.append(module)
        stack.extend(module.children())
        stack.extend(getattr(module, "_lookups", None) or [])
    return out
