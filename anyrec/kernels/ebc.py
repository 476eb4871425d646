"""`TritonEmbeddingBagCollection`: a drop-in for torchrec's unsharded `EmbeddingBagCollection` on the
Triton TBE, with the optimizer fused into backward and no FBGEMM op anywhere.

For single-device jobs (`backend.embedding_kernel=triton`): no DistributedModelParallel, so no KJT
all-to-all or `permute` (FBGEMM ops on GPUs). The KJT is read as it arrives: `values()`, and its offsets,
or `torch.cumsum` of `lengths()` (torchrec's `offsets()` calls `fbgemm::asynchronous_complete_cumsum`);
keys in another order are mapped by name, without `permute`.

Weights and optimizer state live in the TBE's flat buffers; `embedding_bags.<table>.weight` (an
`nn.Parameter` view, requires_grad=False) and `embedding_bags.<table>.momentum1/2` (buffer views) give the
state_dict torchrec's EBC has, plus the optimizer state and `tbe.step`. The weights are updated in
backward, so the dense optimizer must skip them: they carry `_in_backward_optimizers` (what torchrec's
`in_backward_optimizer_filter` checks), and `dense_named_parameters(model)` filters alike without torchrec.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from anyrec.kernels.layout import BoundsCheckMode
from anyrec.kernels.optimizers import OptimizerConfig
from anyrec.kernels.tbe import TritonTableBatchedEmbedding

logger = logging.getLogger(__name__)

# `param._in_backward_optimizers` of the collection's weights (torch's `_apply_optimizer_in_backward`
# stores a list of optimizers there; only its presence is checked)
FUSED_IN_BACKWARD = ["anyrec.kernels: fused TBE update applied in backward"]

_DTYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}
_POOLING = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


def dense_named_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """`module.named_parameters()` without the weights updated in backward (the dense optimizer's set)."""
    for name, p in module.named_parameters():
        if not hasattr(p, "_in_backward_optimizers"):
            yield name, p


def kjt_offsets(kjt: KeyedJaggedTensor) -> torch.Tensor:
    """The KJT's F*B+1 offsets, computed with torch ops when it holds only lengths (no FBGEMM op)."""
    offsets = kjt.offsets_or_none()
    if offsets is not None:
        return offsets
    lengths = kjt.lengths()
    out = torch.zeros(lengths.numel() + 1, dtype=lengths.dtype, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


class TritonEmbeddingBagCollection(nn.Module):
    """Unsharded EmbeddingBagCollection on the Triton TBE: forward(KJT) -> KeyedTensor, like torchrec's.

    Output keys are the feature names in table order, values [B, sum of dims], fp32. All tables share one
    pooling (sum or mean) and one weight dtype (`weights_dtype`, default: the configs' data_type).
    `bounds_check`: "error" raises naming the feature and id (one host sync per batch); "skip"/"off" masks bad
    ids in the kernels instead (no sync)."""

    def __init__(
        self, tables: Sequence[EmbeddingBagConfig], optimizer: OptimizerConfig | None = None,
        device: torch.device | str | None = None, execution: str = "torch",
        weights_dtype: torch.dtype | None = None, bounds_check: BoundsCheckMode | str = BoundsCheckMode.ERROR,
        is_weighted: bool = False, stochastic_rounding: bool = True,
    ) -> None:
        super().__init__()
        tables = list(tables)
        if not tables:
            raise ValueError("TritonEmbeddingBagCollection needs at least one table")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names in {names}")
        features = [f for t in tables for f in (t.feature_names or [t.name])]
        if len(set(features)) != len(features):
            raise ValueError(f"a feature may feed only one table; got {features}")
        poolings = {t.pooling for t in tables}
        if len(poolings) != 1 or next(iter(poolings)) not in _POOLING:
            got = sorted(map(str, poolings))
            raise ValueError(f"all tables need the same pooling, SUM or MEAN; got {got}")
        if weights_dtype is None:
            dtypes = {t.data_type for t in tables}
            if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
                raise ValueError(f"tables need one data_type among FP32/FP16/BF16, got {dtypes}; "
                                 "or pass weights_dtype")
            weights_dtype = _DTYPES[next(iter(dtypes))]
        self._configs, self._is_weighted, self._feature_names = tables, is_weighted, features
        self._feature_index = {f: i for i, f in enumerate(features)}
        self._dims_per_feature = [t.embedding_dim for t in tables for _ in (t.feature_names or [t.name])]
        self.tbe = TritonTableBatchedEmbedding(
            [(t.num_embeddings, t.embedding_dim) for t in tables],
            feature_table_map=[i for i, t in enumerate(tables) for _ in (t.feature_names or [t.name])],
            optimizer=optimizer, pooling=_POOLING[next(iter(poolings))], weights_dtype=weights_dtype,
            stochastic_rounding=stochastic_rounding, bounds_check=bounds_check, feature_names=features,
            device=device, execution=execution)
        # the flat buffers reach the state_dict through the per-table views only
        for name, buf in list(self.tbe.named_buffers(recurse=False)):
            if name != "step":
                self.tbe.register_buffer(name, buf, persistent=False)
        # `embedding_bags.<table>`: views of one table's weight and optimizer state (its state_dict keys)
        self.embedding_bags = nn.ModuleDict({t.name: nn.Module() for t in tables})
        self._bind_views()
        self.reset_parameters()

    # ---- torchrec EmbeddingBagCollection interface ----------------------------------------------

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self.tbe.weight.device

    @property
    def optimizer(self) -> OptimizerConfig:
        return self.tbe.optimizer

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each table's `init_fn` if it has one, else uniform(+-1/sqrt(rows)); zero optimizer state."""
        self.tbe.reset_parameters()
        for cfg, w in zip(self._configs, self.tbe.split_embedding_weights(), strict=True):
            if cfg.init_fn is not None:
                cfg.init_fn(w)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of every feature (table order); backward applies the fused optimizer."""
        keys = features.keys()
        if features.variable_stride_per_key():
            raise ValueError("TritonEmbeddingBagCollection needs one batch size for every feature")
        missing = [f for f in self._feature_names if f not in keys]
        if missing:
            raise ValueError(f"KJT lacks features {missing} (has {keys})")
        batch = features.stride()
        values, offsets = features.values(), kjt_offsets(features)
        weights = features.weights() if self._is_weighted else None
        if len(keys) != len(self._feature_names):
            values, offsets, weights, keys = self._drop_extra_keys(keys, values, offsets, weights, batch)
        order = None if list(keys) == self._feature_names else [self._feature_index[k] for k in keys]
        out = self.tbe(values, offsets, weights, feature_order=order)
        return KeyedTensor(keys=self._feature_names, length_per_key=self._dims_per_feature, values=out)

    def _drop_extra_keys(self, keys, values, offsets, weights, batch):
        """Keep the features this collection reads (a copy; one host sync for the key boundaries)."""
        kept = [i for i, k in enumerate(keys) if k in self._feature_index]
        bounds = offsets[:: max(batch, 1)].tolist() if batch else [0] * (len(keys) + 1)
        vals, offs, wts, base = [], [], [], 0
        for i in kept:
            lo, hi = bounds[i], bounds[i + 1]
            vals.append(values[lo:hi])
            offs.append(offsets[i * batch: (i + 1) * batch] - lo + base)
            if weights is not None:
                wts.append(weights[lo:hi])
            base += hi - lo
        offs.append(offsets.new_full((1,), base))
        return (torch.cat(vals), torch.cat(offs), torch.cat(wts) if weights is not None else None,
                [keys[i] for i in kept])

    # ---- views into the flat buffers ------------------------------------------------------------

    def _bind_views(self) -> None:
        states = self.tbe.get_optimizer_state()
        for cfg, w, state in zip(self._configs, self.tbe.split_embedding_weights(), states, strict=True):
            slot = self.embedding_bags[cfg.name]
            param = nn.Parameter(w, requires_grad=False)
            param._in_backward_optimizers = FUSED_IN_BACKWARD
            slot.weight = param
            for i, v in enumerate(state.values(), start=1):
                slot.register_buffer(f"momentum{i}", v)

    def _apply(self, fn, recurse=True):
        # move/cast the flat buffers once, then re-point the views (moving each view would copy it)
        self.tbe._apply(fn, recurse)
        self._bind_views()
        return self


class TritonEBCOptimizer(KeyedOptimizer):
    """The fused optimizer of an unsharded TritonEmbeddingBagCollection as a torchrec KeyedOptimizer. The
    update runs inside backward; like torchrec's fused optimizers, `zero_grad()` (before the step's
    backward) and `step()` hand the param group's learning rate to the kernel, so the rows update at the
    rate the schedule set for this step; there are no gradients to clear. The optimizer state (momentum
    buffers, step) is part of the module's state_dict."""

    def __init__(self, ebc: TritonEmbeddingBagCollection, prefix: str = "") -> None:
        self._ebc = ebc
        params = {f"{prefix}embedding_bags.{name}.weight": slot.weight
                  for name, slot in ebc.embedding_bags.items()}
        super().__init__(params, state={}, param_groups=[{"params": list(params.values()),
                                                          "lr": ebc.optimizer.lr}])

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._hand_rate()

    def step(self, closure=None) -> None:  # noqa: ARG002 - torch.optim signature
        self._hand_rate()

    def _hand_rate(self) -> None:
        self._ebc.tbe.learning_rate = float(self.param_groups[0]["lr"])
