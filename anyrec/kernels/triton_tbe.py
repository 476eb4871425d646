"""Triton pooled lookup over many tables in one launch (table-batched embedding forward).

Legend (shape suffixes): B bags handled by one program (BLOCK_B), D columns of one tile (BLOCK_D), T
tables, F features, N lookups. Program (i, j) pools bags [i*BLOCK_B, (i+1)*BLOCK_B) (feature-major KJT
bags, f*batch+b) over columns [j*BLOCK_D, (j+1)*BLOCK_D): step l of its loop gathers the l-th id of every
bag at once, a [BLOCK_B, BLOCK_D] tile, so one-hot features load BLOCK_B rows in parallel and multi-hot
ones (bags of one feature are adjacent, so a program's bags share their pooling) stream their rows with
fp32 accumulation, UNROLL independent row loads in flight per step. ALIGN (a power of two dividing every
dim, hence every row start and output column) lets the compiler use vector loads and stores. Ids outside
a table are masked out (memory safety); reporting them is `layout.check_ids`' job.
Kernels exist only where triton imported (`HAS_TRITON`).
"""

from __future__ import annotations

import torch

from anyrec.kernels._triton import HAS_TRITON, tl, triton
from anyrec.kernels.layout import LayoutTensors, TBELayout


def forward_blocks(max_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_B, BLOCK_D, UNROLL, num_warps) for the forward: ~1K fp32 accumulators per program. ptxas (sm_90)
    spills heavily at 4K (BLOCK_B=32, D=128); at 1K it does not (`python -m anyrec.kernels.aot`). UNROLL row
    tiles in flight cover the gather latency of multi-hot bags; one-hot bags run a single step, so the unroll
    costs them only masked lanes."""
    block_d = min(128, 1 << (max(max_dim, 1) - 1).bit_length())
    block_b = max(1, min(64, 1024 // block_d))
    return block_b, block_d, 4, 4


if HAS_TRITON:

    @triton.jit
    def tbe_forward_kernel(
        weights_ptr,  # flat weights of all tables (fp32 / fp16 / bf16)
        weight_offsets_T_ptr,  # int64 element offset of each table
        rows_T_ptr,  # int64 rows of each table
        dims_T_ptr,  # int64 dim of each table
        feature_table_map_F_ptr,  # int64 table of each feature
        col_offsets_F_ptr,  # int64 first output column of each feature
        indices_N_ptr,  # int32 / int64 ids, local to their table
        offsets_FB1_ptr,  # int32 / int64 KJT offsets, F*batch+1 entries
        psw_N_ptr,  # per-sample weights (ignored unless HAS_PSW)
        out_ptr,  # [batch, out_stride] output
        batch, num_bags, out_stride, HAS_PSW: tl.constexpr, MEAN: tl.constexpr, ALIGN: tl.constexpr,
        UNROLL: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        pid_b = tl.program_id(0)
        pid_d = tl.program_id(1)
        bag_B = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        bag_ok_B = bag_B < num_bags
        f_B = bag_B // batch
        b_B = (bag_B % batch).to(tl.int64)
        t_B = tl.load(feature_table_map_F_ptr + f_B, mask=bag_ok_B, other=0)
        dim_B = tl.multiple_of(tl.load(dims_T_ptr + t_B, mask=bag_ok_B, other=0), ALIGN)
        rows_B = tl.load(rows_T_ptr + t_B, mask=bag_ok_B, other=0)
        woff_B = tl.load(weight_offsets_T_ptr + t_B, mask=bag_ok_B, other=0)
        col_B = tl.multiple_of(tl.load(col_offsets_F_ptr + f_B, mask=bag_ok_B, other=0), ALIGN)
        start_B = tl.load(offsets_FB1_ptr + bag_B, mask=bag_ok_B, other=0).to(tl.int64)
        end_B = tl.load(offsets_FB1_ptr + bag_B + 1, mask=bag_ok_B, other=0).to(tl.int64)
        len_B = end_B - start_B
        d_D = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok_BD = bag_ok_B[:, None] & (d_D[None, :] < dim_B[:, None])
        acc_BD = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
        max_len = tl.max(len_B, axis=0)
        for l0 in range(0, max_len, UNROLL):
            for k in tl.static_range(UNROLL):
                live_B = bag_ok_B & (l0 + k < len_B)
                id_B = tl.load(indices_N_ptr + start_B + l0 + k, mask=live_B, other=0).to(tl.int64)
                ok_B = live_B & (id_B >= 0) & (id_B < rows_B)
                row_B = tl.multiple_of(woff_B + tl.where(ok_B, id_B, 0) * dim_B, ALIGN)
                w_BD = tl.load(weights_ptr + row_B[:, None] + d_D[None, :], mask=ok_B[:, None] & col_ok_BD,
                               other=0.0).to(tl.float32)
                if HAS_PSW:
                    s_B = tl.load(psw_N_ptr + start_B + l0 + k, mask=live_B, other=0.0).to(tl.float32)
                    w_BD = w_BD * s_B[:, None]
                acc_BD += w_BD
        if MEAN:
            acc_BD = acc_BD / tl.maximum(len_B, 1).to(tl.float32)[:, None]
        out_B = tl.multiple_of(b_B * out_stride + col_B, ALIGN)
        out_ptr_BD = out_ptr + out_B[:, None] + d_D[None, :]
        tl.store(out_ptr_BD, acc_BD.to(out_ptr.dtype.element_ty), mask=col_ok_BD)


def triton_forward(
    layout: TBELayout, lt: LayoutTensors, weights: torch.Tensor, indices_N: torch.Tensor,
    offsets_FB1: torch.Tensor, per_sample_weights_N: torch.Tensor | None, batch: int, pooling: str,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """Launch the pooled forward: returns [batch, layout.output_dim] in `output_dtype`."""
    out = torch.empty(batch, layout.output_dim, dtype=output_dtype, device=weights.device)
    num_bags = batch * layout.num_features
    if num_bags == 0:
        return out
    block_b, block_d, unroll, num_warps = forward_blocks(layout.max_dim)
    grid = (triton.cdiv(num_bags, block_b), triton.cdiv(layout.max_dim, block_d))
    psw = per_sample_weights_N if per_sample_weights_N is not None else indices_N
    tbe_forward_kernel[grid](
        weights, lt.weight_offsets_T, lt.rows_T, lt.dims_T, lt.feature_table_map_F, lt.col_offsets_F,
        indices_N, offsets_FB1, psw, out, batch, num_bags, out.stride(0),
        HAS_PSW=per_sample_weights_N is not None, MEAN=pooling == "mean", ALIGN=layout.dim_alignment,
        UNROLL=unroll, BLOCK_B=block_b, BLOCK_D=block_d, num_warps=num_warps,
    )
    return out
