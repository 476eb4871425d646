"""torchrec integration of sequence embeddings: anyrec's TBE, unpooled, as the compute kernel of sharded
EmbeddingCollections.

As `torchrec_kernel` does for EmbeddingBagCollections, by public subclassing only, nothing in torchrec
patched: `TritonEmbeddingCollectionSharder` offers the `fused_triton` compute kernel for table-, row- and
column-wise shards (the sharding types torchrec's EmbeddingCollection sharder has besides data-parallel);
its sharded module's shardings build a lookup whose `_create_embedding_kernel` returns
`TritonFusedEmbedding` for `fused_triton` groups (torchrec's sequence lookup knows no Triton kernel). That
kernel is `TritonTableBatchedEmbedding` with pooling "none" (one output row per id, the optimizer fused into
its backward) behind the plumbing of torchrec's `TritonBatchedFusedEmbeddingBag` (state_dict as
ShardedTensors, per-table parameter slices, `TritonEmbeddingFusedOptimizer`), so weights and optimizer
state appear in `DistributedModelParallel`'s state_dict and `fused_optimizer.state_dict()` as FBGEMM's do.

Usage:
    sharder = TritonEmbeddingCollectionSharder(OptimizerConfig("rowwise_adagrad", lr=0.01))
    plan = construct_module_sharding_plan(
        ec, {"t0": row_wise(compute_kernel=TRITON_COMPUTE_KERNEL)}, sharder=sharder, ...)
    model = DistributedModelParallel(ec, sharders=[sharder], plan=ShardingPlan({"": plan}))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    TritonBatchedFusedEmbeddingBag,
    TritonEmbeddingFusedOptimizer,
)
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup
from torchrec.distributed.embedding_types import (
    BaseEmbeddingLookup,
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
)
from torchrec.distributed.sharding.cw_sequence_sharding import CwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import data_type_to_dtype
from torchrec.optim.fused import FusedOptimizerModule

from anyrec.kernels.optimizers import OptimizerConfig
from anyrec.kernels.tbe import UNPOOLED, TritonTableBatchedEmbedding
from anyrec.kernels.torchrec_kernel import (
    TRITON_COMPUTE_KERNEL,
    kernel_fused_params,
    optimizer_from_fused_params,
    output_dtype_of,
)


class TritonFusedEmbedding(BaseBatchedEmbedding[torch.Tensor], FusedOptimizerModule):
    """torchrec's sequence compute kernel for one group of local shards (one embedding dim), backed by
    `TritonTableBatchedEmbedding` with pooling "none"; it reads the fused params `TritonFusedEmbeddingBag`
    reads ("stochastic_rounding", "output_dtype", "bounds_check", "execution")."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__(config, pg, device)
        fp = dict(config.fused_params or {})
        names = [name for t in config.embedding_tables for name in t.feature_names]
        self._emb_module = TritonTableBatchedEmbedding(
            list(zip(self._local_rows, self._local_cols, strict=True)),
            feature_table_map=self._feature_table_map, optimizer=optimizer_from_fused_params(fp),
            pooling=UNPOOLED, weights_dtype=data_type_to_dtype(config.data_type),
            output_dtype=output_dtype_of(fp), stochastic_rounding=bool(fp.get("stochastic_rounding", True)),
            bounds_check=fp.get("bounds_check", "error"), feature_names=names, device=device,
            execution=fp.get("execution", "torch"))
        self._optim = TritonEmbeddingFusedOptimizer(config, self._emb_module, pg)
        self.init_parameters()

    # torchrec's Triton kernel's plumbing reads only the TBE and the config, pooled or not
    _param_per_table = TritonBatchedFusedEmbeddingBag._param_per_table
    emb_module = TritonBatchedFusedEmbeddingBag.emb_module
    fused_optimizer = TritonBatchedFusedEmbeddingBag.fused_optimizer
    named_buffers = TritonBatchedFusedEmbeddingBag.named_buffers
    named_parameters = TritonBatchedFusedEmbeddingBag.named_parameters
    split_embedding_weights = TritonBatchedFusedEmbeddingBag.split_embedding_weights
    flush = TritonBatchedFusedEmbeddingBag.flush
    purge = TritonBatchedFusedEmbeddingBag.purge


