"""Triton jagged HSTU attention, forward and backward: the semantics of `anyrec.kernels.hstu` (its torch
version is the oracle; its docstring states the mask and what it follows).

Forward: one program per (sequence, head, block of BLOCK_M rows) streams the key/value blocks its rows can
see (columns up to the block's last row; every column for blocks holding contextual rows), computes
silu(alpha q k^T) / max_len under the mask in fp32 and accumulates the masked scores times v in fp32 (the
scores cast to the input dtype first, as flash attention does: bf16 operands on tensor cores). Backward,
deterministic (no atomics): one kernel gives dq per row block over the same columns (recomputing the
scores and dP = dO v^T); another gives dk and dv per column block over the rows that see it (the
contextual rows, then the rows from the block on). DOT_FP32 runs the dots on fp32 operands: for fp32
inputs (IEEE, as torch), and under TRITON_INTERPRET=1, whose tl.dot multiplies bf16 bit patterns (Triton
3.9); bf16 scores are rounded to bf16 there too, so the interpreter computes what the GPU does. Sequences
are at most max_len long (checked), so the grid's max_len / BLOCK blocks cover every row. Kernels exist
only where triton imported.
Legend (shape suffixes): T tokens, H heads, Q query/key dim, V value dim, B sequences, B1 = B + 1,
M rows of one block (BLOCK_M), N columns of one block (BLOCK_N); DQ / DV the padded head dims.
"""

from __future__ import annotations

import math

import torch

from anyrec.kernels._triton import HAS_TRITON, interpreter_enabled, tl, triton
from anyrec.kernels.hstu import HstuAttentionFn, check_inputs

DTYPES = (torch.float32, torch.bfloat16)


def attention_blocks(dq: int, dv: int, fp32: bool, warp_size: int = 32,
                     interpret: bool = False) -> dict[str, tuple[int, int, int]]:
    """Per kernel ("fwd", "bwd_dq", "bwd_dkdv"): (BLOCK_M, BLOCK_N, num_warps); plus "dims": the padded head
    dims (BLOCK_DQ, BLOCK_DV, 0). tl.dot needs 16 in every dimension; the interpreter gets the smallest
    blocks (tests cross block edges with short sequences). On GPUs at dims 128 (the reference's), bf16 64-row
    tiles and fp32 (IEEE dots, no tensor cores) 32-row ones keep the fp32 accumulators in registers without
    spills on every AOT target (`python -m anyrec.kernels.aot`): the backward's dk/dv (and fp32 dq) take 8
    warps of 32 lanes on NVIDIA; 64-lane wavefronts (AMD) stay at 4, as 8 would halve each lane's VGPRs."""
    dims = (max(16, 1 << (dq - 1).bit_length()), max(16, 1 << (dv - 1).bit_length()), 0)
    if interpret:
        return {"fwd": (16, 16, 4), "bwd_dq": (16, 16, 4), "bwd_dkdv": (16, 16, 4), "dims": dims}
    wide = 8 if warp_size == 32 else 4
    if fp32:
        return {"fwd": (32, 32, 4), "bwd_dq": (32, 32, wide), "bwd_dkdv": (16, 32, wide), "dims": dims}
    return {"fwd": (64, 64, 4), "bwd_dq": (64, 64, 4), "bwd_dkdv": (32, 64, wide), "dims": dims}


