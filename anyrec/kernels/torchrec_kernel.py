"""torchrec integration: the Triton TBE as the compute kernel of sharded EmbeddingBagCollections.

Public subclassing only, nothing in torchrec is patched: `TritonEmbeddingBagCollectionSharder` offers the
`fused_triton` compute kernel (`EmbeddingComputeKernel.FUSED_TRITON`, the value torchrec reserves for a
Triton TBE) for table-, row-, column-, table-row- and table-column-wise shards; its sharded module's
shardings build a lookup whose `_create_embedding_kernel` returns `TritonFusedEmbeddingBag` for
`fused_triton` groups (torchrec's own branch imports a module it does not ship). That kernel reuses
torchrec's `TritonBatchedFusedEmbeddingBag` plumbing (state_dict as ShardedTensors, per-table parameter
slices) and `TritonEmbeddingFusedOptimizer`, so weights and optimizer state ("<table>.momentum1", ...)
appear in `DistributedModelParallel`'s state_dict and `fused_optimizer.state_dict()` like FBGEMM's.

Data-parallel (replicated) tables take torchrec's `dense` kernel name, as FBGEMM's do: the lookup builds
`TorchDenseEmbeddingBag`, the torch TBE's forward over one plain flat parameter, so autograd gives the
weights a dense gradient that DDP all-reduces and the trainer's replicated-table optimizer applies (no
FBGEMM kernel anywhere).

Usage:
    sharder = TritonEmbeddingBagCollectionSharder(OptimizerConfig("rowwise_adagrad", lr=0.01))
    plan = construct_module_sharding_plan(
        ebc, {"t0": table_wise(rank=0, compute_kernel=TRITON_COMPUTE_KERNEL)}, sharder=sharder, ...)
    model = DistributedModelParallel(ebc, sharders=[sharder], plan=ShardingPlan({"": plan}))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbeddingBag,
    BatchedDenseEmbeddingBag,
    TritonBatchedFusedEmbeddingBag,
    TritonEmbeddingFusedOptimizer,
    _gen_named_parameters_by_table_dense,
)
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import (
    BaseEmbeddingLookup,
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
)
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.sharding.twcw_sharding import TwCwPooledEmbeddingSharding
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import data_type_to_dtype

from anyrec.kernels.layout import BoundsCheckMode, TBELayout, batch_size, check_ids
from anyrec.kernels.optimizers import OptimizerConfig, OptimizerKind
from anyrec.kernels.tbe import TritonTableBatchedEmbedding
from anyrec.kernels.torch_tbe import torch_forward

TRITON_COMPUTE_KERNEL = EmbeddingComputeKernel.FUSED_TRITON.value

_TO_FBGEMM = {
    OptimizerKind.SGD: EmbOptimType.EXACT_SGD,
    OptimizerKind.ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    OptimizerKind.ADAGRAD: EmbOptimType.EXACT_ADAGRAD,
    OptimizerKind.ADAM: EmbOptimType.ADAM,
}
_FBGEMM_OPTIMIZERS = {v: k for k, v in _TO_FBGEMM.items()} | {
    EmbOptimType.SGD: OptimizerKind.SGD, EmbOptimType.ROWWISE_ADAGRAD: OptimizerKind.ROWWISE_ADAGRAD}
_HYPERPARAMETERS = ("eps", "beta1", "beta2", "weight_decay")  # fused_params keys named as OptimizerConfig's


def optimizer_from_fused_params(fused_params: dict[str, Any]) -> OptimizerConfig:
    """Read torchrec/FBGEMM-style fused params (optimizer, learning_rate, eps, beta1/2, weight_decay)."""
    kind = fused_params.get("optimizer", EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    if isinstance(kind, EmbOptimType):
        if kind not in _FBGEMM_OPTIMIZERS:
            supported = list(_FBGEMM_OPTIMIZERS)
            raise ValueError(f"the Triton TBE does not implement {kind}; use one of {supported}")
        kind = _FBGEMM_OPTIMIZERS[kind]
    defaults = OptimizerConfig(kind=kind)
    return OptimizerConfig(kind=kind, lr=float(fused_params.get("learning_rate", defaults.lr)),
                           **{k: float(fused_params.get(k, getattr(defaults, k))) for k in _HYPERPARAMETERS})


def fused_params_from_optimizer(opt: OptimizerConfig) -> dict[str, Any]:
    """The inverse of `optimizer_from_fused_params` (what the sharder hands torchrec)."""
    return {"optimizer": _TO_FBGEMM[opt.kind], "learning_rate": opt.lr,
            **{k: getattr(opt, k) for k in _HYPERPARAMETERS}}


def _pooling(kernel: BaseBatchedEmbeddingBag) -> str:
    # torchrec already maps mean to sum for row-wise shards (it divides after the reduce)
    return "mean" if kernel._pooling == PoolingMode.MEAN else "sum"


def output_dtype_of(fused_params: dict[str, Any]) -> torch.dtype:
    """The output dtype a kernel's fused params ask for (fp32 by default)."""
    output_dtype = fused_params.get("output_dtype", SparseType.FP32)
    return output_dtype.as_dtype() if isinstance(output_dtype, SparseType) else output_dtype


