"""Pure-torch oracle for table-batched embeddings: pooled forward and the fused optimizer updates.

Written for clarity, not speed: per table, a dense fp32 gradient is built with `index_add_` and the update
is applied to the rows that were looked up. The Triton kernels and the torch execution path of
`TritonTableBatchedEmbedding` are tested against these functions.
Legend (shape suffixes): N lookups (ids), F features, B batch size, T tables, R rows of one table, D
embedding dim of one table, Dt total output dim (sum of the features' dims). KJT layout: `offsets_FB1` has
F*B+1 entries, feature-major (bag f*B+b is feature f, sample b).
"""

from __future__ import annotations

import torch

from anyrec.kernels.optimizers import (
    OptimizerConfig,
    OptimizerKind,
    adagrad_update,
    rowwise_mean_sq,
    rowwise_step,
    sgd_update,
)

POOLING_MODES = ("sum", "mean")


def bag_scales_N(offsets_FB1: torch.Tensor, per_sample_weights_N: torch.Tensor | None, pooling: str, n: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per lookup: its bag index and the fp32 factor it enters the pooled sum with."""
    lengths_FB = (offsets_FB1[1:] - offsets_FB1[:-1]).long()
    bag_N = torch.repeat_interleave(torch.arange(lengths_FB.numel(), device=offsets_FB1.device), lengths_FB,
                                    output_size=n)
    scale_N = torch.ones(n, dtype=torch.float32, device=offsets_FB1.device)
    if per_sample_weights_N is not None:
        scale_N = scale_N * per_sample_weights_N.float()
    if pooling == "mean":
        scale_N = scale_N / lengths_FB[bag_N].clamp(min=1).float()
    return bag_N, scale_N


def pooled_forward_ref(
    tables: list[torch.Tensor], feature_table_map: list[int], indices_N: torch.Tensor,
    offsets_FB1: torch.Tensor, per_sample_weights_N: torch.Tensor | None = None, pooling: str = "sum",
) -> torch.Tensor:
    """Pooled lookups of every feature, concatenated along columns: an fp32 [B, Dt] tensor."""
    F = len(feature_table_map)
    B = (offsets_FB1.numel() - 1) // F
    n = indices_N.numel()
    bag_N, scale_N = bag_scales_N(offsets_FB1, per_sample_weights_N, pooling, n)
    outs = []
    for f, t in enumerate(feature_table_map):
        w_RD = tables[t].float()
        sel_N = (bag_N // B) == f
        rows_n = w_RD[indices_N[sel_N].long()] * scale_N[sel_N, None]
        out_BD = torch.zeros(B, w_RD.shape[1], dtype=torch.float32, device=w_RD.device)
        out_BD.index_add_(0, bag_N[sel_N] - f * B, rows_n)
        outs.append(out_BD)
    return torch.cat(outs, dim=1)


def row_gradients_ref(
    tables: list[torch.Tensor], feature_table_map: list[int], indices_N: torch.Tensor,
    offsets_FB1: torch.Tensor, grad_out_BDt: torch.Tensor, per_sample_weights_N: torch.Tensor | None = None,
    pooling: str = "sum",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Dense fp32 gradient of every table, and the mask of rows looked up at least once."""
    F = len(feature_table_map)
    B = (offsets_FB1.numel() - 1) // F
    n = indices_N.numel()
    bag_N, scale_N = bag_scales_N(offsets_FB1, per_sample_weights_N, pooling, n)
    grads = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in tables]
    touched = [torch.zeros(w.shape[0], dtype=torch.bool, device=w.device) for w in tables]
    col = 0
    for f, t in enumerate(feature_table_map):
        D = tables[t].shape[1]
        sel_N = (bag_N // B) == f
        ids_n = indices_N[sel_N].long()
        g_nD = grad_out_BDt[bag_N[sel_N] - f * B, col : col + D].float() * scale_N[sel_N, None]
        grads[t].index_add_(0, ids_n, g_nD)
        touched[t][ids_n] = True
        col += D
    return grads, touched


def init_state_ref(kind: OptimizerKind | str, rows: int, dim: int, device=None) -> dict[str, torch.Tensor]:
    """Zero optimizer state of one table, keyed like FBGEMM's `get_optimizer_state()`."""
    kind = OptimizerKind(kind)
    if kind == OptimizerKind.ROWWISE_ADAGRAD:
        return {"sum": torch.zeros(rows, device=device)}
    if kind == OptimizerKind.ADAGRAD:
        return {"sum": torch.zeros(rows, dim, device=device)}
    if kind == OptimizerKind.ADAM:
        return {"exp_avg": torch.zeros(rows, dim, device=device),
                "exp_avg_sq": torch.zeros(rows, dim, device=device)}
    return {}


def apply_optimizer_ref(
    weight_RD: torch.Tensor, state: dict[str, torch.Tensor], grad_RD: torch.Tensor, touched_R: torch.Tensor,
    opt: OptimizerConfig, step: int,
) -> torch.Tensor:
    """One update of the touched rows; returns the new fp32 weights and updates `state` in place. `step` is
    the 1-based step number (Adam's bias correction)."""
    w = weight_RD.float().clone()
    rows = touched_R.nonzero().squeeze(1)
    g = grad_RD[rows]
    wr = w[rows]
    if opt.weight_decay > 0 and opt.kind != OptimizerKind.ADAM:  # L2; Adam's is decoupled, below
        g = g + opt.weight_decay * wr
    if opt.kind == OptimizerKind.SGD:
        wr = sgd_update(wr, g, opt.lr)
    elif opt.kind == OptimizerKind.ROWWISE_ADAGRAD:
        m = state["sum"][rows] + rowwise_mean_sq(g)
        state["sum"][rows] = m
        wr = wr - g * rowwise_step(m, opt.lr, opt.eps)[:, None]
    elif opt.kind == OptimizerKind.ADAGRAD:
        wr, m = adagrad_update(wr, g, state["sum"][rows], opt.lr, opt.eps)
        state["sum"][rows] = m
    elif opt.kind == OptimizerKind.ADAM:
        m1 = opt.beta1 * state["exp_avg"][rows] + (1 - opt.beta1) * g
        m2 = opt.beta2 * state["exp_avg_sq"][rows] + (1 - opt.beta2) * g * g
        state["exp_avg"][rows] = m1
        state["exp_avg_sq"][rows] = m2
        bc1 = 1 - opt.beta1**step
        bc2 = 1 - opt.beta2**step
        wr = wr - opt.lr * ((m1 / bc1) / ((m2 / bc2).sqrt() + opt.eps) + opt.weight_decay * wr)
    w[rows] = wr
    return w
