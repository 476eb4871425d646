"""Triton DLRM dot interaction: the Gram matrix's upper triangle and the dense passthrough in one kernel.

Output row b is [dense_b (D) | <x_i, x_j> for i < j, row-major (P)], the layout of
`anyrec.models.interaction.DotInteraction` (its torch code is the oracle). The forward loops over D tiles
of 16 accumulating a [BLOCK_B, n, n] fp32 Gram with batched `tl.dot` (tensor cores for bf16; exact fp32
FMA for fp32, as torch's bmm) and scatters the triangle into the output row. The backward rebuilds the
symmetric pair gradient S = Gd + Gd^T (Gd: the pair gradients in the upper triangle) and writes dX = S X
per D tile, plus the dense passthrough into row 0. Dense and sparse inputs are read in place (no stacking
copy). S is exact in the input dtype (each entry is one output gradient), so bf16 runs a bf16 x bf16 ->
fp32 dot. DOT_FP32 runs the dots on fp32 operands instead: for fp32 inputs, and under TRITON_INTERPRET=1,
whose tl.dot multiplies bf16 bit patterns (Triton 3.9); the result is the same, as products of bf16
values are exact in fp32. Kernels exist only where triton imported.
Legend (shape suffixes): B samples of one program (BLOCK_B), n = F + 1 stacked features (dense first,
padded to BLOCK_N), D columns of one tile (BLOCK_D), F sparse features, P = n (n - 1) / 2 pairs.
"""

from __future__ import annotations

import torch

from anyrec.kernels._triton import HAS_TRITON, interpreter_enabled, tl, triton

_DTYPES = (torch.float32, torch.bfloat16)