class TritonFusedEmbeddingBag(TritonBatchedFusedEmbeddingBag):
    """torchrec compute kernel for one group of local shards, backed by `TritonTableBatchedEmbedding`. Extra
    fused params it reads: "stochastic_rounding" (bool), "output_dtype" (SparseType), "bounds_check" ("error"
    | "skip") and "execution" ("triton" | "torch"; torch if absent)."""

    def __init__(
        self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None = None,
        device: torch.device | None = None, sharding_type: ShardingType | None = None,
        env: ShardingEnv | None = None,
    ) -> None:
        # skip TritonBatchedFusedEmbeddingBag.__init__: it imports torchrec's unshipped Triton TBE
        BaseBatchedEmbeddingBag.__init__(self, config, pg, device, sharding_type)
        fp = dict(config.fused_params or {})
        names = [name for t in config.embedding_tables for name in t.feature_names]
        self._emb_module = TritonTableBatchedEmbedding(
            list(zip(self._local_rows, self._local_cols, strict=True)),
            feature_table_map=self._feature_table_map, optimizer=optimizer_from_fused_params(fp),
            pooling=_pooling(self), weights_dtype=data_type_to_dtype(config.data_type),
            output_dtype=output_dtype_of(fp), stochastic_rounding=bool(fp.get("stochastic_rounding", True)),
            bounds_check=fp.get("bounds_check", "error"), feature_names=names, device=device,
            execution=fp.get("execution", "torch"))
        self._optim = TritonEmbeddingFusedOptimizer(config, self._emb_module, pg)
        self.init_parameters()


class TorchDenseTBE(nn.Module):
    """The torch TBE's pooled lookups over one flat parameter `weights` (autograd: a dense gradient);
    the attributes torchrec reads of FBGEMM's `DenseTableBatchedEmbeddingBagsCodegen`."""

    def __init__(self, specs: list[tuple[int, int]], feature_table_map: list[int], pooling: str,
                 weights_dtype: torch.dtype, output_dtype: torch.dtype, bounds_check: str,
                 device: torch.device | None) -> None:
        super().__init__()
        self.embedding_specs = specs
        lay = self.layout = TBELayout(tuple(r for r, _ in specs), tuple(d for _, d in specs),
                                      tuple(feature_table_map))
        self.weights_physical_offsets = list(lay.weight_offsets[:-1])
        self.weights = nn.Parameter(torch.empty(lay.total_elements, dtype=weights_dtype, device=device))
        self.pooling, self.output_dtype = pooling, output_dtype
        self.bounds_check = BoundsCheckMode(bounds_check)
        self._lt = None

    def split_embedding_weights(self) -> list[torch.Tensor]:
        w = self.weights.detach()
        return [w[o: o + r * d].view(r, d)
                for o, (r, d) in zip(self.weights_physical_offsets, self.embedding_specs, strict=True)]

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self._lt is None or self._lt.dims_T.device != self.weights.device:
            self._lt = self.layout.tensors(self.weights.device)
        B = batch_size(self.layout, offsets)
        if self.bounds_check == BoundsCheckMode.ERROR:
            check_ids(self.layout, self._lt, indices, offsets, B)
        return torch_forward(self.layout, self._lt, self.weights, indices, offsets, per_sample_weights, B,
                             self.pooling, self.output_dtype)


