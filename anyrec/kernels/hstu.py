"""Jagged HSTU attention (pointwise SiLU, causal, target-aware, contextual tokens): the pure-torch oracle.

Semantics are those of generative-recommenders' `pytorch_hstu_mha` and `_get_valid_attn_mask`
(generative_recommenders/ops/pytorch/pt_hstu_attention.py, github.com/meta-recsys/generative-recommenders,
read at commit db1bf8f) with causal=True, no dropout, no attn_scale, max_attn_len=0 and
min_full_attn_seq_len=0, and alpha = 1/sqrt(dq), the STU layer's default `attn_alpha`. Per sequence b of
length L and per head, with p a position in [0, L):

    s_ij  = silu(alpha * q_i . k_j) / max_len          (no softmax)
    out_i = sum_j valid_ij * s_ij * v_j
    id(p) = max(p - C + 1, 0) if C > 0 else p           (C = num_contextual: the first C positions share id 0)
    M     = L - C + 1 if C > 0 else L, minus num_targets[b] when targets are given
    id(p) = min(id(p), M) when targets are given       (the targets share id M)
    valid_ij = (i == j) or id(i) > id(j) or (C > 0 and id(i) == 0 and id(j) < M)

so a history token sees the contextual tokens and the history before it; a target sees those and itself
but no other target; a contextual token sees every non-target token. `hstu_attention_torch` computes this
on padded chunks of whole sequences (fp32 math for bf16/fp16 inputs, autocast off), the chunks small
enough that the [b, H, N, N] score tensors stay bounded and checkpointed when there are several;
`anyrec.kernels.triton_hstu` is the Triton kernel. Both take and return the same layout.
`hstu_attention_traceable` is the torch version as one chunk with no host-side reads, the form `torch.export`
traces into a scoring artifact.

Legend (shape suffixes): T tokens of the batch (all sequences back to back), H heads, Q query/key dim,
V value dim, B sequences, B1 = B + 1 offsets, N positions of a padded chunk (its longest sequence).
"""

from __future__ import annotations

import itertools
import math
from typing import Protocol

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # the torch version's
# Score elements (chunk sequences x H x N x N) one padded chunk may hold: a few fp32 tensors of this size
# are alive at once (scores, mask, their products), so 2^25 keeps a chunk near half a GiB.
CHUNK_SCORE_ELEMENTS = 1 << 25


class HstuInputError(ValueError):
    """Inputs that HSTU attention cannot take (shape, dtype, device, or offsets/targets values)."""


class HstuAttentionFn(Protocol):
    """The op's interface, whichever implementation serves it."""

    def __call__(self, q_THQ: torch.Tensor, k_THQ: torch.Tensor, v_THV: torch.Tensor,
                 offsets_B1: torch.Tensor, max_len: int, num_heads: int, num_targets_B: torch.Tensor | None,
                 num_contextual: int) -> torch.Tensor: ...


