"""Triton DCNv2 cross-layer epilogue: out = x0 * (y + b) + x, with y = U (V x) left to cuBLAS/hipBLASLt.

The forward is one elementwise pass over [B, N] tiles (fp32 math, each operand in its own dtype, as
torch's type promotion would combine them). The backward writes dx0 = g (y + b) and dy = g x0 in one pass
and reduces db = sum_B g x0 deterministically: a program owns a column tile and one of R row ranges,
writes its fp32 partial sum, and the R partials are summed once (no atomics). dx = g needs no kernel.
The torch oracle is `anyrec.models.interaction.LowRankCrossNet`; kernels exist only where triton imported.
Legend (shape suffixes): B rows (samples), N features of the cross net, R row splits of the backward.
"""

from __future__ import annotations

import torch

from anyrec.kernels._triton import HAS_TRITON, tl, triton

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Backward programs to aim for (a few per SM on the largest GPUs; more only adds partial sums).
_BWD_PROGRAMS = 1024


def epilogue_blocks(num_features: int) -> tuple[int, int, int]:
    """(BLOCK_B, BLOCK_N, num_warps): 2K-element tiles over 8 warps, 128 columns wide where N allows.
    8 elements a thread: at 32 (4K tiles, 4 warps) the backward spills on sm_90 (see aot.py)."""
    block_n = max(16, min(128, 1 << (max(num_features, 1) - 1).bit_length()))
    return 2048 // block_n, block_n, 8


