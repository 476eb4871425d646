"""Unpooled (sequence) lookups of the table-batched embedding: one output row per id, and the fused update
from each row's gradient, in torch and in Triton.

An EmbeddingCollection looks up every position of a sequence and pools nothing: the output is [N, D], row n
the row that id n reads (zeros for an id outside its table), in the KJT's value order; its gradient is
[N, D] too. Every table of the batch has the same dim D (as FBGEMM's PoolingMode.NONE), so table t's row r
is row row_starts[t] + r of the flat buffer viewed as [total_rows, D].

The Triton path runs the pooled kernels (`triton_tbe`, `triton_tbe_backward`) on a per-lookup view of the
batch: each lookup its own one-id bag of a batch of one, its "feature" mapped to its table and writing
output columns [n*D, (n+1)*D) of a [1, N*D] output. The kernels' duplicate merging, optimizer rules and
rounding are the pooled ones (no new kernel source; batch 1 is a specialisation of its own).
Legend (shape suffixes): N lookups, U unique rows, D embedding dim.
"""

from __future__ import annotations

import dataclasses

import torch

from anyrec.kernels import triton_tbe, triton_tbe_backward
from anyrec.kernels.layout import LayoutTensors, TBELayout, lookup_tables_N
from anyrec.kernels.optimizers import OptimizerConfig
from anyrec.kernels.torch_tbe import apply_rows


def check_sequence_layout(layout: TBELayout) -> int:
    """The one embedding dim of an unpooled table batch; ValueError when its tables' dims differ."""
    dims = sorted(set(layout.dims))
    if len(dims) != 1:
        raise ValueError(f"unpooled lookups need one embedding dim for every table of a batch, got {dims}")
    return dims[0]


def _rows_N(layout: TBELayout, lt: LayoutTensors, indices_N: torch.Tensor, offsets_FB1: torch.Tensor,
            batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per lookup: its table, its row of the [total_rows, D] buffer (0 when out of range) and whether its id
    is in its table."""
    _, table_N = lookup_tables_N(lt, offsets_FB1, batch, indices_N.numel())
    ids_N = indices_N.long()
    ok_N = (ids_N >= 0) & (ids_N < lt.rows_T[table_N])
    return table_N, lt.row_starts_T[table_N] + torch.where(ok_N, ids_N, 0), ok_N


def torch_sequence_forward(
    layout: TBELayout, lt: LayoutTensors, weights: torch.Tensor, indices_N: torch.Tensor,
    offsets_FB1: torch.Tensor, batch: int, output_dtype: torch.dtype,
) -> torch.Tensor:
    """[N, D] rows in `output_dtype`: one gather of whole rows (no per-element addresses)."""
    D = check_sequence_layout(layout)
    _, row_N, ok_N = _rows_N(layout, lt, indices_N, offsets_FB1, batch)
    out_ND = weights.view(layout.total_rows, D).index_select(0, row_N).to(output_dtype)
    return out_ND.masked_fill_(~ok_N[:, None], 0)


def torch_sequence_backward_update(
    layout: TBELayout, lt: LayoutTensors, weights: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor,
    step: torch.Tensor, indices_N: torch.Tensor, offsets_FB1: torch.Tensor, grad_out_ND: torch.Tensor,
    batch: int, opt: OptimizerConfig, stochastic_rounding: bool,
) -> None:
    """Sum each looked-up row's gradient once (duplicates merged) and apply `opt` to it, in place."""
    D = check_sequence_layout(layout)
    _, row_N, ok_N = _rows_N(layout, lt, indices_N, offsets_FB1, batch)
    # out-of-range lookups go to a sentinel row past the last, dropped after the merge
    rows_U, inv_N = torch.unique(torch.where(ok_N, row_N, layout.total_rows), return_inverse=True)
    g_UD = torch.zeros(rows_U.numel(), D, dtype=torch.float32, device=weights.device)
    g_UD.index_add_(0, inv_N, grad_out_ND.reshape(-1, D).float())
    if rows_U.numel() and int(rows_U[-1]) == layout.total_rows:
        rows_U, g_UD = rows_U[:-1], g_UD[:-1]
    addr_UD = rows_U[:, None] * D + torch.arange(D, device=weights.device)
    apply_rows(weights, state1, state2, step, rows_U, addr_UD, g_UD, opt, stochastic_rounding)


def per_lookup_view(layout: TBELayout, lt: LayoutTensors, offsets_FB1: torch.Tensor, batch: int, n: int
                    ) -> tuple[LayoutTensors, torch.Tensor]:
    """The batch as N one-id bags of a batch of one: layout tensors whose feature i is lookup i (its table,
    output columns i*D) and the offsets 0..N."""
    D = check_sequence_layout(layout)
    _, table_N = lookup_tables_N(lt, offsets_FB1, batch, n)
    ar_N1 = torch.arange(n + 1, device=offsets_FB1.device)
    view = dataclasses.replace(lt, feature_table_map_F=table_N, col_offsets_F=ar_N1[:-1] * D)
    return view, ar_N1


def triton_sequence_forward(
    layout: TBELayout, lt: LayoutTensors, weights: torch.Tensor, indices_N: torch.Tensor,
    offsets_FB1: torch.Tensor, batch: int, output_dtype: torch.dtype,
) -> torch.Tensor:
    """[N, D] rows in `output_dtype`, by the pooled forward kernel on the per-lookup view."""
    D = check_sequence_layout(layout)
    n = indices_N.numel()
    out_1ND = torch.empty(1, n * D, dtype=output_dtype, device=weights.device)
    if n == 0:
        return out_1ND.view(0, D)
    view, offsets_N1 = per_lookup_view(layout, lt, offsets_FB1, batch, n)
    block_b, block_d, unroll, num_warps = triton_tbe.forward_blocks(D)
    grid = (triton_tbe.triton.cdiv(n, block_b), triton_tbe.triton.cdiv(D, block_d))
    triton_tbe.tbe_forward_kernel[grid](
        weights, view.weight_offsets_T, view.rows_T, view.dims_T, view.feature_table_map_F,
        view.col_offsets_F, indices_N, offsets_N1, indices_N, out_1ND, 1, n, out_1ND.stride(0),
        HAS_PSW=False, MEAN=False, ALIGN=layout.dim_alignment, UNROLL=unroll, BLOCK_B=block_b,
        BLOCK_D=block_d, num_warps=num_warps,
    )
    return out_1ND.view(n, D)


def triton_sequence_backward_update(
    layout: TBELayout, lt: LayoutTensors, weights: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor,
    step: torch.Tensor, indices_N: torch.Tensor, offsets_FB1: torch.Tensor, grad_out_ND: torch.Tensor,
    batch: int, opt: OptimizerConfig, stochastic_rounding: bool, seed: int,
) -> None:
    """The pooled fused backward kernel on the per-lookup view: row n of the gradient is lookup n's."""
    n = indices_N.numel()
    if n == 0:
        return
    view, offsets_N1 = per_lookup_view(layout, lt, offsets_FB1, batch, n)
    segments = triton_tbe_backward.dedupe_rows(layout, view, indices_N, offsets_N1, 1)
    triton_tbe_backward.triton_backward_update(
        layout, view, weights, state1, state2, step, segments, offsets_N1, None,
        grad_out_ND.reshape(1, -1), 1, "sum", opt, stochastic_rounding, seed)
