"""Pure-torch execution path of the table-batched embedding (forward and fused update), no triton: the
contract of `triton_tbe` / `triton_tbe_backward` in vectorised torch ops (gathers, `index_add_`,
`torch.unique`), one pass per distinct embedding dim, no Python loop over bags or rows.
Legend (shape suffixes): N lookups, U unique rows, D embedding dim of a group, Dt output dim.
"""

from __future__ import annotations

import torch

from anyrec.kernels.layout import LayoutTensors, TBELayout, lookup_tables_N
from anyrec.kernels.optimizers import (
    OptimizerConfig,
    OptimizerKind,
    adagrad_update,
    rowwise_mean_sq,
    rowwise_step,
    sgd_update,
)
from anyrec.kernels.reference import bag_scales_N
from anyrec.kernels.triton_tbe_backward import SR_DROPPED_BITS


def _lookups(lt: LayoutTensors, indices_N, offsets_FB1, psw_N, batch: int, pooling: str):
    """Per lookup: bag, table, id and scale (both 0 for an id outside its table) and whether it is in."""
    n = indices_N.numel()
    bag_N, table_N = lookup_tables_N(lt, offsets_FB1, batch, n)
    _, scale_N = bag_scales_N(offsets_FB1, psw_N, pooling, n)
    ids_N = indices_N.long()
    ok_N = (ids_N >= 0) & (ids_N < lt.rows_T[table_N])
    return bag_N, table_N, torch.where(ok_N, ids_N, 0), torch.where(ok_N, scale_N, 0.0), ok_N


def _dim_groups(layout: TBELayout, lt: LayoutTensors, table_N: torch.Tensor):
    """(dim, selection) pairs; selection is None when every table has that dim."""
    dims = sorted(set(layout.dims))
    if len(dims) == 1:
        return [(dims[0], None)]
    dim_N = lt.dims_T[table_N]
    return [(d, (dim_N == d).nonzero().squeeze(1)) for d in dims]