def row_splits(batch: int, num_features: int) -> int:
    """R, the row ranges of the backward: enough programs to fill the GPU, never an empty range."""
    block_b, block_n, _ = epilogue_blocks(num_features)
    col_tiles = -(-num_features // block_n)
    return max(1, min(-(-batch // block_b), _BWD_PROGRAMS // col_tiles))


if HAS_TRITON:

    @triton.jit
    def cross_epilogue_fwd_kernel(
        x0_ptr,  # [batch, n] cross-net input
        y_ptr,  # [batch, n] U (V x), no bias
        b_ptr,  # [n] bias of U
        x_ptr,  # [batch, n] this layer's input
        out_ptr,  # [batch, n]
        batch, n, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        rows_B = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
        cols_N = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok_N = cols_N < n
        ok_BN = (rows_B[:, None] < batch) & col_ok_N[None, :]
        off_BN = rows_B[:, None] * n + cols_N[None, :]
        x0_BN = tl.load(x0_ptr + off_BN, mask=ok_BN, other=0.0).to(tl.float32)
        y_BN = tl.load(y_ptr + off_BN, mask=ok_BN, other=0.0).to(tl.float32)
        x_BN = tl.load(x_ptr + off_BN, mask=ok_BN, other=0.0).to(tl.float32)
        b_N = tl.load(b_ptr + cols_N, mask=col_ok_N, other=0.0).to(tl.float32)
        out_BN = x0_BN * (y_BN + b_N[None, :]) + x_BN
        tl.store(out_ptr + off_BN, out_BN.to(out_ptr.dtype.element_ty), mask=ok_BN)

    @triton.jit
    def cross_epilogue_bwd_kernel(
        grad_out_ptr,  # [batch, n] gradient of out
        x0_ptr,  # [batch, n]
        y_ptr,  # [batch, n]
        b_ptr,  # [n]
        grad_x0_ptr,  # [batch, n] out: g (y + b)
        grad_y_ptr,  # [batch, n] out: g x0
        grad_b_partial_RN_ptr,  # [R, n] fp32 out: sum of g x0 over this program's rows
        batch, n,
        rows_per_split,  # a multiple of BLOCK_B
        BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        split = tl.program_id(1)
        cols_N = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok_N = cols_N < n
        b_N = tl.load(b_ptr + cols_N, mask=col_ok_N, other=0.0).to(tl.float32)
        db_N = tl.zeros([BLOCK_N], dtype=tl.float32)
        first = split * rows_per_split
        for r0 in range(first, tl.minimum(first + rows_per_split, batch), BLOCK_B):
            rows_B = (r0 + tl.arange(0, BLOCK_B)).to(tl.int64)
            ok_BN = (rows_B[:, None] < batch) & col_ok_N[None, :]
            off_BN = rows_B[:, None] * n + cols_N[None, :]
            g_BN = tl.load(grad_out_ptr + off_BN, mask=ok_BN, other=0.0).to(tl.float32)
            x0_BN = tl.load(x0_ptr + off_BN, mask=ok_BN, other=0.0).to(tl.float32)
            y_BN = tl.load(y_ptr + off_BN, mask=ok_BN, other=0.0).to(tl.float32)
            gx0_BN = g_BN * x0_BN
            tl.store(grad_x0_ptr + off_BN, (g_BN * (y_BN + b_N[None, :])).to(grad_x0_ptr.dtype.element_ty),
                     mask=ok_BN)
            tl.store(grad_y_ptr + off_BN, gx0_BN.to(grad_y_ptr.dtype.element_ty), mask=ok_BN)
            db_N += tl.sum(gx0_BN, axis=0)
        tl.store(grad_b_partial_RN_ptr + split * n + cols_N, db_N, mask=col_ok_N)


def _check(x0_BN: torch.Tensor, y_BN: torch.Tensor, b_N: torch.Tensor, x_BN: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("the triton cross-layer epilogue was requested but triton is not installed")
    shape = x0_BN.shape
    if x0_BN.dim() != 2 or y_BN.shape != shape or x_BN.shape != shape or b_N.shape != shape[1:]:
        raise ValueError(f"cross epilogue: x0 {tuple(x0_BN.shape)}, y {tuple(y_BN.shape)}, "
                         f"b {tuple(b_N.shape)}, x {tuple(x_BN.shape)} (want [B, N] x3 and [N])")
    bad = [t.dtype for t in (x0_BN, y_BN, b_N, x_BN) if t.dtype not in _DTYPES]
    if bad:
        raise ValueError(f"cross epilogue takes fp32, bf16 or fp16 tensors, got {bad}")


class _CrossEpilogue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x0_BN, y_BN, b_N, x_BN):
        x0_BN, y_BN, b_N, x_BN = (t.contiguous() for t in (x0_BN, y_BN, b_N, x_BN))
        batch, n = x0_BN.shape
        dtype = torch.promote_types(torch.promote_types(x0_BN.dtype, y_BN.dtype),
                                    torch.promote_types(b_N.dtype, x_BN.dtype))
        out_BN = torch.empty(batch, n, dtype=dtype, device=x0_BN.device)
        block_b, block_n, num_warps = epilogue_blocks(n)
        if batch:
            grid = (triton.cdiv(batch, block_b), triton.cdiv(n, block_n))
            cross_epilogue_fwd_kernel[grid](x0_BN, y_BN, b_N, x_BN, out_BN, batch, n,
                                            BLOCK_B=block_b, BLOCK_N=block_n, num_warps=num_warps)
        ctx.save_for_backward(x0_BN, y_BN, b_N)
        ctx.x_dtype = x_BN.dtype
        return out_BN

    @staticmethod
    def backward(ctx, grad_out_BN):
        x0_BN, y_BN, b_N = ctx.saved_tensors
        grad_out_BN = grad_out_BN.contiguous()
        batch, n = x0_BN.shape
        grad_x0_BN = torch.empty_like(x0_BN)
        grad_y_BN = torch.empty_like(y_BN)
        block_b, block_n, num_warps = epilogue_blocks(n)
        splits = row_splits(batch, n)
        rows_per_split = triton.cdiv(triton.cdiv(batch, splits), block_b) * block_b
        partial_RN = torch.empty(splits, n, dtype=torch.float32, device=x0_BN.device)
        if batch:
            grid = (triton.cdiv(n, block_n), splits)
            cross_epilogue_bwd_kernel[grid](grad_out_BN, x0_BN, y_BN, b_N, grad_x0_BN, grad_y_BN, partial_RN,
                                            batch, n, rows_per_split,
                                            BLOCK_B=block_b, BLOCK_N=block_n, num_warps=num_warps)
        else:
            partial_RN.zero_()
        grad_b_N = partial_RN.sum(0).to(b_N.dtype)
        return grad_x0_BN, grad_y_BN, grad_b_N, grad_out_BN.to(ctx.x_dtype)


def cross_epilogue(x0_BN: torch.Tensor, y_BN: torch.Tensor, b_N: torch.Tensor,
                   x_BN: torch.Tensor) -> torch.Tensor:
    """x0 * (y + b) + x in one pass, differentiable in all four; fp32 math, output in the promoted dtype."""
    _check(x0_BN, y_BN, b_N, x_BN)
    return _CrossEpilogue.apply(x0_BN, y_BN, b_N, x_BN)
