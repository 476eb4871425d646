"""Fused table-batched embedding backward + optimizer update in Triton, with no dense gradient.

Two stages. `dedupe_rows` (torch ops) gives every lookup a global row id (table row start + id),
sorts them stably and cuts the sorted list into one segment per unique row. `tbe_backward_kernel`
then runs one program per unique row: it sums the row's gradient over its segment in fp32 (each
lookup reads grad_out of its bag, times its per-sample weight and 1/len for mean pooling), applies
the optimizer to the row and its state, and writes the row back once. Duplicate ids, within a bag
or across bags and features, therefore update each row exactly once and no atomics touch weights
or optimizer state. fp16/bf16 rows are written with stochastic rounding when asked.

Legend (shape suffixes): N lookups, U unique rows, L lookups of one segment handled per loop step
(BLOCK_L), D columns of the row (BLOCK_D >= the largest dim: row-wise Adagrad needs the whole row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from anyrec.kernels.layout import LayoutTensors, TBELayout, lookup_tables_N
from anyrec.kernels.optimizers import OptimizerConfig, OptimizerKind
from anyrec.kernels.triton_tbe import HAS_TRITON, tl, triton

# kernel code of each optimizer rule (a constexpr of the kernel)
OPTIMIZER_CODES: dict[OptimizerKind, int] = {
    OptimizerKind.SGD: 0,
    OptimizerKind.ROWWISE_ADAGRAD: 1,
    OptimizerKind.ADAGRAD: 2,
    OptimizerKind.ADAM: 3,
}

# fp32 mantissa bits dropped when rounding to the low-precision type (stochastic rounding noise)
SR_DROPPED_BITS: dict[torch.dtype, int] = {torch.bfloat16: 16, torch.float16: 13}


@dataclass(frozen=True)
class RowSegments:
    """Lookups sorted by global row, cut into one segment per unique row."""

    unique_rows_U: torch.Tensor  # int64 global row ids (sentinel total_rows for skipped lookups)
    segment_offsets_U1: torch.Tensor  # int64 [U+1] into order_N
    order_N: torch.Tensor  # int64 lookup index, sorted by global row
    bag_N: torch.Tensor  # int64 bag (f*batch+b) of each lookup, in input order


def dedupe_rows(
    layout: TBELayout, lt: LayoutTensors, indices_N: torch.Tensor, offsets_FB1: torch.Tensor, batch: int
) -> RowSegments:
    """Sort lookups by global row id and segment them; out-of-range ids go to a trailing sentinel."""
    n = indices_N.numel()
    bag_N, table_N = lookup_tables_N(lt, offsets_FB1, batch, n)
    ids_N = indices_N.long()
    ok_N = (ids_N >= 0) & (ids_N < lt.rows_T[table_N])
    grow_N = torch.where(ok_N, lt.row_starts_T[table_N] + ids_N, layout.total_rows)
    sorted_N, order_N = torch.sort(grow_N, stable=True)
    unique_U, counts_U = torch.unique_consecutive(sorted_N, return_counts=True)
    seg_U1 = torch.zeros(unique_U.numel() + 1, dtype=torch.int64, device=indices_N.device)
    torch.cumsum(counts_U, 0, out=seg_U1[1:])
    return RowSegments(unique_U, seg_U1, order_N, bag_N)


if HAS_TRITON:

    @triton.jit
    def stochastic_round(x, seed, offs, DROPPED_BITS: tl.constexpr):
        """Round fp32 `x` to a type keeping 23 - DROPPED_BITS mantissa bits, up with probability frac."""
        bits = x.to(tl.int32, bitcast=True)
        noise = (tl.randint(seed, offs) & ((1 << DROPPED_BITS) - 1)).to(tl.int32)
        bits = (bits + noise) & (-(1 << DROPPED_BITS))
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def tbe_backward_kernel(
        weights_ptr,  # flat weights (updated in place)
        state1_ptr,  # rowwise: [total_rows] fp32; adagrad/adam: flat like weights (fp32)
        state2_ptr,  # adam second moment, flat like weights (fp32)
        step_ptr,  # fp32 scalar: adam step number after this update
        weight_offsets_T_ptr,
        row_starts_T_ptr,
        dims_T_ptr,
        feature_table_map_F_ptr,
        col_offsets_F_ptr,
        offsets_FB1_ptr,
        psw_N_ptr,
        unique_rows_U_ptr,
        segment_offsets_U1_ptr,
        order_N_ptr,
        bag_N_ptr,
        grad_out_ptr,  # [batch, grad_stride]
        grad_stride,
        batch,
        total_rows,
        lr,
        eps,
        beta1,
        beta2,
        weight_decay,
        seed,
        OPTIMIZER: tl.constexpr,
        HAS_PSW: tl.constexpr,
        MEAN: tl.constexpr,
        STOCHASTIC_ROUNDING: tl.constexpr,
        DROPPED_BITS: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        u = tl.program_id(0)
        row = tl.load(unique_rows_U_ptr + u)
        if row < total_rows:
            seg_start = tl.load(segment_offsets_U1_ptr + u)
            seg_end = tl.load(segment_offsets_U1_ptr + u + 1)
            first = tl.load(order_N_ptr + seg_start)
            t = tl.load(feature_table_map_F_ptr + tl.load(bag_N_ptr + first) // batch)
            dim = tl.load(dims_T_ptr + t)
            local_row = row - tl.load(row_starts_T_ptr + t)
            base = tl.load(weight_offsets_T_ptr + t) + local_row * dim
            d_D = tl.arange(0, BLOCK_D)
            d_ok_D = d_D < dim
            g_D = tl.zeros([BLOCK_D], dtype=tl.float32)
            for s in range(seg_start, seg_end, BLOCK_L):
                j_L = s + tl.arange(0, BLOCK_L)
                j_ok_L = j_L < seg_end
                i_L = tl.load(order_N_ptr + j_L, mask=j_ok_L, other=0)
                bag_L = tl.load(bag_N_ptr + i_L, mask=j_ok_L, other=0)
                f_L = bag_L // batch
                b_L = bag_L % batch
                col_L = tl.load(col_offsets_F_ptr + f_L, mask=j_ok_L, other=0)
                scale_L = tl.where(j_ok_L, 1.0, 0.0)
                if HAS_PSW:
                    scale_L = scale_L * tl.load(psw_N_ptr + i_L, mask=j_ok_L, other=0.0).to(tl.float32)
                if MEAN:
                    lo_L = tl.load(offsets_FB1_ptr + bag_L, mask=j_ok_L, other=0)
                    hi_L = tl.load(offsets_FB1_ptr + bag_L + 1, mask=j_ok_L, other=1)
                    scale_L = scale_L / tl.maximum(hi_L - lo_L, 1).to(tl.float32)
                go_ptr_LD = grad_out_ptr + (b_L * grad_stride + col_L)[:, None] + d_D[None, :]
                go_LD = tl.load(go_ptr_LD, mask=j_ok_L[:, None] & d_ok_D[None, :], other=0.0)
                g_D += tl.sum(go_LD.to(tl.float32) * scale_L[:, None], axis=0)
            w_D = tl.load(weights_ptr + base + d_D, mask=d_ok_D, other=0.0).to(tl.float32)
            if weight_decay > 0:
                g_D = g_D + weight_decay * w_D
            if OPTIMIZER == 0:
                w_D = w_D - lr * g_D
            elif OPTIMIZER == 1:
                m = tl.load(state1_ptr + row) + tl.sum(g_D * g_D, axis=0) / dim.to(tl.float32)
                tl.store(state1_ptr + row, m)
                w_D = w_D - lr * g_D / (tl.sqrt(m) + eps)
            elif OPTIMIZER == 2:
                m_D = tl.load(state1_ptr + base + d_D, mask=d_ok_D, other=0.0) + g_D * g_D
                tl.store(state1_ptr + base + d_D, m_D, mask=d_ok_D)
                w_D = w_D - lr * g_D / (tl.sqrt(m_D) + eps)
            else:
                m1_D = tl.load(state1_ptr + base + d_D, mask=d_ok_D, other=0.0)
                m2_D = tl.load(state2_ptr + base + d_D, mask=d_ok_D, other=0.0)
                m1_D = beta1 * m1_D + (1 - beta1) * g_D
                m2_D = beta2 * m2_D + (1 - beta2) * g_D * g_D
                tl.store(state1_ptr + base + d_D, m1_D, mask=d_ok_D)
                tl.store(state2_ptr + base + d_D, m2_D, mask=d_ok_D)
                step = tl.load(step_ptr)
                bc1 = 1 - tl.exp(step * tl.log(beta1))
                bc2 = 1 - tl.exp(step * tl.log(beta2))
                w_D = w_D - lr * (m1_D / bc1) / (tl.sqrt(m2_D / bc2) + eps)
            if STOCHASTIC_ROUNDING:
                w_D = stochastic_round(w_D, seed, row * BLOCK_D + d_D, DROPPED_BITS)
            tl.store(weights_ptr + base + d_D, w_D.to(weights_ptr.dtype.element_ty), mask=d_ok_D)


def backward_blocks(max_dim: int) -> tuple[int, int, int]:
    """(BLOCK_L, BLOCK_D, num_warps) for the fused backward: the whole row in one tile."""
    block_d = 1 << (max(max_dim, 1) - 1).bit_length()
    block_l = max(1, min(16, 2048 // block_d))
    return block_l, block_d, 4 if block_d >= 256 else 2


def triton_backward_update(
    layout: TBELayout,
    lt: LayoutTensors,
    weights: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor,
    step: torch.Tensor,
    segments: RowSegments,
    offsets_FB1: torch.Tensor,
    per_sample_weights_N: torch.Tensor | None,
    grad_out_BDt: torch.Tensor,
    batch: int,
    pooling: str,
    opt: OptimizerConfig,
    stochastic_rounding: bool,
    seed: int,
) -> None:
    """Launch the fused backward + optimizer over the unique rows of `segments` (in place)."""
    if not HAS_TRITON:
        raise RuntimeError("triton execution requested but triton is not installed")
    num_unique = segments.unique_rows_U.numel()
    if num_unique == 0:
        return
    grad_out_BDt = grad_out_BDt.contiguous()
    block_l, block_d, num_warps = backward_blocks(layout.max_dim)
    sr = stochastic_rounding and weights.dtype in SR_DROPPED_BITS
    psw = per_sample_weights_N if per_sample_weights_N is not None else segments.order_N
    tbe_backward_kernel[(num_unique,)](
        weights, state1, state2, step,
        lt.weight_offsets_T, lt.row_starts_T, lt.dims_T, lt.feature_table_map_F, lt.col_offsets_F,
        offsets_FB1, psw, segments.unique_rows_U, segments.segment_offsets_U1, segments.order_N,
        segments.bag_N, grad_out_BDt, grad_out_BDt.stride(0), batch, layout.total_rows,
        opt.lr, opt.eps, opt.beta1, opt.beta2, opt.weight_decay, seed,
        OPTIMIZER=OPTIMIZER_CODES[opt.kind], HAS_PSW=per_sample_weights_N is not None,
        MEAN=pooling == "mean", STOCHASTIC_ROUNDING=sr, DROPPED_BITS=SR_DROPPED_BITS.get(weights.dtype, 16),
        BLOCK_L=block_l, BLOCK_D=block_d, num_warps=num_warps,
    )