def check_inputs(q_THQ: torch.Tensor, k_THQ: torch.Tensor, v_THV: torch.Tensor, offsets_B1: torch.Tensor,
                 max_len: int, num_heads: int, num_targets_B: torch.Tensor | None, num_contextual: int,
                 dtypes: tuple[torch.dtype, ...] = DTYPES) -> list[int]:
    """Check the inputs (one device-to-host copy for the values); the sequence lengths, on the host."""
    if (q_THQ.dim() != 3 or k_THQ.shape != q_THQ.shape or v_THV.dim() != 3
            or v_THV.shape[:2] != q_THQ.shape[:2]):
        raise HstuInputError(f"hstu attention takes q, k [T, H, dq] and v [T, H, dv]; got "
                             f"q {tuple(q_THQ.shape)}, k {tuple(k_THQ.shape)}, v {tuple(v_THV.shape)}")
    if q_THQ.shape[1] != num_heads:
        raise HstuInputError(f"hstu attention: num_heads={num_heads} but q has {q_THQ.shape[1]} heads")
    if not (q_THQ.dtype == k_THQ.dtype == v_THV.dtype) or q_THQ.dtype not in dtypes:
        raise HstuInputError(f"hstu attention takes q, k, v of one dtype among "
                             f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)}; "
                             f"got {q_THQ.dtype}, {k_THQ.dtype}, {v_THV.dtype}")
    tensors = [q_THQ, k_THQ, v_THV, offsets_B1] + ([num_targets_B] if num_targets_B is not None else [])
    if len({t.device for t in tensors}) != 1:
        devices = sorted({str(t.device) for t in tensors})
        raise HstuInputError(f"hstu attention: inputs on several devices ({devices})")
    if offsets_B1.dim() != 1 or offsets_B1.numel() < 1 or offsets_B1.dtype not in (torch.int64, torch.int32):
        raise HstuInputError(f"hstu attention: offsets must be a 1-D int64/int32 tensor of B + 1 cumulative "
                             f"lengths; got {offsets_B1.dtype} {tuple(offsets_B1.shape)}")
    batch = offsets_B1.numel() - 1
    if num_targets_B is not None and (num_targets_B.shape != (batch,) or num_targets_B.is_floating_point()):
        raise HstuInputError(f"hstu attention: num_targets must be an integer tensor [B={batch}]; got "
                             f"{num_targets_B.dtype} {tuple(num_targets_B.shape)}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise HstuInputError(f"hstu attention: max_len must be an int >= 1, got {max_len!r}")
    if isinstance(num_contextual, bool) or not isinstance(num_contextual, int) or num_contextual < 0:
        raise HstuInputError(f"hstu attention: num_contextual must be an int >= 0, got {num_contextual!r}")
    values = offsets_B1.long()
    if num_targets_B is not None:
        values = torch.cat([values, num_targets_B.long()])
    values = values.tolist()  # the one device-to-host copy
    offsets, targets = values[:batch + 1], values[batch + 1:]
    lengths = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    if offsets[0] != 0 or offsets[-1] != q_THQ.shape[0] or min(lengths, default=0) < 0:
        raise HstuInputError(f"hstu attention: offsets must rise from 0 to T={q_THQ.shape[0]}; got "
                             f"{offsets[:4]}{'...' if batch > 3 else ''} ending at {offsets[-1]}")
    if max(lengths, default=0) > max_len:
        raise HstuInputError(f"hstu attention: a sequence of length {max(lengths)} exceeds max_len={max_len}")
    bad = next((b for b, (n, length) in enumerate(zip(targets, lengths, strict=False))
                if not 0 <= n <= length), None)
    if bad is not None:
        raise HstuInputError(f"hstu attention: sequence {bad} has {targets[bad]} targets but length "
                             f"{lengths[bad]}")
    return lengths


def valid_mask(lengths_B: torch.Tensor, num_targets_B: torch.Tensor | None, num_contextual: int,
               n: int) -> torch.Tensor:
    """[B, N, N] bool: which (row, column) pairs of each padded sequence attend (module docstring)."""
    ids_BN = torch.arange(n, device=lengths_B.device).expand(lengths_B.numel(), n)
    max_ids_B1 = lengths_B.long()[:, None]
    if num_contextual > 0:
        ids_BN = (ids_BN - num_contextual + 1).clamp(min=0)
        max_ids_B1 = max_ids_B1 - num_contextual + 1
    if num_targets_B is not None:
        max_ids_B1 = max_ids_B1 - num_targets_B.long()[:, None]
        ids_BN = torch.minimum(ids_BN, max_ids_B1)
    rows_BN1, cols_B1N = ids_BN[:, :, None], ids_BN[:, None, :]
    valid_BNN = torch.eye(n, dtype=torch.bool, device=lengths_B.device) | (rows_BN1 > cols_B1N)
    if num_contextual > 0:
        valid_BNN = valid_BNN | ((rows_BN1 == 0) & (cols_B1N < max_ids_B1[:, :, None]))
    return valid_BNN


def _chunks(lengths: list[int], num_heads: int) -> list[tuple[int, int, int]]:
    """(first, end, N) runs of consecutive sequences whose padded scores fit CHUNK_SCORE_ELEMENTS."""
    out, first, n = [], 0, 0
    for b, length in enumerate(lengths):
        wider = max(n, length)
        if b > first and (b + 1 - first) * num_heads * wider * wider > CHUNK_SCORE_ELEMENTS:
            out.append((first, b, n))
            first, wider = b, length
        n = wider
    if first < len(lengths):
        out.append((first, len(lengths), n))
    return out


def _chunk_attention(q_tHQ: torch.Tensor, k_tHQ: torch.Tensor, v_tHV: torch.Tensor, lengths_b: torch.Tensor,
                     num_targets_b: torch.Tensor | None, max_len: int, num_contextual: int,
                     n: int) -> torch.Tensor:
    """Attention of one chunk of whole sequences (tokens t, sequences b), padded to N positions."""
    nb, heads = lengths_b.numel(), q_tHQ.shape[1]
    starts_b = torch.cumsum(lengths_b, 0) - lengths_b
    tokens, device = q_tHQ.shape[0], q_tHQ.device
    seq_t = torch.repeat_interleave(torch.arange(nb, device=device), lengths_b, output_size=tokens)
    # each token's row in the padded [b * N] layout: one flat index copy and one gather (no advanced
    # indexing over two dims, whose broadcast torch.export cannot trace for a dynamic token count)
    row_t = seq_t * n + torch.arange(tokens, device=device) - starts_b[seq_t]

    def padded(x_tHD: torch.Tensor) -> torch.Tensor:
        # [b, H, N, D]: each head's positions contiguous, so the products are plain batched GEMMs
        out = x_tHD.new_zeros(nb * n, heads, x_tHD.shape[2]).index_copy_(0, row_t, x_tHD)
        return out.view(nb, n, heads, -1).transpose(1, 2).contiguous()

    alpha = 1.0 / math.sqrt(q_tHQ.shape[2])
    scores_BHNN = torch.matmul(padded(q_tHQ), padded(k_tHQ).transpose(2, 3)) * alpha
    valid_B1NN = valid_mask(lengths_b, num_targets_b, num_contextual, n)[:, None]
    probs_BHNN = torch.where(valid_B1NN, F.silu(scores_BHNN) / max_len, 0.0)
    out_BHNV = torch.matmul(probs_BHNN, padded(v_tHV))
    return out_BHNV.transpose(1, 2).reshape(nb * n, heads, -1).index_select(0, row_t)


def hstu_attention_torch(q_THQ: torch.Tensor, k_THQ: torch.Tensor, v_THV: torch.Tensor,
                         offsets_B1: torch.Tensor, max_len: int, num_heads: int,
                         num_targets_B: torch.Tensor | None, num_contextual: int) -> torch.Tensor:
    """Jagged HSTU attention in plain torch (any device, differentiable): q, k [T, H, dq], v [T, H, dv],
    offsets int [B + 1] -> out [T, H, dv] in the inputs' dtype (module docstring for the semantics)."""
    lengths = check_inputs(q_THQ, k_THQ, v_THV, offsets_B1, max_len, num_heads, num_targets_B, num_contextual)
    compute = torch.promote_types(q_THQ.dtype, torch.float32)
    lengths_B = torch.tensor(lengths, dtype=torch.int64, device=q_THQ.device)
    chunks = [c for c in _chunks(lengths, num_heads) if c[2] > 0]  # a chunk of empty sequences has no token
    starts = [0, *itertools.accumulate(lengths)]
    outs = []
    with torch.autocast(q_THQ.device.type, enabled=False):
        for first, end, n in chunks:
            t0, t1 = starts[first], starts[end]
            args = (q_THQ[t0:t1].to(compute), k_THQ[t0:t1].to(compute), v_THV[t0:t1].to(compute),
                    lengths_B[first:end], None if num_targets_B is None else num_targets_B[first:end],
                    max_len, num_contextual, n)
            if len(chunks) > 1 and torch.is_grad_enabled():  # keep one chunk's scores alive, not all
                outs.append(checkpoint(_chunk_attention, *args, use_reentrant=False))
            else:
                outs.append(_chunk_attention(*args))
    if not outs:  # no token at all: the empty output, still part of the graph
        return v_THV.clone()
    return torch.cat(outs).to(v_THV.dtype)


def hstu_attention_traceable(q_THQ: torch.Tensor, k_THQ: torch.Tensor, v_THV: torch.Tensor,
                             offsets_B1: torch.Tensor, max_len: int, num_heads: int,
                             num_targets_B: torch.Tensor | None, num_contextual: int) -> torch.Tensor:
    """The same attention as one padded chunk of the whole batch, its longest sequence read as a tensor
    value (no host-side list, no value checks: the caller checks its inputs): the form `torch.export` traces
    for a scoring artifact, the padded length a data-dependent size. Equal to `hstu_attention_torch`, bit
    for bit, where that one runs a single chunk (a batch of fewer than CHUNK_SCORE_ELEMENTS scores)."""
    lengths_B = torch.diff(offsets_B1)
    n = lengths_B.max().item()
    torch._check(n >= 0)
    torch._check(n <= max_len)
    compute = torch.promote_types(q_THQ.dtype, torch.float32)
    out_THV = _chunk_attention(q_THQ.to(compute), k_THQ.to(compute), v_THV.to(compute), lengths_B,
                               num_targets_B, max_len, num_contextual, n)
    return out_THV.to(v_THV.dtype)


def torch_attention_fn() -> HstuAttentionFn:
    """The builder of the op's torch Impl record: `hstu_attention_torch`."""
    return hstu_attention_torch


def attention_flops(lengths: list[int], num_heads: int, dq: int, dv: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of the causal pairs, i <= j, per head: 2 (dq + dv) a pair forward, twice that
    backward (dq, dk, dv and the score gradient; the kernel's recomputation of the scores not counted)."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    forward = 2.0 * (dq + dv) * pairs * num_heads
    return forward, 2.0 * forward