def interaction_blocks(num_rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_B, BLOCK_N, BLOCK_D, num_warps): ~2K fp32 Gram accumulators over 8 warps per program. tl.dot
    needs every dot dimension >= 16; 27 rows (DLRM on Criteo) pad to 32, so 2 samples a program; D streams in
    16-column tiles. At 4K accumulators or 64-column tiles ptxas spills on sm_90, at 32-column tiles on sm_100
    (fp32): the 3D tiles' 64-bit pointers cost as many registers as the data (see `python -m
    anyrec.kernels.aot`)."""
    block_n = max(16, 1 << (max(num_rows, 1) - 1).bit_length())
    block_b = max(1, min(16, 2048 // (block_n * block_n)))
    return block_b, block_n, 16, 8


if HAS_TRITON:

    @triton.jit
    def _load_rows(dense_ptr, sparse_ptr, b_B, r_N, d_D, batch, num_rows, dim):
        """The [BLOCK_B, BLOCK_N, BLOCK_D] tile of stacked features: row 0 dense, rows 1.. sparse."""
        ok_BND = ((b_B[:, None, None] < batch) & (r_N[None, :, None] < num_rows)
                  & (d_D[None, None, :] < dim))
        is_dense_N = r_N == 0
        dense_off_BND = b_B[:, None, None] * dim + d_D[None, None, :] + 0 * r_N[None, :, None]
        dense_BND = tl.load(dense_ptr + dense_off_BND, mask=ok_BND & is_dense_N[None, :, None], other=0.0)
        sparse_off_BND = ((b_B[:, None, None] * (num_rows - 1) + (r_N[None, :, None] - 1)) * dim
                          + d_D[None, None, :])
        sparse_BND = tl.load(sparse_ptr + sparse_off_BND, mask=ok_BND & ~is_dense_N[None, :, None], other=0.0)
        return dense_BND + sparse_BND, ok_BND

    @triton.jit
    def _pair_offsets(r_N, num_rows):
        """Output offset of pair (i, j) within the triangle (row-major, i < j) and its validity."""
        i_NN = r_N[:, None]
        j_NN = r_N[None, :]
        off_NN = i_NN * num_rows - (i_NN * (i_NN + 1)) // 2 + (j_NN - i_NN - 1)
        ok_NN = (i_NN < j_NN) & (j_NN < num_rows)
        return off_NN, ok_NN

    @triton.jit
    def dot_interaction_fwd_kernel(
        dense_BD_ptr,  # [batch, dim] dense features (fp32 / bf16)
        sparse_BFD_ptr,  # [batch, num_rows - 1, dim] pooled embeddings, same dtype
        out_ptr,  # [batch, dim + num_pairs] output, same dtype
        batch,
        num_rows,  # n = F + 1
        dim, out_stride, DOT_FP32: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b_B = (pid * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
        r_N = tl.arange(0, BLOCK_N)
        gram_BNN = tl.zeros([BLOCK_B, BLOCK_N, BLOCK_N], dtype=tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            d_D = d0 + tl.arange(0, BLOCK_D)
            x_BND, ok_BND = _load_rows(dense_BD_ptr, sparse_BFD_ptr, b_B, r_N, d_D, batch, num_rows, dim)
            if DOT_FP32:
                xf_BND = x_BND.to(tl.float32)
                gram_BNN = tl.dot(xf_BND, tl.permute(xf_BND, (0, 2, 1)), gram_BNN, input_precision="ieee")
            else:
                gram_BNN = tl.dot(x_BND, tl.permute(x_BND, (0, 2, 1)), gram_BNN)
            # the dense passthrough is row 0 of the tile just loaded
            dense_ok_BND = ok_BND & (r_N == 0)[None, :, None]
            tl.store(out_ptr + b_B[:, None, None] * out_stride + d_D[None, None, :] + 0 * r_N[None, :, None],
                     x_BND, mask=dense_ok_BND)
        off_NN, pair_ok_NN = _pair_offsets(r_N, num_rows)
        out_BNN = out_ptr + b_B[:, None, None] * out_stride + dim + off_NN[None, :, :]
        tl.store(out_BNN, gram_BNN.to(out_ptr.dtype.element_ty),
                 mask=(b_B[:, None, None] < batch) & pair_ok_NN[None, :, :])

    @triton.jit
    def dot_interaction_bwd_kernel(
        dense_BD_ptr,  # [batch, dim] forward input
        sparse_BFD_ptr,  # [batch, num_rows - 1, dim] forward input
        grad_out_ptr,  # [batch, dim + num_pairs] gradient of the output
        grad_dense_ptr,  # [batch, dim] out
        grad_sparse_ptr,  # [batch, num_rows - 1, dim] out
        batch, num_rows, dim, grad_stride, DOT_FP32: tl.constexpr, BLOCK_B: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b_B = (pid * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
        r_N = tl.arange(0, BLOCK_N)
        off_NN, pair_ok_NN = _pair_offsets(r_N, num_rows)
        gd_BNN = tl.load(grad_out_ptr + b_B[:, None, None] * grad_stride + dim + off_NN[None, :, :],
                         mask=(b_B[:, None, None] < batch) & pair_ok_NN[None, :, :], other=0.0)
        # S is symmetric with a zero diagonal; every entry is one output gradient, exact in its dtype
        s_BNN = gd_BNN + tl.permute(gd_BNN, (0, 2, 1))
        is_dense_N = r_N == 0
        for d0 in range(0, dim, BLOCK_D):
            d_D = d0 + tl.arange(0, BLOCK_D)
            x_BND, ok_BND = _load_rows(dense_BD_ptr, sparse_BFD_ptr, b_B, r_N, d_D, batch, num_rows, dim)
            if DOT_FP32:
                dx_BND = tl.dot(s_BNN.to(tl.float32), x_BND.to(tl.float32), input_precision="ieee")
            else:
                dx_BND = tl.dot(s_BNN.to(x_BND.dtype), x_BND)
            dense_ok_BND = ok_BND & is_dense_N[None, :, None]
            g_BND = tl.load(grad_out_ptr + b_B[:, None, None] * grad_stride + d_D[None, None, :]
                            + 0 * r_N[None, :, None], mask=dense_ok_BND, other=0.0)
            dx_BND = (dx_BND + g_BND.to(tl.float32)).to(grad_dense_ptr.dtype.element_ty)
            tl.store(grad_dense_ptr + b_B[:, None, None] * dim + d_D[None, None, :] + 0 * r_N[None, :, None],
                     dx_BND, mask=dense_ok_BND)
            sparse_off_BND = ((b_B[:, None, None] * (num_rows - 1) + (r_N[None, :, None] - 1)) * dim
                              + d_D[None, None, :])
            tl.store(grad_sparse_ptr + sparse_off_BND, dx_BND, mask=ok_BND & ~is_dense_N[None, :, None])


def _check(dense_BD: torch.Tensor, sparse_BFD: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("the triton dot interaction was requested but triton is not installed")
    if dense_BD.dtype != sparse_BFD.dtype or dense_BD.dtype not in _DTYPES:
        raise ValueError(f"triton dot interaction takes fp32 or bf16 inputs of one dtype, "
                         f"got {dense_BD.dtype} and {sparse_BFD.dtype}")
    if sparse_BFD.dim() != 3 or dense_BD.shape != (sparse_BFD.shape[0], sparse_BFD.shape[2]):
        raise ValueError(f"dot interaction: dense {tuple(dense_BD.shape)} does not match "
                         f"sparse {tuple(sparse_BFD.shape)} ([B, D] and [B, F, D])")


def _launch_args(dense_BD: torch.Tensor, sparse_BFD: torch.Tensor):
    batch, num_sparse, dim = sparse_BFD.shape
    num_rows = num_sparse + 1
    block_b, block_n, block_d, num_warps = interaction_blocks(num_rows)
    grid = (triton.cdiv(batch, block_b),)
    dot_fp32 = dense_BD.dtype == torch.float32 or interpreter_enabled()
    meta = {"DOT_FP32": dot_fp32, "BLOCK_B": block_b, "BLOCK_N": block_n,
            "BLOCK_D": block_d, "num_warps": num_warps}
    return batch, num_rows, dim, grid, meta


class _DotInteraction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dense_BD: torch.Tensor, sparse_BFD: torch.Tensor) -> torch.Tensor:
        dense_BD, sparse_BFD = dense_BD.contiguous(), sparse_BFD.contiguous()
        batch, num_rows, dim, grid, meta = _launch_args(dense_BD, sparse_BFD)
        out = torch.empty(batch, dim + num_rows * (num_rows - 1) // 2, dtype=dense_BD.dtype,
                          device=dense_BD.device)
        if batch:
            dot_interaction_fwd_kernel[grid](dense_BD, sparse_BFD, out, batch, num_rows, dim, out.stride(0),
                                             **meta)
        ctx.save_for_backward(dense_BD, sparse_BFD)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        dense_BD, sparse_BFD = ctx.saved_tensors
        grad_out = grad_out.to(dense_BD.dtype).contiguous()
        batch, num_rows, dim, grid, meta = _launch_args(dense_BD, sparse_BFD)
        grad_dense_BD = torch.empty_like(dense_BD)
        grad_sparse_BFD = torch.empty_like(sparse_BFD)
        if batch:
            dot_interaction_bwd_kernel[grid](dense_BD, sparse_BFD, grad_out, grad_dense_BD, grad_sparse_BFD,
                                             batch, num_rows, dim, grad_out.stride(0), **meta)
        return grad_dense_BD, grad_sparse_BFD


def dot_interaction(dense_BD: torch.Tensor, sparse_BFD: torch.Tensor) -> torch.Tensor:
    """[B, D] dense and [B, F, D] pooled embeddings (one dtype: fp32 or bf16) -> [B, D + P], differentiable
    in both inputs; the output and gradients are in the input dtype."""
    _check(dense_BD, sparse_BFD)
    return _DotInteraction.apply(dense_BD, sparse_BFD)