class TorchDenseEmbeddingBag(BatchedDenseEmbeddingBag):
    """torchrec's `dense` compute kernel (data-parallel tables) by the torch TBE's forward: FBGEMM's
    dense kernel for every device, with the same parameters, table slices and state_dict."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None = None,
                 device: torch.device | None = None, sharding_type: ShardingType | None = None) -> None:
        # skip BatchedDenseEmbeddingBag.__init__: it builds FBGEMM's dense TBE
        BaseBatchedEmbeddingBag.__init__(self, config, pg, device, sharding_type)
        fp = dict(config.fused_params or {})
        self._emb_module = TorchDenseTBE(
            list(zip(self._local_rows, self._local_cols, strict=True)), self._feature_table_map,
            _pooling(self), data_type_to_dtype(config.data_type), output_dtype_of(fp),
            fp.get("bounds_check", "error"), device)
        self._param_per_table = dict(_gen_named_parameters_by_table_dense(
            self._emb_module, self.table_name_to_count.copy(), self._config))
        self.init_parameters()


class TritonGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """Grouped pooled lookup that builds `TritonFusedEmbeddingBag` for `fused_triton` groups and
    `TorchDenseEmbeddingBag` for `dense` (data-parallel) ones."""

    def _create_embedding_kernel(self, config, device, pg, sharding_type, env):
        if config.compute_kernel == EmbeddingComputeKernel.FUSED_TRITON:
            return TritonFusedEmbeddingBag(config=config, pg=pg, device=device, sharding_type=sharding_type,
                                           env=env)
        if config.compute_kernel == EmbeddingComputeKernel.DENSE:
            return TorchDenseEmbeddingBag(config, pg, device, sharding_type)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)


class _TritonLookupMixin:
    """create_lookup of torchrec's pooled shardings, with the Triton-aware lookup."""

    _lookup_sharding_type: ShardingType | None = None

    def _lookup_configs(self) -> list[GroupedEmbeddingConfig]:
        return self._grouped_embedding_configs

    def create_lookup(self, device=None, fused_params=None, feature_processor=None) -> BaseEmbeddingLookup:
        return TritonGroupedPooledEmbeddingsLookup(
            grouped_configs=self._lookup_configs(), pg=self._pg,
            device=device if device is not None else self._device, feature_processor=feature_processor,
            sharding_type=self._lookup_sharding_type, env=self._env)


class TritonTwPooledEmbeddingSharding(_TritonLookupMixin, TwPooledEmbeddingSharding):
    """Table-wise sharding with the Triton-aware lookup."""


class TritonCwPooledEmbeddingSharding(_TritonLookupMixin, CwPooledEmbeddingSharding):
    """Column-wise sharding with the Triton-aware lookup."""


class TritonTwCwPooledEmbeddingSharding(_TritonLookupMixin, TwCwPooledEmbeddingSharding):
    """Table-column-wise sharding with the Triton-aware lookup."""


class TritonRwPooledEmbeddingSharding(_TritonLookupMixin, RwPooledEmbeddingSharding):
    """Row-wise sharding with the Triton-aware lookup."""

    _lookup_sharding_type = ShardingType.ROW_WISE


class TritonTwRwPooledEmbeddingSharding(_TritonLookupMixin, TwRwPooledEmbeddingSharding):
    """Table-row-wise sharding with the Triton-aware lookup."""

    _lookup_sharding_type = ShardingType.TABLE_ROW_WISE

    def _lookup_configs(self) -> list[GroupedEmbeddingConfig]:
        return self._grouped_embedding_configs_per_rank[self._rank]


class TorchDpPooledEmbeddingSharding(DpPooledEmbeddingSharding):
    """Data-parallel sharding whose lookup builds `TorchDenseEmbeddingBag`."""

    def create_lookup(self, device=None, fused_params=None, feature_processor=None) -> BaseEmbeddingLookup:
        return TritonGroupedPooledEmbeddingsLookup(
            grouped_configs=self._grouped_embedding_configs, pg=self._env.process_group,
            device=device if device is not None else self._device, feature_processor=feature_processor,
            scale_weight_gradients=False, env=self._env)  # as torchrec's: DP gradients are not scaled


# the sharding types the sharder offers, and their shardings
_SHARDINGS = {
    ShardingType.DATA_PARALLEL.value: TorchDpPooledEmbeddingSharding,  # the `dense` kernel
    ShardingType.TABLE_WISE.value: TritonTwPooledEmbeddingSharding,
    ShardingType.ROW_WISE.value: TritonRwPooledEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: TritonCwPooledEmbeddingSharding,
    ShardingType.TABLE_ROW_WISE.value: TritonTwRwPooledEmbeddingSharding,
    ShardingType.TABLE_COLUMN_WISE.value: TritonTwCwPooledEmbeddingSharding,
}


class TritonShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """ShardedEmbeddingBagCollection whose shardings build Triton-aware lookups; `static_graph` is DDP's
    for the data-parallel lookups (torchrec's True; False where the device cannot page-lock host memory,
    which DDP's static graph copies its used-parameter map through on every accelerator)."""

    def __init__(self, *args: Any, static_graph: bool = True, **kwargs: Any) -> None:
        self.static_graph = static_graph  # read by init_data_parallel, which torchrec's __init__ calls
        super().__init__(*args, **kwargs)

    @classmethod
    def create_embedding_bag_sharding(
        cls, sharding_infos, env, device=None, permute_embeddings=False, qcomm_codecs_registry=None
    ):
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        kernel = sharding_infos[0].param_sharding.compute_kernel
        dp = sharding_type == ShardingType.DATA_PARALLEL.value
        if kernel != (EmbeddingComputeKernel.DENSE.value if dp else TRITON_COMPUTE_KERNEL) or \
                sharding_type not in _SHARDINGS:
            return super().create_embedding_bag_sharding(
                sharding_infos, env, device, permute_embeddings=permute_embeddings,
                qcomm_codecs_registry=qcomm_codecs_registry)
        if dp:
            return TorchDpPooledEmbeddingSharding(sharding_infos, env, device)
        kwargs: dict[str, Any] = {"qcomm_codecs_registry": qcomm_codecs_registry}
        if sharding_type in (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value):
            kwargs["permute_embeddings"] = permute_embeddings
        return _SHARDINGS[sharding_type](sharding_infos, env, device, **kwargs)

    def init_data_parallel(self) -> None:
        """torchrec's DDP wrap of the data-parallel lookups, with `static_graph` (the numbers do not
        change without it)."""
        if self._skip_data_parallel_grad_sync:
            return
        dev = self._device
        ids = [dev] if dev is not None and dev.type in ("cuda", "mtia", "tpu") else None  # as torchrec's
        for i, (sharding, lookup) in enumerate(zip(self._embedding_shardings, self._lookups, strict=True)):
            if isinstance(sharding, DpPooledEmbeddingSharding):
                self._lookups[i] = DistributedDataParallel(
                    module=lookup, device_ids=ids, process_group=self._env.process_group,
                    gradient_as_bucket_view=True, broadcast_buffers=True, static_graph=self.static_graph)


def kernel_fused_params(optimizer: OptimizerConfig | None, fused_params: dict[str, Any] | None,
                        execution: str | None) -> dict[str, Any]:
    """A sharder's fused_params for anyrec's TBE: `fused_params`, its optimizer keys set by `optimizer`,
    and the kernel's `execution` where given."""
    params = dict(fused_params or {})
    if optimizer is not None:
        params.update(fused_params_from_optimizer(optimizer))
    if execution is not None:
        params["execution"] = execution
    return params


class TritonEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """EmbeddingBagCollection sharder whose model-parallel shards use the Triton TBE kernel. `optimizer` sets
    the fused update (it overrides the optimizer keys of `fused_params`); `execution` is passed to the kernel
    ("triton" | "torch"; the kernel's default, torch, if None); `static_graph` to the sharded module's DDP of
    data-parallel lookups (a settable attribute)."""

    def __init__(
        self, optimizer: OptimizerConfig | None = None, fused_params: dict[str, Any] | None = None,
        execution: str | None = None, qcomm_codecs_registry: dict | None = None, static_graph: bool = True,
    ) -> None:
        self.static_graph = static_graph
        super().__init__(fused_params=kernel_fused_params(optimizer, fused_params, execution),
                         qcomm_codecs_registry=qcomm_codecs_registry)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(_SHARDINGS)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return [EmbeddingComputeKernel.DENSE.value]
        return [TRITON_COMPUTE_KERNEL] if sharding_type in _SHARDINGS else []

    def shard(self, module, params, env, device=None, module_fqn=None) -> TritonShardedEmbeddingBagCollection:
        return TritonShardedEmbeddingBagCollection(
            module=module, table_name_to_parameter_sharding=params, env=env, fused_params=self.fused_params,
            device=device, qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
            static_graph=self.static_graph)

    @property
    def sharded_module_type(self) -> type[TritonShardedEmbeddingBagCollection]:
        return TritonShardedEmbeddingBagCollection