def torch_forward(
    layout: TBELayout, lt: LayoutTensors, weights: torch.Tensor, indices_N: torch.Tensor,
    offsets_FB1: torch.Tensor, per_sample_weights_N: torch.Tensor | None, batch: int, pooling: str,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """Pooled lookups of every feature: [batch, layout.output_dim] in `output_dtype`."""
    out_flat = torch.zeros(batch * layout.output_dim, dtype=torch.float32, device=weights.device)
    bag_N, table_N, ids_N, scale_N, _ = _lookups(lt, indices_N, offsets_FB1, per_sample_weights_N, batch,
                                                 pooling)
    for d, sel in _dim_groups(layout, lt, table_N):
        bag, table, ids, scale = (bag_N, table_N, ids_N, scale_N)
        if sel is not None:
            bag, table, ids, scale = bag[sel], table[sel], ids[sel], scale[sel]
        ar_D = torch.arange(d, device=weights.device)
        addr_nD = (lt.weight_offsets_T[table] + ids * d)[:, None] + ar_D
        vals_nD = weights[addr_nD].float() * scale[:, None]
        f, b = bag // batch, bag % batch
        out_nD = (b * layout.output_dim + lt.col_offsets_F[f])[:, None] + ar_D
        out_flat.index_add_(0, out_nD.reshape(-1), vals_nD.reshape(-1))
    return out_flat.view(batch, layout.output_dim).to(output_dtype)


def stochastic_round_torch(x: torch.Tensor, dtype: torch.dtype, generator=None) -> torch.Tensor:
    """Round fp32 `x` to fp16/bf16, up with probability equal to the dropped fraction."""
    k = SR_DROPPED_BITS[dtype]
    noise = torch.randint(0, 1 << k, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = (x.float().contiguous().view(torch.int32) + noise) & -(1 << k)
    return bits.view(torch.float32).to(dtype)


def torch_backward_update(
    layout: TBELayout, lt: LayoutTensors, weights: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor,
    step: torch.Tensor, indices_N: torch.Tensor, offsets_FB1: torch.Tensor,
    per_sample_weights_N: torch.Tensor | None, grad_out_BDt: torch.Tensor, batch: int, pooling: str,
    opt: OptimizerConfig, stochastic_rounding: bool,
) -> None:
    """Sum each looked-up row's gradient once (duplicates merged) and apply `opt` to it, in place."""
    bag_N, table_N, ids_N, scale_N, ok_N = _lookups(lt, indices_N, offsets_FB1, per_sample_weights_N, batch,
                                                    pooling)
    grad_out_BDt = grad_out_BDt.contiguous()  # e.g. a column slice of torch.cat's gradient
    grad_flat = grad_out_BDt.view(-1)
    for d, sel in _dim_groups(layout, lt, table_N):
        keep = ok_N.nonzero().squeeze(1) if sel is None else sel[ok_N[sel]]
        bag, table, ids, scale = bag_N[keep], table_N[keep], ids_N[keep], scale_N[keep]
        ar_D = torch.arange(d, device=weights.device)
        f, b = bag // batch, bag % batch
        g_nD = grad_flat[(b * grad_out_BDt.stride(0) + lt.col_offsets_F[f])[:, None] + ar_D].float()
        grow = lt.row_starts_T[table] + ids
        rows_U, inv_N = torch.unique(grow, return_inverse=True)
        g_UD = torch.zeros(rows_U.numel(), d, dtype=torch.float32, device=weights.device)
        g_UD.index_add_(0, inv_N, g_nD * scale[:, None])
        # every occurrence of a row carries the same address; scatter them by unique slot
        base_U = torch.zeros(rows_U.numel(), dtype=torch.int64, device=weights.device)
        base_U[inv_N] = lt.weight_offsets_T[table] + ids * d
        addr_UD = base_U[:, None] + ar_D
        apply_rows(weights, state1, state2, step, rows_U, addr_UD, g_UD, opt, stochastic_rounding)


def apply_rows(weights, state1, state2, step, rows_U, addr_UD, g_UD, opt: OptimizerConfig, sr: bool) -> None:
    """Apply `opt` to unique rows `rows_U` (global row ids; element addresses `addr_UD`) from their summed
    fp32 gradients `g_UD`, updating weights and state in place."""
    w_UD = weights[addr_UD].float()
    if opt.weight_decay > 0 and opt.kind != OptimizerKind.ADAM:  # L2; Adam's is decoupled, below
        g_UD = g_UD + opt.weight_decay * w_UD
    if opt.kind == OptimizerKind.SGD:
        w_UD = sgd_update(w_UD, g_UD, opt.lr)
    elif opt.kind == OptimizerKind.ROWWISE_ADAGRAD:
        m_U = state1[rows_U] + rowwise_mean_sq(g_UD)
        state1[rows_U] = m_U
        w_UD = w_UD - g_UD * rowwise_step(m_U, opt.lr, opt.eps)[:, None]  # FBGEMM's order of operations
    elif opt.kind == OptimizerKind.ADAGRAD:
        w_UD, m_UD = adagrad_update(w_UD, g_UD, state1[addr_UD], opt.lr, opt.eps)
        state1[addr_UD] = m_UD
    else:
        m1_UD = opt.beta1 * state1[addr_UD] + (1 - opt.beta1) * g_UD
        m2_UD = opt.beta2 * state2[addr_UD] + (1 - opt.beta2) * g_UD * g_UD
        state1[addr_UD] = m1_UD
        state2[addr_UD] = m2_UD
        bc1 = 1 - torch.pow(opt.beta1, step)
        bc2 = 1 - torch.pow(opt.beta2, step)
        w_UD = w_UD - opt.lr * ((m1_UD / bc1) / ((m2_UD / bc2).sqrt() + opt.eps) + opt.weight_decay * w_UD)
    if sr and weights.dtype in SR_DROPPED_BITS:
        weights[addr_UD] = stochastic_round_torch(w_UD, weights.dtype)
    else:
        weights[addr_UD] = w_UD.to(weights.dtype)