class TritonGroupedEmbeddingsLookup(GroupedEmbeddingsLookup):
    """torchrec's sequence lookup that builds `TritonFusedEmbedding` for `fused_triton` groups."""

    def _create_embedding_kernel(self, config, pg, device, env=None):
        if config.compute_kernel == EmbeddingComputeKernel.FUSED_TRITON:
            return TritonFusedEmbedding(config, pg, device)
        return super()._create_embedding_kernel(config, pg, device, env)


class _SequenceLookupMixin:
    """create_lookup of torchrec's sequence shardings, with the Triton-aware lookup."""

    def create_lookup(self, device=None, fused_params=None, feature_processor=None) -> BaseEmbeddingLookup:
        assert feature_processor is None  # as torchrec's: sequence lookups take none
        return TritonGroupedEmbeddingsLookup(
            grouped_configs=self._grouped_embedding_configs, pg=self._pg,
            device=device if device is not None else self._device, env=self._env)


class TritonTwSequenceEmbeddingSharding(_SequenceLookupMixin, TwSequenceEmbeddingSharding):
    """Table-wise sequence sharding with the Triton-aware lookup."""


class TritonRwSequenceEmbeddingSharding(_SequenceLookupMixin, RwSequenceEmbeddingSharding):
    """Row-wise sequence sharding with the Triton-aware lookup."""


class TritonCwSequenceEmbeddingSharding(_SequenceLookupMixin, CwSequenceEmbeddingSharding):
    """Column-wise sequence sharding with the Triton-aware lookup."""


# the sharding types the sharder offers, and their shardings
SEQUENCE_SHARDINGS = {
    ShardingType.TABLE_WISE.value: TritonTwSequenceEmbeddingSharding,
    ShardingType.ROW_WISE.value: TritonRwSequenceEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: TritonCwSequenceEmbeddingSharding,
}


class TritonShardedEmbeddingCollection(ShardedEmbeddingCollection):
    """ShardedEmbeddingCollection whose table-, row- and column-wise shardings build Triton-aware lookups
    (which build torchrec's own kernels for groups of other compute kernels)."""

    @classmethod
    def create_embedding_sharding(cls, sharding_type: str, sharding_infos, env: ShardingEnv,
                                  device: torch.device | None = None, qcomm_codecs_registry=None):
        if sharding_type not in SEQUENCE_SHARDINGS:
            return super().create_embedding_sharding(sharding_type, sharding_infos, env, device,
                                                     qcomm_codecs_registry)
        return SEQUENCE_SHARDINGS[sharding_type](sharding_infos=sharding_infos, env=env, device=device,
                                                 qcomm_codecs_registry=qcomm_codecs_registry)


class TritonEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """EmbeddingCollection sharder whose shards use anyrec's TBE, unpooled. `optimizer` sets the fused update
    (it overrides the optimizer keys of `fused_params`); `execution` is passed to the kernel ("triton" |
    "torch"; the kernel's default, torch, if None)."""

    def __init__(self, optimizer: OptimizerConfig | None = None, fused_params: dict[str, Any] | None = None,
                 execution: str | None = None, qcomm_codecs_registry: dict | None = None) -> None:
        super().__init__(fused_params=kernel_fused_params(optimizer, fused_params, execution),
                         qcomm_codecs_registry=qcomm_codecs_registry)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SEQUENCE_SHARDINGS)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [TRITON_COMPUTE_KERNEL] if sharding_type in SEQUENCE_SHARDINGS else []

    def shard(self, module, params, env, device=None, module_fqn=None) -> TritonShardedEmbeddingCollection:
        return TritonShardedEmbeddingCollection(
            module, params, env, self.fused_params, device, qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=self._use_index_dedup, module_fqn=module_fqn)

    @property
    def sharded_module_type(self) -> type[TritonShardedEmbeddingCollection]:
        return TritonShardedEmbeddingCollection
