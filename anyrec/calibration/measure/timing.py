"""Timing a measurement and fitting a cost model to the times: what every measurement shares."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import torch

from anyrec.backends import Backend
from anyrec.calibration.run import CalibrationRun, Timing


def timeit(fn: Callable[[], Any], backend: Backend, budget_s: float, min_reps: int = 3,
           reps: int | None = None, run: CalibrationRun | None = None, warmups: int = 1) -> Timing:
    """Seconds per call of `fn` (median and spread): `warmups` untimed calls, then repeat until the budget
    is spent (collectives pass a fixed `reps`: every rank must make the same number of calls). Within
    `run`, a stop signal ends it at once and the phase's end after one timed call."""
    run = run or CalibrationRun.unbounded()
    run.check()
    for _ in range(warmups):
        fn()
    backend.synchronize()
    times: list[float] = []
    start = time.perf_counter()
    while (len(times) < reps if reps is not None else
           not times or (not run.expired() and (len(times) < min_reps or (
               time.perf_counter() - start < budget_s and len(times) < 200)))):
        run.check()
        t0 = time.perf_counter()
        fn()
        backend.synchronize()
        times.append(time.perf_counter() - t0)
    return Timing.of(times)


def timed(name: str, fn: Callable[[], Any], backend: Backend, budget_s: float,
          run: CalibrationRun | None) -> float:
    """Median seconds of `fn` as measurement `name` (shown on the run's bar, its spread recorded)."""
    run = run or CalibrationRun.unbounded()
    run.measuring(name)
    timing = timeit(fn, backend, budget_s, run=run)
    run.measured(name, timing)
    return timing.median_s


def fit_nonnegative(rows: list[list[float]], y: list[float], scale: list[float] | None = None) -> list[float]:
    """Least squares of `y ~ rows @ c` with c >= 0, minimising error relative to `scale` (default `y`:
    the points span orders of magnitude): the best unconstrained fit over every subset of the columns
    whose coefficients all come out non-negative (exact; 2^columns small solves)."""
    n = len(rows[0])
    X = torch.tensor(rows, dtype=torch.float64)
    Y = torch.tensor(y, dtype=torch.float64)
    w = 1.0 / torch.tensor(scale if scale is not None else y, dtype=torch.float64)
    best, best_err = [0.0] * n, float("inf")
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            Xs = X[:, list(cols)] * w[:, None]
            sol = torch.linalg.lstsq(Xs, (Y * w)[:, None]).solution[:, 0]
            if (sol < 0).any():
                continue
            err = float(((Xs @ sol - Y * w) ** 2).sum())
            if err < best_err:
                best_err, best = err, [0.0] * n
                for c, v in zip(cols, sol.tolist(), strict=True):
                    best[c] = v
    return best
