"""`TritonTableBatchedEmbedding`: embedding bags over many tables with the optimizer fused into the backward,
like FBGEMM's `SplitTableBatchedEmbeddingBagsCodegen` but portable: pooled (sum, mean) or unpooled ("none",
a sequence's lookups, one output row per id: `sequence_tbe`).

All tables share one flat weight buffer and flat optimizer-state buffers (buffers, so `state_dict()` carries
them). The backward applies the optimizer update in place and returns no weight gradient, so training code
never calls an optimizer for these weights (`learning_rate` can change between steps). Execution is "triton"
(CUDA, ROCm, or CPU under TRITON_INTERPRET=1) or "torch" (vectorised torch ops, any device; the default); the
caller chooses, asking for triton where it cannot run raises, and the choice is logged once per device type.
Legend (shape suffixes): N lookups, F features, B batch size, Dt output dim, T tables.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch
from torch import nn

from anyrec.kernels import triton_tbe, triton_tbe_backward
from anyrec.kernels._triton import interpreter_enabled
from anyrec.kernels.layout import BoundsCheckMode, LayoutTensors, TBELayout, batch_size, check_ids
from anyrec.kernels.optimizers import OptimizerConfig, OptimizerKind, zero_state
from anyrec.kernels.reference import POOLING_MODES
from anyrec.kernels.sequence_tbe import (
    check_sequence_layout,
    torch_sequence_backward_update,
    torch_sequence_forward,
    triton_sequence_backward_update,
    triton_sequence_forward,
)
from anyrec.kernels.torch_tbe import torch_backward_update, torch_forward

logger = logging.getLogger(__name__)

EXECUTIONS = ("triton", "torch")
UNPOOLED = "none"  # the pooling of sequence lookups (FBGEMM's PoolingMode.NONE)
LOOKUP_POOLINGS = (*POOLING_MODES, UNPOOLED)

_LOGGED: set[tuple[str, str]] = set()


def check_execution(execution: str, device: torch.device) -> str:
    """`execution` if it runs on tensors on `device`; ValueError when it is unknown or cannot run there."""
    if execution not in EXECUTIONS:
        raise ValueError(f"execution must be one of {EXECUTIONS}, got {execution!r}")
    runs_here = triton_tbe.HAS_TRITON and (device.type != "cpu" or interpreter_enabled())
    if execution == "triton" and not runs_here:
        why = ("triton is not installed" if not triton_tbe.HAS_TRITON
               else "CPU tensors need TRITON_INTERPRET=1")
        raise ValueError(f"triton execution requested on {device} but {why}; use execution='torch'")
    if (execution, device.type) not in _LOGGED:
        _LOGGED.add((execution, device.type))
        logger.info("table-batched embedding: %s execution on %s", execution, device.type)
    return execution


class _TBELookup(torch.autograd.Function):
    """Lookup forward; backward applies the fused optimizer and returns no gradients."""

    @staticmethod
    def forward(ctx, placeholder, module, layouts, indices_N, offsets_FB1, psw_N, batch):
        ctx.module, ctx.layouts, ctx.batch = module, layouts, batch
        ctx.inputs = (indices_N, offsets_FB1, psw_N)
        return module._lookup_forward(layouts, indices_N, offsets_FB1, psw_N, batch)

    @staticmethod
    def backward(ctx, grad_out_BDt):
        indices_N, offsets_FB1, psw_N = ctx.inputs
        ctx.module._fused_update(ctx.layouts, indices_N, offsets_FB1, psw_N, grad_out_BDt, ctx.batch)
        return None, None, None, None, None, None, None


class TritonTableBatchedEmbedding(nn.Module):
    """Table-batched embeddings with a fused optimizer (sum/mean/none; fp32/fp16/bf16 weights).
    `embedding_specs`: (rows, dim) per table. `feature_table_map`: table of each KJT feature (default: feature
    t reads table t). forward(indices, offsets, per_sample_weights) takes a KJT's values and offsets (F*B+1,
    feature-major, int32 or int64) and returns [B, sum of the features' dims] pooled, [N ids, dim] unpooled
    (pooling "none": every table one dim, no per-sample weights)."""

    def __init__(
        self, embedding_specs: Sequence[tuple[int, int]], feature_table_map: Sequence[int] | None = None,
        optimizer: OptimizerConfig | None = None, pooling: str = "sum",
        weights_dtype: torch.dtype = torch.float32, output_dtype: torch.dtype = torch.float32,
        stochastic_rounding: bool = True, bounds_check: BoundsCheckMode | str = BoundsCheckMode.ERROR,
        feature_names: Sequence[str] | None = None, device: torch.device | str | None = None,
        execution: str = "torch",
    ) -> None:
        super().__init__()
        if pooling not in LOOKUP_POOLINGS:
            raise ValueError(f"pooling must be one of {LOOKUP_POOLINGS}, got {pooling!r}")
        for name, dtype in (("weights_dtype", weights_dtype), ("output_dtype", output_dtype)):
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"{name} must be fp32, fp16 or bf16, got {dtype}")
        specs = [(int(r), int(d)) for r, d in embedding_specs]
        ftm = tuple(feature_table_map) if feature_table_map is not None else tuple(range(len(specs)))
        self.layout = TBELayout(tuple(r for r, _ in specs), tuple(d for _, d in specs), ftm,
                                tuple(feature_names or ()))
        if pooling == UNPOOLED:
            check_sequence_layout(self.layout)
        self.optimizer = optimizer or OptimizerConfig()
        self.pooling, self.output_dtype, self.stochastic_rounding = pooling, output_dtype, stochastic_rounding
        self.bounds_check = BoundsCheckMode(bounds_check)
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.execution = check_execution(execution, device)  # fail at construction, not at the first batch
        lay = self.layout
        self.register_buffer("weight", torch.empty(lay.total_elements, dtype=weights_dtype, device=device))
        for name, buf in zero_state(self.optimizer.kind, lay.total_rows, lay.total_elements, device).items():
            self.register_buffer(name, buf)
        self.register_buffer("step", torch.zeros((), device=device))  # fp32 count of fused updates
        self.register_buffer("table_offsets", torch.tensor(lay.weight_offsets[:-1], device=device),
                             persistent=False)
        self._layouts_by_order: dict[tuple[int, ...] | None, tuple[TBELayout, LayoutTensors]] = {}
        self._placeholder = torch.zeros(0, requires_grad=True)
        self.reset_parameters()

    # ---- parameters and state -------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Uniform(-1/sqrt(rows), 1/sqrt(rows)) per table (torchrec's default), zero optimizer state."""
        for w in self.split_embedding_weights():
            bound = w.shape[0] ** -0.5
            w.uniform_(-bound, bound)
        for name in ("momentum1", "momentum2", "step"):
            if hasattr(self, name):
                getattr(self, name).zero_()

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """Per-table [rows, dim] views into the flat weight buffer."""
        lay = self.layout
        return [self.weight[o: o + r * d].view(r, d)
                for o, r, d in zip(lay.weight_offsets[:-1], lay.rows, lay.dims, strict=True)]

    def get_optimizer_state(self) -> list[dict[str, torch.Tensor]]:
        """Per-table views of the optimizer state, keyed as FBGEMM keys them ("sum", "exp_avg", ...)."""
        lay, kind, out = self.layout, self.optimizer.kind, []
        for t in range(len(lay.rows)):
            e0, e1 = lay.weight_offsets[t], lay.weight_offsets[t + 1]
            shape = (lay.rows[t], lay.dims[t])
            if kind == OptimizerKind.ROWWISE_ADAGRAD:
                out.append({"sum": self.momentum1[lay.row_starts[t]: lay.row_starts[t + 1]]})
            elif kind == OptimizerKind.ADAGRAD:
                out.append({"sum": self.momentum1[e0:e1].view(shape)})
            elif kind == OptimizerKind.ADAM:
                out.append({"exp_avg": self.momentum1[e0:e1].view(shape),
                            "exp_avg_sq": self.momentum2[e0:e1].view(shape)})
            else:
                out.append({})
        return out

    @property
    def learning_rate(self) -> float:
        return self.optimizer.lr

    @learning_rate.setter
    def learning_rate(self, lr: float) -> None:
        self.optimizer = dataclasses.replace(self.optimizer, lr=float(lr))

    def flush(self) -> None:
        """No cache to flush (present for torchrec's kernel interface)."""

    def reset_cache_states(self) -> None:
        """No cache to reset (present for torchrec's kernel interface)."""

    def _apply(self, fn, recurse=True):
        self._layouts_by_order.clear()
        return super()._apply(fn, recurse)

    # ---- compute --------------------------------------------------------------------------------

    def _layouts(self, feature_order: Sequence[int] | None = None) -> tuple[TBELayout, LayoutTensors]:
        """(layout, device tensors) for features arriving in `feature_order` (None: layout order)."""
        key = None if feature_order is None else tuple(feature_order)
        if key not in self._layouts_by_order:
            lay = self.layout if key is None else self.layout.permuted(key)
            self._layouts_by_order[key] = (lay, lay.tensors(self.weight.device))
        return self._layouts_by_order[key]

    def forward(
        self, indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None,
        feature_order: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Pooled lookups [B, output_dim] (unpooled: [N, dim]); in training, backward applies the fused
        optimizer.
        `feature_order`: when the KJT's features come in another order than the layout's, feature i of the
        input is layout feature feature_order[i]; the output columns keep the layout order."""
        layouts = self._layouts(feature_order)
        B = batch_size(self.layout, offsets)
        if per_sample_weights is not None and per_sample_weights.numel() != indices.numel():
            raise ValueError("per_sample_weights needs one weight per id")
        if per_sample_weights is not None and self.pooling == UNPOOLED:
            raise ValueError("unpooled lookups take no per_sample_weights")
        if self.bounds_check == BoundsCheckMode.ERROR:
            check_ids(*layouts, indices, offsets, B)
        if self.training and torch.is_grad_enabled():
            return _TBELookup.apply(self._placeholder, self, layouts, indices, offsets, per_sample_weights, B)
        return self._lookup_forward(layouts, indices, offsets, per_sample_weights, B)

    def _lookup_forward(self, layouts, indices_N, offsets_FB1, psw_N, batch: int) -> torch.Tensor:
        triton = self._execution() == "triton"
        if self.pooling == UNPOOLED:
            run_rows = triton_sequence_forward if triton else torch_sequence_forward
            return run_rows(*layouts, self.weight, indices_N, offsets_FB1, batch, self.output_dtype)
        run = triton_tbe.triton_forward if triton else torch_forward
        return run(*layouts, self.weight, indices_N, offsets_FB1, psw_N, batch, self.pooling,
                   self.output_dtype)

    def _execution(self) -> str:
        return check_execution(self.execution, self.weight.device)

    @torch.no_grad()
    def _fused_update(self, layouts, indices_N, offsets_FB1, psw_N, grad_out_BDt, batch: int) -> None:
        self.step += 1
        dummy = torch.zeros(1, device=self.weight.device)
        state1 = getattr(self, "momentum1", dummy)
        state2 = getattr(self, "momentum2", dummy)
        layout, lt = layouts
        if self.pooling == UNPOOLED:
            if self._execution() == "triton":
                seed = int(torch.randint(0, 2**31 - 1, (1,)))  # CPU generator: no device sync
                triton_sequence_backward_update(layout, lt, self.weight, state1, state2, self.step, indices_N,
                                                offsets_FB1, grad_out_BDt, batch, self.optimizer,
                                                self.stochastic_rounding, seed)
            else:
                torch_sequence_backward_update(layout, lt, self.weight, state1, state2, self.step, indices_N,
                                               offsets_FB1, grad_out_BDt, batch, self.optimizer,
                                               self.stochastic_rounding)
            return
        if self._execution() == "triton":
            segments = triton_tbe_backward.dedupe_rows(layout, lt, indices_N, offsets_FB1, batch)
            seed = int(torch.randint(0, 2**31 - 1, (1,)))  # CPU generator: no device sync
            triton_tbe_backward.triton_backward_update(
                layout, lt, self.weight, state1, state2, self.step, segments, offsets_FB1, psw_N,
                grad_out_BDt, batch, self.pooling, self.optimizer, self.stochastic_rounding, seed,
            )
        else:
            torch_backward_update(
                layout, lt, self.weight, state1, state2, self.step, indices_N, offsets_FB1, psw_N,
                grad_out_BDt, batch, self.pooling, self.optimizer, self.stochastic_rounding,
            )
