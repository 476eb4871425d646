"""An HSTU job's kernels measured on the job's own shapes (its heads and dims, its batch, sequences with
the planned mean and root-mean-square lengths up to the data's longest), forward and backward, in the dtype
the planner costs, as the rates the planner costs them at (`HSTURates`):

- the attention implementation the job runs: the reference's FLOP count of those sequences over the
  measured seconds, which also prices what the FLOPs leave out (a padding implementation's padded pairs,
  its jagged <-> padded copies, its elementwise passes over the scores);
- one STU layer's UVQK and output GEMMs over all the tokens (tall, narrow GEMMs: their rate is not a
  square GEMM's, nor a DLRM MLP's);
- the elementwise passes (norms, SiLU, gating): a layer norm's forward + backward over the attention
  output, bytes read and written over seconds.

Legend: B sequences, T tokens of all of them, H heads, A query/key dim, V value dim (U = H x V), D model
dim, Q = 2 H (A + V) the UVQK projection's width.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from anyrec.backends import Backend
from anyrec.backends.hardware import HSTURates
from anyrec.calibration.measure.timing import timeit
from anyrec.calibration.run import CalibrationRun, Timing
from anyrec.kernels.hstu import HstuAttentionFn
from anyrec.models.hstu import HSTUDense
from anyrec.planner.sequence import attention_layer_flops, stu_gemm_flops_per_token
from anyrec.schema import HSTUShape

MIN_REPS = 5  # the job's largest dense term: a median of at least this many forward + backward passes
# The whole dense part, the step's largest term and what the planner costs it by: timed for at least this
# long after DENSE_WARMUPS untimed passes. On a shared host one pass varies by a quarter from one second to
# the next (dlrmv4_small on the 2-core CPU host: medians of 5 passes 72-126 ms, of 30 passes 71-73 ms), so
# a median of a few passes would be that second's speed, not the job's.
DENSE_BUDGET_S = 3.0
DENSE_WARMUPS = 3


def measurement_lengths(shape: HSTUShape, batch: int) -> list[int]:
    """`batch` sequence lengths (tokens) with `shape`'s mean and root mean square, the longest at the data's
    longest: the two-point spread that has them (some at the longest, the rest at one shorter length),
    rounded to whole tokens with the total kept; every sequence at the mean where the lengths do not
    vary."""
    if batch < 1:
        raise ValueError(f"attention measurement: batch must be >= 1, got {batch}")
    mean, longest = shape.mean_tokens, shape.longest_tokens
    var = max(0.0, shape.rms_tokens ** 2 - mean ** 2)
    if var == 0.0 or longest <= mean:
        return _rounded([mean] * batch)
    low = mean - var / (longest - mean)  # (longest - mean)(mean - low) = var: the two-point spread
    at_longest = round(batch * (mean - low) / (longest - low))
    return _rounded([longest] * at_longest + [low] * (batch - at_longest))


def _rounded(lengths: list[float]) -> list[int]:
    """Whole lengths (each at least 1) whose sum is the rounded sum of `lengths`."""
    out, carry = [], 0.0
    for x in lengths:
        n = max(1, round(x + carry))
        carry += x - n
        out.append(n)
    return out


def measure_hstu(fn: HstuAttentionFn, impl: str, shape: HSTUShape, batch: int, half: bool,
                 backend: Backend, device: torch.device, budget_s: float,
                 run: CalibrationRun | None = None, dense: DenseUnderTest | None = None,
                 dense_budget_s: float = DENSE_BUDGET_S) -> HSTURates:
    """`fn` (attention implementation `impl`), one layer's GEMMs and a layer norm on `batch` sequences of
    `measurement_lengths`, one target each, in bf16 where `half` (else fp32) on `device`: the median
    seconds of each one's forward + backward (at least MIN_REPS, each within `budget_s`; the attention's
    forward alone too), and the rates they give; with `dense` (the job's dense part, built with `fn`),
    its whole forward + backward on the same sequences under the job's autocast, timed for at least
    `dense_budget_s` after DENSE_WARMUPS untimed passes."""
    lengths = measurement_lengths(shape, batch)
    H, A, V, D = shape.num_heads, shape.qk_dim, shape.v_dim, shape.model_dim
    dtype = torch.bfloat16 if half else torch.float32
    T = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    run = run or CalibrationRun.unbounded()

    def tensor(*size: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype).requires_grad_(grad)

    def timing(name: str, step, budget: float = budget_s, warmups: int = 1) -> Timing:
        run.measuring(name)
        out = timeit(step, backend, budget, min_reps=MIN_REPS, run=run, warmups=warmups)
        run.measured(name, out)
        return out

    q_THA, k_THA, v_THV = tensor(T, H, A), tensor(T, H, A), tensor(T, H, V)
    offsets_B1 = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64,
                              device=device)
    targets_B = torch.ones(batch, dtype=torch.int64, device=device)
    grad_THV = tensor(T, H, V, grad=False)
    forward_times: list[float] = []

    def attention() -> None:
        t0 = time.perf_counter()
        out_THV = fn(q_THA, k_THA, v_THV, offsets_B1, shape.seq_len, H, targets_B, 0)
        backend.synchronize()
        forward_times.append(time.perf_counter() - t0)
        torch.autograd.grad(out_THV, (q_THA, k_THA, v_THV), grad_THV)

    x_TD, uvqk_DQ = tensor(T, D), tensor(D, 2 * H * (A + V))
    y_T3U, out_3UD = tensor(T, 3 * H * V), tensor(3 * H * V, D)

    def gemms() -> None:  # the STU layer's two projections, forward and backward
        outs = (x_TD @ uvqk_DQ, y_T3U @ out_3UD)
        torch.autograd.grad(outs, (x_TD, uvqk_DQ, y_T3U, out_3UD), [torch.ones_like(o) for o in outs])

    a_TU, w_U, b_U = tensor(T, H * V), tensor(H * V), tensor(H * V)
    grad_TU = tensor(T, H * V, grad=False)

    def norm() -> None:
        out_TU = F.layer_norm(a_TU, (H * V,), w_U, b_U)
        torch.autograd.grad(out_TU, (a_TU,), grad_TU)

    dense_step = 0.0
    if dense is not None:
        whole = dense_pass(dense, lengths, backend, device, half, gen)
        dense_step = timing(f"dense part B{batch} T{T}", whole, max(budget_s, dense_budget_s),
                            DENSE_WARMUPS).median_s
    step = timing(f"attention {impl} B{batch} H{H} A{A} V{V} S{shape.mean_tokens:g}/{shape.longest_tokens:g}",
                  attention)
    forward = Timing.of(forward_times[1:])  # the first call is timeit's warm-up
    gemm = timing(f"STU GEMMs T{T} D{D}", gemms)
    elementwise = timing(f"layer norm T{T} U{H * V}", norm)
    flops = attention_layer_flops(float(sum(n * n for n in lengths)), H, A, V)
    # forward reads the input and writes the output; backward reads the input and the output's gradient,
    # writes the input's gradient
    norm_bytes = 5 * T * H * V * (2 if half else 4)
    return HSTURates(impl=impl, dtype="bf16" if half else "fp32", heads=H, qk_dim=A, v_dim=V,
                     mean_tokens=shape.mean_tokens, rms_tokens=shape.rms_tokens,
                     longest_tokens=shape.longest_tokens, batch=batch, forward_s=forward.median_s,
                     step_s=step.median_s, flops_per_s=flops / step.median_s,
                     gemm_flops_per_s=T * stu_gemm_flops_per_token(shape) / gemm.median_s,
                     elementwise_bw_bytes_per_s=norm_bytes / elementwise.median_s, spread=step.spread,
                     dense_step_s=dense_step)


@dataclass(frozen=True)
class DenseUnderTest:
    """An HSTU model's dense part to time (`anyrec.models.hstu.HSTUDense`, on the device, in train mode) and
    the dim of the table rows it reads."""

    module: HSTUDense
    table_dim: int


def dense_pass(dense: DenseUnderTest, lengths: list[int], backend: Backend, device: torch.device,
               half: bool, gen: torch.Generator) -> Callable[[], None]:
    """One training pass of `dense` on sequences of `lengths` tokens (contextual tokens and one target
    each): random table rows in, the logits' sum back to every parameter and row, under bf16 autocast where
    `half`."""
    m, E = dense.module, dense.table_dim
    C = m.num_contextual
    lengths_B = torch.tensor([max(1, n - C) for n in lengths], dtype=torch.int64)
    B, T = lengths_B.numel(), int(lengths_B.sum())

    def rows(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(device).requires_grad_(True)

    item_TE, artist_TE, album_TE, contextual_BCE = rows(T, E), rows(T, E), rows(T, E), rows(B, C, E)
    actions_T = torch.tensor([1, 2, 4], dtype=torch.int64)[torch.randint(0, 3, (T,), generator=gen)]
    timestamps_T = torch.cumsum(torch.randint(1, 600, (T,), generator=gen), 0) + 1_700_000_000
    num_targets_B = torch.ones(B, dtype=torch.int64)
    actions_T, timestamps_T, num_targets_B, lengths_B = (
        t.to(device) for t in (actions_T, timestamps_T, num_targets_B, lengths_B))

    def step() -> None:
        m.zero_grad(set_to_none=True)
        with backend.autocast(half):
            logits_G = m.logits(item_TE, artist_TE, album_TE, contextual_BCE, lengths_B, actions_T,
                                timestamps_T, num_targets_B, B)
        logits_G.float().sum().backward()

    return step