if HAS_TRITON:

    @triton.jit
    def _position_ids(pos, num_contextual, max_id, HAS_TARGETS: tl.constexpr):
        """The mask's id of each position: contextual positions share 0, targets share max_id."""
        ids = tl.where(num_contextual > 0, tl.maximum(pos - num_contextual + 1, 0), pos)
        if HAS_TARGETS:
            ids = tl.minimum(ids, max_id)
        return ids

    @triton.jit
    def _valid(row, col, row_id, col_id, num_contextual, max_id, length):
        """Broadcast row/column positions and ids -> whether the row attends to the column."""
        ok = (row == col) | (row_id > col_id)
        ok = ok | ((num_contextual > 0) & (row_id == 0) & (col_id < max_id))
        return ok & (row < length) & (col < length)

    @triton.jit
    def _sequence(offsets_ptr, num_targets_ptr, seq, num_contextual, HAS_TARGETS: tl.constexpr):
        """(first token (int64), length, max_id) of sequence `seq`."""
        start = tl.load(offsets_ptr + seq).to(tl.int64)
        length = (tl.load(offsets_ptr + seq + 1) - start).to(tl.int32)
        max_id = length - tl.maximum(num_contextual - 1, 0)
        if HAS_TARGETS:
            max_id -= tl.load(num_targets_ptr + seq).to(tl.int32)
        return start, length, max_id

    @triton.jit
    def _dot(a, b, DOT_FP32: tl.constexpr):
        if DOT_FP32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _score_grad(dp, x, sig, scale):
        """The loss's gradient with respect to q.k, given dp, its gradient with respect to the score
        silu(x) / max_len (x = alpha q.k, sig = sigmoid(x)); `scale` is alpha / max_len."""
        return dp * sig * (1.0 + x * (1.0 - sig)) * scale

    @triton.jit
    def hstu_fwd_kernel(
        q_ptr, k_ptr, v_ptr,  # [T, H, dq], [T, H, dq], [T, H, dv] (fp32 / bf16; last dim contiguous)
        out_ptr,  # [T, H, dv] out, same dtype
        offsets_ptr,  # [B + 1] int64
        num_targets_ptr,  # [B] int (read only when HAS_TARGETS)
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        num_heads, dq, dv, num_contextual, alpha, inv_max_len,
        HAS_TARGETS: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        seq = tl.program_id(0) // num_heads
        head = tl.program_id(0) % num_heads
        m0 = tl.program_id(1) * BLOCK_M
        start, length, max_id = _sequence(offsets_ptr, num_targets_ptr, seq, num_contextual, HAS_TARGETS)
        if m0 >= length:
            return
        # the sequence's and head's first element: one 64-bit scalar each, 32-bit offsets within the sequence
        q_ptr += start * stride_qt + head * stride_qh
        k_ptr += start * stride_kt + head * stride_kh
        v_ptr += start * stride_vt + head * stride_vh
        out_ptr += start * stride_ot + head * stride_oh
        rows_M = m0 + tl.arange(0, BLOCK_M)
        row_ids_M = _position_ids(rows_M, num_contextual, max_id, HAS_TARGETS)
        dq_Q = tl.arange(0, BLOCK_DQ)
        dv_V = tl.arange(0, BLOCK_DV)
        q_MQ = tl.load(q_ptr + rows_M[:, None] * stride_qt + dq_Q[None, :],
                       mask=(rows_M[:, None] < length) & (dq_Q[None, :] < dq), other=0.0)
        acc_MV = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        # causal columns, and every column for the contextual rows
        hi = tl.where(m0 < num_contextual, length, tl.minimum(length, m0 + BLOCK_M))
        for n0 in range(0, hi, BLOCK_N):
            cols_N = n0 + tl.arange(0, BLOCK_N)
            col_ids_N = _position_ids(cols_N, num_contextual, max_id, HAS_TARGETS)
            k_NQ = tl.load(k_ptr + cols_N[:, None] * stride_kt + dq_Q[None, :],
                           mask=(cols_N[:, None] < length) & (dq_Q[None, :] < dq), other=0.0)
            v_NV = tl.load(v_ptr + cols_N[:, None] * stride_vt + dv_V[None, :],
                           mask=(cols_N[:, None] < length) & (dv_V[None, :] < dv), other=0.0)
            x_MN = _dot(q_MQ, tl.trans(k_NQ), DOT_FP32) * alpha
            s_MN = x_MN * tl.sigmoid(x_MN) * inv_max_len
            ok_MN = _valid(rows_M[:, None], cols_N[None, :], row_ids_M[:, None], col_ids_N[None, :],
                           num_contextual, max_id, length)
            s_MN = tl.where(ok_MN, s_MN, 0.0).to(v_NV.dtype)
            acc_MV = acc_MV + _dot(s_MN, v_NV, DOT_FP32)
        tl.store(out_ptr + rows_M[:, None] * stride_ot + dv_V[None, :],
                 acc_MV.to(out_ptr.dtype.element_ty), mask=(rows_M[:, None] < length) & (dv_V[None, :] < dv))

    @triton.jit
    def hstu_bwd_dq_kernel(
        q_ptr, k_ptr, v_ptr,  # forward inputs
        grad_out_ptr,  # [T, H, dv] gradient of out, contiguous
        grad_q_ptr,  # [T, H, dq] out, contiguous
        offsets_ptr, num_targets_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        num_heads, dq, dv, num_contextual, alpha, inv_max_len,
        HAS_TARGETS: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        seq = tl.program_id(0) // num_heads
        head = tl.program_id(0) % num_heads
        m0 = tl.program_id(1) * BLOCK_M
        start, length, max_id = _sequence(offsets_ptr, num_targets_ptr, seq, num_contextual, HAS_TARGETS)
        if m0 >= length:
            return
        q_ptr += start * stride_qt + head * stride_qh
        k_ptr += start * stride_kt + head * stride_kh
        v_ptr += start * stride_vt + head * stride_vh
        grad_out_ptr += (start * num_heads + head) * dv
        grad_q_ptr += (start * num_heads + head) * dq
        rows_M = m0 + tl.arange(0, BLOCK_M)
        row_ids_M = _position_ids(rows_M, num_contextual, max_id, HAS_TARGETS)
        dq_Q = tl.arange(0, BLOCK_DQ)
        dv_V = tl.arange(0, BLOCK_DV)
        row_ok_M = rows_M < length
        q_MQ = tl.load(q_ptr + rows_M[:, None] * stride_qt + dq_Q[None, :],
                       mask=row_ok_M[:, None] & (dq_Q[None, :] < dq), other=0.0)
        do_MV = tl.load(grad_out_ptr + rows_M[:, None] * (num_heads * dv) + dv_V[None, :],
                        mask=row_ok_M[:, None] & (dv_V[None, :] < dv), other=0.0)
        dq_MQ = tl.zeros([BLOCK_M, BLOCK_DQ], dtype=tl.float32)
        hi = tl.where(m0 < num_contextual, length, tl.minimum(length, m0 + BLOCK_M))
        for n0 in range(0, hi, BLOCK_N):
            cols_N = n0 + tl.arange(0, BLOCK_N)
            col_ids_N = _position_ids(cols_N, num_contextual, max_id, HAS_TARGETS)
            k_NQ = tl.load(k_ptr + cols_N[:, None] * stride_kt + dq_Q[None, :],
                           mask=(cols_N[:, None] < length) & (dq_Q[None, :] < dq), other=0.0)
            v_NV = tl.load(v_ptr + cols_N[:, None] * stride_vt + dv_V[None, :],
                           mask=(cols_N[:, None] < length) & (dv_V[None, :] < dv), other=0.0)
            x_MN = _dot(q_MQ, tl.trans(k_NQ), DOT_FP32) * alpha
            sig_MN = tl.sigmoid(x_MN)
            dp_MN = _dot(do_MV, tl.trans(v_NV), DOT_FP32)
            ds_MN = _score_grad(dp_MN, x_MN, sig_MN, inv_max_len * alpha)
            ok_MN = _valid(rows_M[:, None], cols_N[None, :], row_ids_M[:, None], col_ids_N[None, :],
                           num_contextual, max_id, length)
            ds_MN = tl.where(ok_MN, ds_MN, 0.0).to(k_NQ.dtype)
            dq_MQ = dq_MQ + _dot(ds_MN, k_NQ, DOT_FP32)
        tl.store(grad_q_ptr + rows_M[:, None] * (num_heads * dq) + dq_Q[None, :],
                 dq_MQ.to(grad_q_ptr.dtype.element_ty), mask=row_ok_M[:, None] & (dq_Q[None, :] < dq))

    @triton.jit
    def _dkdv_rows(dk_NQ, dv_NV, k_NQ, v_NV, cols_N, col_ids_N, q_ptr, grad_out_ptr, lo, hi,
                   length, max_id, stride_qt, num_heads, dq, dv, num_contextual, alpha, inv_max_len,
                   HAS_TARGETS: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr):
        """dk, dv of one column block accumulated over rows [lo, hi), in transposed [N, M] score tiles
        (q_ptr and grad_out_ptr at the sequence's and head's first element)."""
        dq_Q = tl.arange(0, BLOCK_DQ)
        dv_V = tl.arange(0, BLOCK_DV)
        for m0 in range(lo, hi, BLOCK_M):
            rows_M = m0 + tl.arange(0, BLOCK_M)
            row_ok_M = rows_M < hi
            row_ids_M = _position_ids(rows_M, num_contextual, max_id, HAS_TARGETS)
            q_MQ = tl.load(q_ptr + rows_M[:, None] * stride_qt + dq_Q[None, :],
                           mask=row_ok_M[:, None] & (dq_Q[None, :] < dq), other=0.0)
            do_MV = tl.load(grad_out_ptr + rows_M[:, None] * (num_heads * dv) + dv_V[None, :],
                            mask=row_ok_M[:, None] & (dv_V[None, :] < dv), other=0.0)
            x_NM = _dot(k_NQ, tl.trans(q_MQ), DOT_FP32) * alpha
            sig_NM = tl.sigmoid(x_NM)
            ok_NM = _valid(rows_M[None, :], cols_N[:, None], row_ids_M[None, :], col_ids_N[:, None],
                           num_contextual, max_id, length) & row_ok_M[None, :]
            s_NM = tl.where(ok_NM, x_NM * sig_NM * inv_max_len, 0.0).to(do_MV.dtype)
            dv_NV = dv_NV + _dot(s_NM, do_MV, DOT_FP32)
            dp_NM = _dot(v_NV, tl.trans(do_MV), DOT_FP32)
            ds_NM = _score_grad(dp_NM, x_NM, sig_NM, inv_max_len * alpha)
            ds_NM = tl.where(ok_NM, ds_NM, 0.0).to(q_MQ.dtype)
            dk_NQ = dk_NQ + _dot(ds_NM, q_MQ, DOT_FP32)
        return dk_NQ, dv_NV

    @triton.jit
    def hstu_bwd_dkdv_kernel(
        q_ptr, k_ptr, v_ptr,  # forward inputs
        grad_out_ptr,  # [T, H, dv] gradient of out, contiguous
        grad_k_ptr,  # [T, H, dq] out, contiguous
        grad_v_ptr,  # [T, H, dv] out, contiguous
        offsets_ptr, num_targets_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        num_heads, dq, dv, num_contextual, alpha, inv_max_len,
        HAS_TARGETS: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        seq = tl.program_id(0) // num_heads
        head = tl.program_id(0) % num_heads
        n0 = tl.program_id(1) * BLOCK_N
        start, length, max_id = _sequence(offsets_ptr, num_targets_ptr, seq, num_contextual, HAS_TARGETS)
        if n0 >= length:
            return
        q_ptr += start * stride_qt + head * stride_qh
        k_ptr += start * stride_kt + head * stride_kh
        v_ptr += start * stride_vt + head * stride_vh
        grad_out_ptr += (start * num_heads + head) * dv
        grad_k_ptr += (start * num_heads + head) * dq
        grad_v_ptr += (start * num_heads + head) * dv
        cols_N = n0 + tl.arange(0, BLOCK_N)
        col_ok_N = cols_N < length
        col_ids_N = _position_ids(cols_N, num_contextual, max_id, HAS_TARGETS)
        dq_Q = tl.arange(0, BLOCK_DQ)
        dv_V = tl.arange(0, BLOCK_DV)
        k_NQ = tl.load(k_ptr + cols_N[:, None] * stride_kt + dq_Q[None, :],
                       mask=col_ok_N[:, None] & (dq_Q[None, :] < dq), other=0.0)
        v_NV = tl.load(v_ptr + cols_N[:, None] * stride_vt + dv_V[None, :],
                       mask=col_ok_N[:, None] & (dv_V[None, :] < dv), other=0.0)
        dk_NQ = tl.zeros([BLOCK_N, BLOCK_DQ], dtype=tl.float32)
        dv_NV = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        # the contextual rows before this block see it (non-causally), then every row from the block on
        dk_NQ, dv_NV = _dkdv_rows(dk_NQ, dv_NV, k_NQ, v_NV, cols_N, col_ids_N, q_ptr, grad_out_ptr,
                                  0, tl.minimum(num_contextual, n0), length, max_id, stride_qt, num_heads,
                                  dq, dv, num_contextual, alpha, inv_max_len, HAS_TARGETS, DOT_FP32,
                                  BLOCK_M, BLOCK_DQ, BLOCK_DV)
        dk_NQ, dv_NV = _dkdv_rows(dk_NQ, dv_NV, k_NQ, v_NV, cols_N, col_ids_N, q_ptr, grad_out_ptr,
                                  n0, length, length, max_id, stride_qt, num_heads,
                                  dq, dv, num_contextual, alpha, inv_max_len, HAS_TARGETS, DOT_FP32,
                                  BLOCK_M, BLOCK_DQ, BLOCK_DV)
        tl.store(grad_k_ptr + cols_N[:, None] * (num_heads * dq) + dq_Q[None, :],
                 dk_NQ.to(grad_k_ptr.dtype.element_ty), mask=col_ok_N[:, None] & (dq_Q[None, :] < dq))
        tl.store(grad_v_ptr + cols_N[:, None] * (num_heads * dv) + dv_V[None, :],
                 dv_NV.to(grad_v_ptr.dtype.element_ty), mask=col_ok_N[:, None] & (dv_V[None, :] < dv))


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself when its head dim is contiguous (the kernels take token and head strides), else a copy."""
    return x if x.stride(2) == 1 else x.contiguous()


class _HstuAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THQ, k_THQ, v_THV, offsets_B1, max_len, num_targets_B, num_contextual):
        q_THQ, k_THQ, v_THV = (_last_dim_contiguous(x) for x in (q_THQ, k_THQ, v_THV))
        offsets_B1 = offsets_B1.long().contiguous()
        tokens, heads, dq = q_THQ.shape
        dv = v_THV.shape[2]
        out_THV = torch.empty(tokens, heads, dv, dtype=v_THV.dtype, device=v_THV.device)
        ctx.meta = dict(heads=heads, dq=dq, dv=dv, max_len=max_len, num_contextual=num_contextual,
                        has_targets=num_targets_B is not None, batch=offsets_B1.numel() - 1)
        targets = offsets_B1 if num_targets_B is None else num_targets_B.contiguous()
        ctx.save_for_backward(q_THQ, k_THQ, v_THV, offsets_B1, targets)
        if tokens:
            blocks, common = _launch(ctx.meta, q_THQ.dtype)
            block_m, block_n, warps = blocks["fwd"]
            grid = (ctx.meta["batch"] * heads, triton.cdiv(max_len, block_m))
            hstu_fwd_kernel[grid](
                q_THQ, k_THQ, v_THV, out_THV, offsets_B1, targets, q_THQ.stride(0), q_THQ.stride(1),
                k_THQ.stride(0), k_THQ.stride(1), v_THV.stride(0), v_THV.stride(1), out_THV.stride(0),
                out_THV.stride(1), heads, dq, dv, num_contextual, *common["scalars"], BLOCK_M=block_m,
                BLOCK_N=block_n, num_warps=warps, **common["constexprs"])
        return out_THV

    @staticmethod
    def backward(ctx, grad_out_THV):
        q_THQ, k_THQ, v_THV, offsets_B1, targets = ctx.saved_tensors
        meta = ctx.meta
        grad_out_THV = grad_out_THV.to(v_THV.dtype).contiguous()
        grad_q_THQ = torch.empty(q_THQ.shape, dtype=q_THQ.dtype, device=q_THQ.device)
        grad_k_THQ = torch.empty(k_THQ.shape, dtype=k_THQ.dtype, device=k_THQ.device)
        grad_v_THV = torch.empty(v_THV.shape, dtype=v_THV.dtype, device=v_THV.device)
        if q_THQ.shape[0]:
            blocks, common = _launch(meta, q_THQ.dtype)
            strides = (q_THQ.stride(0), q_THQ.stride(1), k_THQ.stride(0), k_THQ.stride(1), v_THV.stride(0),
                       v_THV.stride(1))
            scalars = (meta["heads"], meta["dq"], meta["dv"], meta["num_contextual"], *common["scalars"])
            rows = meta["batch"] * meta["heads"]
            block_m, block_n, warps = blocks["bwd_dq"]
            hstu_bwd_dq_kernel[(rows, triton.cdiv(meta["max_len"], block_m))](
                q_THQ, k_THQ, v_THV, grad_out_THV, grad_q_THQ, offsets_B1, targets, *strides, *scalars,
                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, **common["constexprs"])
            block_m, block_n, warps = blocks["bwd_dkdv"]
            hstu_bwd_dkdv_kernel[(rows, triton.cdiv(meta["max_len"], block_n))](
                q_THQ, k_THQ, v_THV, grad_out_THV, grad_k_THQ, grad_v_THV, offsets_B1, targets, *strides,
                *scalars, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, **common["constexprs"])
        return grad_q_THQ, grad_k_THQ, grad_v_THV, None, None, None, None


def _launch(meta: dict, dtype: torch.dtype) -> tuple[dict, dict]:
    """The block table and the launch arguments every kernel shares."""
    interpret = interpreter_enabled()
    warp_size = 32 if interpret else triton.runtime.driver.active.get_current_target().warp_size
    blocks = attention_blocks(meta["dq"], meta["dv"], dtype == torch.float32, warp_size, interpret)
    block_dq, block_dv, _ = blocks["dims"]
    constexprs = {"HAS_TARGETS": meta["has_targets"], "DOT_FP32": dtype == torch.float32 or interpret,
                  "BLOCK_DQ": block_dq, "BLOCK_DV": block_dv}
    return blocks, {"scalars": (1.0 / math.sqrt(meta["dq"]), 1.0 / meta["max_len"]), "constexprs": constexprs}


def hstu_attention_triton(q_THQ: torch.Tensor, k_THQ: torch.Tensor, v_THV: torch.Tensor,
                          offsets_B1: torch.Tensor, max_len: int, num_heads: int,
                          num_targets_B: torch.Tensor | None, num_contextual: int) -> torch.Tensor:
    """Jagged HSTU attention by the Triton kernels: q, k [T, H, dq], v [T, H, dv] (fp32 or bf16, one dtype),
    offsets int [B + 1] -> out [T, H, dv], differentiable in q, k and v (`anyrec.kernels.hstu` semantics)."""
    if not HAS_TRITON:
        raise RuntimeError("the triton hstu attention was requested but triton is not installed")
    check_inputs(q_THQ, k_THQ, v_THV, offsets_B1, max_len, num_heads, num_targets_B, num_contextual, DTYPES)
    return _HstuAttention.apply(q_THQ, k_THQ, v_THV, offsets_B1, max_len, num_targets_B, num_contextual)


def triton_attention_fn() -> HstuAttentionFn:
    """The builder of the op's triton Impl record: `hstu_attention_triton`."""
    return hstu_attention_triton
