"""Fused table-batched embedding backward + optimizer update in Triton, with no dense gradient.

Two stages. `dedupe_rows` (torch ops, no host sync) gives every lookup a global row id (table row start +
id), sorts them once (stable) and cuts the sorted list into one segment per unique row: segment u spans
sorted positions [seg_starts[u], seg_starts[u+1]), and entries past the last segment equal N, so the
kernel grid can be sized by N without learning U on the host.

`tbe_backward_kernel` is blocked: program p owns segments [p*BLOCK_U, (p+1)*BLOCK_U). Short segments (<=
LONG_SEGMENT lookups; nearly all of them under uniform ids) are reduced together, step l gathering the
l-th lookup of every segment as a [BLOCK_U, BLOCK_D] tile of grad_out; long (hot) segments are then
reduced one at a time, BLOCK_L lookups per step. Rows wider than BLOCK_D are tiled (NUM_D_TILES);
row-wise Adagrad then takes two passes (the row's mean g^2 first). Each unique row sums its gradient in
fp32, applies the optimizer to the row and its state and is written back once, so duplicates (within a
bag, across bags and features) need no atomics. fp16/bf16 rows are written with stochastic rounding when
asked. ALIGN (a power of two dividing every dim) lets the compiler vectorise row and grad_out accesses.
Legend (shape suffixes): N lookups, U segments of one program (BLOCK_U), L lookups of a long segment per
step (BLOCK_L), D columns of one tile (BLOCK_D), X either U or L.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from anyrec.kernels.layout import LayoutTensors, TBELayout, lookup_tables_N
from anyrec.kernels.optimizers import OptimizerConfig, OptimizerKind
from anyrec.kernels.triton_tbe import HAS_TRITON, tl, triton

# segments with more lookups than this take the one-row-at-a-time path (a switch tests can flip)
LONG_SEGMENT = 32

# kernel code of each optimizer rule (a constexpr of the kernel), in OptimizerKind's order: sgd 0,
# rowwise_adagrad 1, adagrad 2, adam 3
OPTIMIZER_CODES: dict[OptimizerKind, int] = {kind: code for code, kind in enumerate(OptimizerKind)}

# Compile options of the backward kernel (launcher and AOT gate alike): no implicit multiply-add
# fusion, so a product and a sum round separately, as in the torch path and FBGEMM's CPU kernels;
# where FBGEMM fuses (SGD's step, Adagrad's m += g * g) the kernel says tl.fma.
BACKWARD_COMPILE_OPTIONS: dict[str, bool] = {"enable_fp_fusion": False}

# fp32 mantissa bits dropped when rounding to the low-precision type (stochastic rounding noise)
SR_DROPPED_BITS: dict[torch.dtype, int] = {torch.bfloat16: 16, torch.float16: 13}


@dataclass(frozen=True)
class RowSegments:
    """Lookups sorted by global row, cut into one segment per unique row (sizes stay on device)."""

    sorted_rows_N: torch.Tensor  # int64 global row of each sorted lookup (total_rows: skipped id)
    segment_starts_N1: torch.Tensor  # int64 [N+1]: start of segment u in sorted order; N past the last
    order_N: torch.Tensor  # int64 lookup index, sorted by global row
    bag_N: torch.Tensor  # int64 bag (f*batch+b) of each lookup, in input order


def dedupe_rows(
    layout: TBELayout, lt: LayoutTensors, indices_N: torch.Tensor, offsets_FB1: torch.Tensor, batch: int
) -> RowSegments:
    """Sort lookups by global row id and segment them; out-of-range ids go to a trailing sentinel. One
    sort, no host sync (unlike `torch.unique_consecutive`, whose output size needs one)."""
    n = indices_N.numel()
    dev = indices_N.device
    bag_N, table_N = lookup_tables_N(lt, offsets_FB1, batch, n)
    ids_N = indices_N.long()
    ok_N = (ids_N >= 0) & (ids_N < lt.rows_T[table_N])
    grow_N = torch.where(ok_N, lt.row_starts_T[table_N] + ids_N, layout.total_rows)
    sorted_N, order_N = torch.sort(grow_N, stable=True)
    new_N = torch.ones(n, dtype=torch.bool, device=dev)
    torch.ne(sorted_N[1:], sorted_N[:-1], out=new_N[1:])
    segment_N = torch.cumsum(new_N, 0) - 1
    starts_N1 = torch.searchsorted(segment_N, torch.arange(n + 1, device=dev))
    return RowSegments(sorted_N, starts_N1, order_N, bag_N)


if HAS_TRITON:

    @triton.jit
    def stochastic_round(x, seed, offs, DROPPED_BITS: tl.constexpr):
        """Round fp32 `x` to a type keeping 23 - DROPPED_BITS mantissa bits, up with probability frac."""
        bits = x.to(tl.int32, bitcast=True)
        noise = (tl.randint(seed, offs) & ((1 << DROPPED_BITS) - 1)).to(tl.int32)
        bits = (bits + noise) & (-(1 << DROPPED_BITS))
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _lookup_grads(
        i_X, ok_X, dim_X, d_D, bag_N_ptr, col_offsets_F_ptr, offsets_FB1_ptr, psw_N_ptr, grad_out_ptr,
        grad_stride, batch, HAS_PSW: tl.constexpr, MEAN: tl.constexpr, ALIGN: tl.constexpr,
    ):
        """[X, BLOCK_D] fp32 grad_out rows of lookups i_X (their bags' columns d_D), times their scale."""
        bag_X = tl.load(bag_N_ptr + i_X, mask=ok_X, other=0)
        f_X = bag_X // batch
        b_X = bag_X % batch
        col_X = tl.load(col_offsets_F_ptr + f_X, mask=ok_X, other=0)
        scale_X = tl.where(ok_X, 1.0, 0.0)
        if HAS_PSW:
            scale_X = scale_X * tl.load(psw_N_ptr + i_X, mask=ok_X, other=0.0).to(tl.float32)
        if MEAN:
            lo_X = tl.load(offsets_FB1_ptr + bag_X, mask=ok_X, other=0)
            hi_X = tl.load(offsets_FB1_ptr + bag_X + 1, mask=ok_X, other=1)
            scale_X = tl.div_rn(scale_X, tl.maximum(hi_X - lo_X, 1).to(tl.float32))
        start_X = tl.multiple_of(b_X * grad_stride + col_X, ALIGN)
        ok_XD = ok_X[:, None] & (d_D[None, :] < tl.multiple_of(dim_X, ALIGN)[:, None])
        go_XD = tl.load(grad_out_ptr + start_X[:, None] + d_D[None, :], mask=ok_XD, other=0.0)
        return go_XD.to(tl.float32) * scale_X[:, None]

    @triton.jit
    def _segment_grads(
        start_U, cnt_U, lane_U, dim_U, n_steps, d_D, order_N_ptr, bag_N_ptr, col_offsets_F_ptr,
        offsets_FB1_ptr, psw_N_ptr, grad_out_ptr, grad_stride, batch,
        HAS_PSW: tl.constexpr, MEAN: tl.constexpr, ALIGN: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, LONG: tl.constexpr,
    ):
        """[BLOCK_R, BLOCK_D] summed gradient of each lane's segment over columns d_D. LONG: one segment
        (BLOCK_R == 1) reduced BLOCK_L lookups at a time; else every lane's segment advanced one lookup
        per step for `n_steps` steps."""
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        if LONG:
            start = tl.sum(start_U, axis=0)
            end = start + tl.sum(cnt_U, axis=0)
            dim_L = tl.zeros([BLOCK_L], dtype=tl.int64) + tl.sum(dim_U, axis=0)
            g_D = tl.zeros([BLOCK_D], dtype=tl.float32)
            for s in range(start, end, BLOCK_L):
                j_L = s + tl.arange(0, BLOCK_L)
                ok_L = j_L < end
                i_L = tl.load(order_N_ptr + j_L, mask=ok_L, other=0)
                g_D += tl.sum(_lookup_grads(i_L, ok_L, dim_L, d_D, bag_N_ptr, col_offsets_F_ptr,
                                            offsets_FB1_ptr, psw_N_ptr, grad_out_ptr, grad_stride, batch,
                                            HAS_PSW, MEAN, ALIGN), axis=0)
            acc += g_D[None, :]
        else:
            for l in range(0, n_steps):
                live_U = lane_U & (l < cnt_U)
                i_U = tl.load(order_N_ptr + start_U + l, mask=live_U, other=0)
                acc += _lookup_grads(i_U, live_U, dim_U, d_D, bag_N_ptr, col_offsets_F_ptr, offsets_FB1_ptr,
                                     psw_N_ptr, grad_out_ptr, grad_stride, batch, HAS_PSW, MEAN, ALIGN)
        return acc

    @triton.jit
    def _update_rows(
        weights_ptr, state1_ptr, state2_ptr, step_ptr, row_U, base_U, dim_U, start_U, cnt_U, lane_U,
        n_steps, order_N_ptr, bag_N_ptr, col_offsets_F_ptr, offsets_FB1_ptr, psw_N_ptr, grad_out_ptr,
        grad_stride, batch, lr, eps, beta1, beta2, weight_decay, seed,
        OPTIMIZER: tl.constexpr, HAS_PSW: tl.constexpr, MEAN: tl.constexpr,
        STOCHASTIC_ROUNDING: tl.constexpr, DROPPED_BITS: tl.constexpr, ALIGN: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr,
        LONG: tl.constexpr,
    ):
        """Sum the gradient of each lane's row, apply the optimizer, write row and state once."""
        TWO_PASS: tl.constexpr = OPTIMIZER == 1 and NUM_D_TILES > 1
        base_U = tl.multiple_of(base_U, ALIGN)
        dimf_U = tl.maximum(dim_U, 1).to(tl.float32)
        m_U = tl.zeros([BLOCK_R], dtype=tl.float32)
        if TWO_PASS:  # row-wise Adagrad over several tiles: the row's mean g^2 first
            ss_U = tl.zeros([BLOCK_R], dtype=tl.float32)
            for dt in tl.static_range(NUM_D_TILES):
                d_D = dt * BLOCK_D + tl.arange(0, BLOCK_D)
                ok_UD = lane_U[:, None] & (d_D[None, :] < dim_U[:, None])
                g_UD = _segment_grads(start_U, cnt_U, lane_U, dim_U, n_steps, d_D, order_N_ptr, bag_N_ptr,
                                      col_offsets_F_ptr, offsets_FB1_ptr, psw_N_ptr, grad_out_ptr,
                                      grad_stride, batch, HAS_PSW, MEAN, ALIGN, BLOCK_R, BLOCK_L, BLOCK_D,
                                      LONG)
                if weight_decay > 0:
                    w_UD = tl.load(weights_ptr + base_U[:, None] + d_D[None, :], mask=ok_UD, other=0.0)
                    g_UD = g_UD + weight_decay * w_UD.to(tl.float32)
                ss_U += tl.sum(g_UD * g_UD, axis=1)
            m_U = tl.load(state1_ptr + row_U, mask=lane_U, other=0.0) + tl.div_rn(ss_U, dimf_U)
            tl.store(state1_ptr + row_U, m_U, mask=lane_U)
        for dt in tl.static_range(NUM_D_TILES):
            d_D = dt * BLOCK_D + tl.arange(0, BLOCK_D)
            ok_UD = lane_U[:, None] & (d_D[None, :] < tl.multiple_of(dim_U, ALIGN)[:, None])
            addr_UD = base_U[:, None] + d_D[None, :]
            g_UD = _segment_grads(start_U, cnt_U, lane_U, dim_U, n_steps, d_D, order_N_ptr, bag_N_ptr,
                                  col_offsets_F_ptr, offsets_FB1_ptr, psw_N_ptr, grad_out_ptr, grad_stride,
                                  batch, HAS_PSW, MEAN, ALIGN, BLOCK_R, BLOCK_L, BLOCK_D, LONG)
            w_UD = tl.load(weights_ptr + addr_UD, mask=ok_UD, other=0.0).to(tl.float32)
            if OPTIMIZER != 3:  # L2 on the gradient; Adam's weight decay is decoupled, below
                if weight_decay > 0:
                    g_UD = g_UD + weight_decay * w_UD
            if OPTIMIZER == 0:  # FBGEMM's rounding (`anyrec.kernels.optimizers`): one fma
                w_UD = tl.fma(g_UD, -lr, w_UD)
            elif OPTIMIZER == 1:
                if not TWO_PASS:
                    m_U = tl.load(state1_ptr + row_U, mask=lane_U, other=0.0)
                    m_U += tl.div_rn(tl.sum(g_UD * g_UD, axis=1), dimf_U)
                    tl.store(state1_ptr + row_U, m_U, mask=lane_U)
                # FBGEMM's order of operations; IEEE sqrt and division (tl.sqrt and / are approximate
                # on GPUs), as FBGEMM's sqrtf and / are
                w_UD = w_UD - g_UD * tl.div_rn(lr + tl.zeros_like(m_U), tl.sqrt_rn(m_U) + eps)[:, None]
            elif OPTIMIZER == 2:
                # FBGEMM's CPU rounding (`anyrec.kernels.optimizers`): fma for m, the step in fp64
                m_UD = tl.fma(g_UD, g_UD, tl.load(state1_ptr + addr_UD, mask=ok_UD, other=0.0))
                tl.store(state1_ptr + addr_UD, m_UD, mask=ok_UD)
                den_UD = tl.sqrt(m_UD.to(tl.float64)) + (eps + tl.zeros_like(m_UD)).to(tl.float64)
                w_UD = (w_UD.to(tl.float64) - (lr * g_UD).to(tl.float64) / den_UD).to(tl.float32)
            else:
                m1_UD = beta1 * tl.load(state1_ptr + addr_UD, mask=ok_UD, other=0.0) + (1 - beta1) * g_UD
                m2_UD = tl.load(state2_ptr + addr_UD, mask=ok_UD, other=0.0)
                m2_UD = beta2 * m2_UD + (1 - beta2) * g_UD * g_UD
                tl.store(state1_ptr + addr_UD, m1_UD, mask=ok_UD)
                tl.store(state2_ptr + addr_UD, m2_UD, mask=ok_UD)
                step = tl.load(step_ptr)
                bc1 = 1 - tl.exp(step * tl.log(beta1))
                bc2 = 1 - tl.exp(step * tl.log(beta2))
                step_UD = tl.div_rn(tl.div_rn(m1_UD, bc1 + tl.zeros_like(m1_UD)),
                                    tl.sqrt_rn(tl.div_rn(m2_UD, bc2 + tl.zeros_like(m2_UD))) + eps)
                w_UD = w_UD - lr * (step_UD + weight_decay * w_UD)
            if STOCHASTIC_ROUNDING:
                offs_UD = row_U[:, None] * (BLOCK_D * NUM_D_TILES) + d_D[None, :]
                w_UD = stochastic_round(w_UD, seed, offs_UD, DROPPED_BITS)
            tl.store(weights_ptr + addr_UD, w_UD.to(weights_ptr.dtype.element_ty), mask=ok_UD)

    @triton.jit
    def tbe_backward_kernel(
        weights_ptr,  # flat weights (updated in place)
        state1_ptr,  # rowwise: [total_rows] fp32; adagrad/adam: flat like weights (fp32)
        state2_ptr,  # adam second moment, flat like weights (fp32)
        step_ptr,  # fp32 scalar: adam step number after this update
        weight_offsets_T_ptr, row_starts_T_ptr, dims_T_ptr, feature_table_map_F_ptr, col_offsets_F_ptr,
        offsets_FB1_ptr, psw_N_ptr, sorted_rows_N_ptr, segment_starts_N1_ptr, order_N_ptr, bag_N_ptr,
        grad_out_ptr,  # [batch, grad_stride]
        grad_stride, batch, num_lookups, total_rows, lr, eps, beta1, beta2, weight_decay, seed,
        OPTIMIZER: tl.constexpr, HAS_PSW: tl.constexpr, MEAN: tl.constexpr, STOCHASTIC_ROUNDING: tl.constexpr,
        DROPPED_BITS: tl.constexpr, ALIGN: tl.constexpr, LONG_SEGMENT: tl.constexpr, BLOCK_U: tl.constexpr,
        BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D_TILES: tl.constexpr,
    ):
        u_U = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
        in_U = u_U < num_lookups
        start_U = tl.load(segment_starts_N1_ptr + u_U, mask=in_U, other=num_lookups)
        cnt_U = tl.load(segment_starts_N1_ptr + u_U + 1, mask=in_U, other=num_lookups) - start_U
        row_U = tl.load(sorted_rows_N_ptr + start_U, mask=cnt_U > 0, other=total_rows)
        live_U = (cnt_U > 0) & (row_U < total_rows)
        first_U = tl.load(order_N_ptr + start_U, mask=live_U, other=0)
        t_U = tl.load(feature_table_map_F_ptr + tl.load(bag_N_ptr + first_U, mask=live_U, other=0) // batch,
                      mask=live_U, other=0)
        dim_U = tl.load(dims_T_ptr + t_U, mask=live_U, other=0)
        local_U = row_U - tl.load(row_starts_T_ptr + t_U, mask=live_U, other=0)
        base_U = tl.load(weight_offsets_T_ptr + t_U, mask=live_U, other=0)
        base_U += tl.where(live_U, local_U, 0) * dim_U
        short_U = live_U & (cnt_U <= LONG_SEGMENT)
        n_short = tl.max(tl.where(short_U, cnt_U, 0), axis=0)
        if n_short > 0:
            _update_rows(weights_ptr, state1_ptr, state2_ptr, step_ptr, row_U, base_U, dim_U, start_U, cnt_U,
                         short_U, n_short, order_N_ptr, bag_N_ptr, col_offsets_F_ptr, offsets_FB1_ptr,
                         psw_N_ptr, grad_out_ptr, grad_stride, batch, lr, eps, beta1, beta2, weight_decay,
                         seed, OPTIMIZER, HAS_PSW, MEAN, STOCHASTIC_ROUNDING, DROPPED_BITS, ALIGN,
                         BLOCK_U, BLOCK_L, BLOCK_D, NUM_D_TILES, False)
        long_U = live_U & (cnt_U > LONG_SEGMENT)
        if tl.sum(long_U.to(tl.int32), axis=0) > 0:  # hot rows: one at a time, BLOCK_L lookups per step
            lane_U = tl.arange(0, BLOCK_U)
            one_1 = tl.zeros([1], dtype=tl.int64)
            for k in range(0, BLOCK_U):
                sel_U = long_U & (lane_U == k)
                if tl.sum(sel_U.to(tl.int32), axis=0) > 0:
                    _update_rows(weights_ptr, state1_ptr, state2_ptr, step_ptr,
                                 one_1 + tl.sum(tl.where(sel_U, row_U, 0), axis=0),
                                 one_1 + tl.sum(tl.where(sel_U, base_U, 0), axis=0),
                                 one_1 + tl.sum(tl.where(sel_U, dim_U, 0), axis=0),
                                 one_1 + tl.sum(tl.where(sel_U, start_U, 0), axis=0),
                                 one_1 + tl.sum(tl.where(sel_U, cnt_U, 0), axis=0),
                                 one_1 == 0, 0, order_N_ptr, bag_N_ptr, col_offsets_F_ptr, offsets_FB1_ptr,
                                 psw_N_ptr, grad_out_ptr, grad_stride, batch, lr, eps, beta1, beta2,
                                 weight_decay, seed, OPTIMIZER, HAS_PSW, MEAN, STOCHASTIC_ROUNDING,
                                 DROPPED_BITS, ALIGN, 1, BLOCK_L, BLOCK_D, NUM_D_TILES, True)


def backward_blocks(max_dim: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_U, BLOCK_L, BLOCK_D, NUM_D_TILES, num_warps): ~1K fp32 gradient accumulators a program. sm_90
    ptxas, row-wise Adagrad, D=128: 8 rows x 128 with 4 warps takes 168 registers (12 warps an SM); with 8
    warps 112 (18 warps an SM); 16 rows with 8 warps 172. D=512 (two 256-wide tiles): 4 rows, 8 warps, 110
    registers and no spills. See `python -m anyrec.kernels.aot`."""
    block_d = min(256, 1 << (max(max_dim, 1) - 1).bit_length())
    block_u = max(1, min(32, 1024 // block_d))
    block_l = max(1, min(8, 1024 // block_d))
    num_warps = 8 if block_u * block_d >= 1024 else 4
    return block_u, block_l, block_d, -(-max(max_dim, 1) // block_d), num_warps


def triton_backward_update(
    layout: TBELayout, lt: LayoutTensors, weights: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor,
    step: torch.Tensor, segments: RowSegments, offsets_FB1: torch.Tensor,
    per_sample_weights_N: torch.Tensor | None, grad_out_BDt: torch.Tensor, batch: int, pooling: str,
    opt: OptimizerConfig, stochastic_rounding: bool, seed: int,
) -> None:
    """Launch the fused backward + optimizer over the segments of `segments` (in place, no sync)."""
    n = segments.order_N.numel()
    if n == 0:
        return
    grad_out_BDt = grad_out_BDt.contiguous()
    block_u, block_l, block_d, d_tiles, num_warps = backward_blocks(layout.max_dim)
    sr = stochastic_rounding and weights.dtype in SR_DROPPED_BITS
    psw = per_sample_weights_N if per_sample_weights_N is not None else segments.order_N
    tbe_backward_kernel[(triton.cdiv(n, block_u),)](
        weights, state1, state2, step,
        lt.weight_offsets_T, lt.row_starts_T, lt.dims_T, lt.feature_table_map_F, lt.col_offsets_F,
        offsets_FB1, psw, segments.sorted_rows_N, segments.segment_starts_N1, segments.order_N,
        segments.bag_N, grad_out_BDt, grad_out_BDt.stride(0), batch, n, layout.total_rows,
        opt.lr, opt.eps, opt.beta1, opt.beta2, opt.weight_decay, seed,
        OPTIMIZER=OPTIMIZER_CODES[opt.kind], HAS_PSW=per_sample_weights_N is not None,
        MEAN=pooling == "mean", STOCHASTIC_ROUNDING=sr, DROPPED_BITS=SR_DROPPED_BITS.get(weights.dtype, 16),
        ALIGN=layout.dim_alignment, LONG_SEGMENT=LONG_SEGMENT,
        BLOCK_U=block_u, BLOCK_L=block_l, BLOCK_D=block_d, NUM_D_TILES=d_tiles, num_warps=num_warps,
        **BACKWARD_COMPILE_OPTIONS,
    )
