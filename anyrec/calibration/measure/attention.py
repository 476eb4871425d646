"""The HSTU attention a job runs, measured on the job's own shapes: its heads and dims, its batch, and
sequences with the planned mean and root-mean-square lengths up to the data's longest, forward and
backward, in the dtype the planner costs. What the planner needs is the rate (`AttentionRate`): the
reference's FLOP count of those sequences over the measured seconds, which also prices what the FLOPs
leave out (a padding implementation's padded pairs, its jagged <-> padded copies, its elementwise passes
over the scores).

Legend: B sequences, T tokens of all of them, H heads, A query/key dim, V value dim.
"""

from __future__ import annotations

import time

import torch

from anyrec.backends import Backend
from anyrec.backends.hardware import AttentionRate
from anyrec.calibration.measure.timing import timeit
from anyrec.calibration.run import CalibrationRun, Timing
from anyrec.kernels.hstu import HstuAttentionFn
from anyrec.planner.sequence import attention_layer_flops
from anyrec.schema import HSTUShape

MIN_REPS = 5  # the job's largest dense term: a median of at least this many forward + backward passes


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


def measure_attention(fn: HstuAttentionFn, impl: str, shape: HSTUShape, batch: int, half: bool,
                      backend: Backend, device: torch.device, budget_s: float,
                      run: CalibrationRun | None = None) -> AttentionRate:
    """`fn` (implementation `impl`) on `batch` sequences of `measurement_lengths`, one target each, in bf16
    where `half` (else fp32) on `device`: the median seconds of its forward and of its forward + backward
    (at least MIN_REPS, within `budget_s`), and the rate they give."""
    lengths = measurement_lengths(shape, batch)
    H, A, V = shape.num_heads, shape.qk_dim, shape.v_dim
    dtype = torch.bfloat16 if half else torch.float32
    T = sum(lengths)
    gen = torch.Generator().manual_seed(0)

    def leaf(dim: int) -> torch.Tensor:
        return torch.randn(T, H, dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()

    q_THA, k_THA, v_THV = leaf(A), leaf(A), leaf(V)
    offsets_B1 = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64,
                              device=device)
    targets_B = torch.ones(batch, dtype=torch.int64, device=device)
    grad_THV = torch.randn(T, H, V, generator=gen).to(device=device, dtype=dtype)
    forward_times: list[float] = []

    def step() -> None:
        t0 = time.perf_counter()
        out_THV = fn(q_THA, k_THA, v_THV, offsets_B1, shape.seq_len, H, targets_B, 0)
        backend.synchronize()
        forward_times.append(time.perf_counter() - t0)
        torch.autograd.grad(out_THV, (q_THA, k_THA, v_THV), grad_THV)

    name = f"attention {impl} B{batch} H{H} A{A} V{V} S{shape.mean_tokens:g}/{shape.longest_tokens:g}"
    run = run or CalibrationRun.unbounded()
    run.measuring(name)
    timing = timeit(step, backend, budget_s, min_reps=MIN_REPS, run=run)
    run.measured(name, timing)
    forward = Timing.of(forward_times[1:])  # the first call is timeit's warm-up
    flops = attention_layer_flops(float(sum(n * n for n in lengths)), H, A, V)
    return AttentionRate(impl=impl, dtype="bf16" if half else "fp32", heads=H, qk_dim=A, v_dim=V,
                         mean_tokens=shape.mean_tokens, rms_tokens=shape.rms_tokens,
                         longest_tokens=shape.longest_tokens, batch=batch, forward_s=forward.median_s,
                         step_s=timing.median_s, flops_per_s=flops / timing.median_s, spread=timing.spread)
