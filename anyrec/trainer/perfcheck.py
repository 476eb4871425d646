"""Every run checks the plan's prediction: measured seconds per step after warm-up, per rank, beside
the planner's predicted step time.

Timing adds no host sync to the steady-state step: the clock is read at the warm-up boundary (host
time, no sync) and at the end of each chunk, after the trainer's existing drain of the pipeline, so
whole chunks are timed between sync points; evaluation and checkpoints between chunks are not counted.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

MISS_WARN_FRACTION = 0.30  # a prediction off by more than this is worth calibrating for
MAX_WARMUP_STEPS = 10  # compile, allocator and cache warm-up happen in the first few steps


def warmup_steps(steps: int) -> int:
    """Steps left out of the measurement at the start of a run of `steps` steps (a fifth, 1 to 10)."""
    return max(1, min(MAX_WARMUP_STEPS, steps // 5))


class StepTimer:
    """The one clock of the training loop, read at chunk boundaries (after the pipeline is drained):
    all training time (the summary's samples_per_s and elapsed_s) and, apart, the seconds and steps
    after warm-up outside profiled chunks (the prediction check)."""

    def __init__(self, first_step: int, steps: int) -> None:
        self.warm_step = first_step + warmup_steps(steps - first_step)
        self.total_s = 0.0  # every finished chunk
        self.seconds = 0.0  # after warm-up, timed chunks only
        self.steps = 0
        self._start: float | None = None  # the running chunk's start
        self._timed = False
        self._t0: float | None = None
        self._s0 = 0

    def chunk_start(self, step: int, timed: bool = True) -> None:
        """A chunk begins at `step` (just after a sync point); `timed=False`: not in the measured steps."""
        self._start = time.perf_counter()
        self._timed = timed
        self._t0, self._s0 = (self._start, step) if timed and step >= self.warm_step else (None, step)

    def after_step(self, step: int) -> None:
        """`step` steps are done; at the warm-up boundary the clock starts (a host read, no sync)."""
        if self._timed and step == self.warm_step:
            self._t0, self._s0 = time.perf_counter(), step

    def chunk_end(self, step: int) -> None:
        """The chunk ended at `step` and the device is drained: count its time."""
        now = time.perf_counter()
        if self._start is not None:
            self.total_s += now - self._start
        if self._t0 is not None and step > self._s0:
            self.seconds += now - self._t0
            self.steps += step - self._s0
        self._start = self._t0 = None

    def elapsed_s(self) -> float:
        """Training time so far, the running chunk included."""
        running = time.perf_counter() - self._start if self._start is not None else 0.0
        return self.total_s + running

    @property
    def step_s(self) -> float | None:
        """Measured seconds per step on this rank, None if no step ran after warm-up."""
        return self.seconds / self.steps if self.steps else None


def prediction_check(predicted_s: float | None, per_rank_s: list[float | None],
                     log: bool = True) -> dict[str, object]:
    """The summary's keys: predicted and measured (slowest rank) ms per step and the relative error
    predicted / measured - 1 (null where either is missing); logs both and warns on a large miss."""
    measured = [s for s in per_rank_s if s is not None]
    measured_s = max(measured) if measured else None
    error = predicted_s / measured_s - 1.0 if predicted_s and measured_s else None
    if log and measured_s is not None:
        ranks = " ".join(f"{s * 1e3:.2f}" if s is not None else "-" for s in per_rank_s)
        pred = f"{predicted_s * 1e3:.2f} ms predicted by the plan" if predicted_s else "no prediction"
        logger.info("step time after warm-up: %.2f ms measured (per rank: %s ms), %s",
                    measured_s * 1e3, ranks, pred)
        if error is not None and abs(error) > MISS_WARN_FRACTION:
            logger.warning("the plan predicted %.2f ms per step but the slowest rank measured %.2f ms "
                           "(%+.0f%%): the cost model does not fit this machine; calibrate it (torchrun "
                           "--nproc_per_node=N -m anyrec.calibrate calibrate.output=cal.yaml) and plan with "
                           "hardware.sku=cal.yaml", predicted_s * 1e3, measured_s * 1e3, error * 100)
    return {
        "predicted_step_ms": predicted_s * 1e3 if predicted_s else None,
        "measured_step_ms": measured_s * 1e3 if measured_s is not None else None,
        "measured_step_ms_per_rank": [None if s is None else s * 1e3 for s in per_rank_s],
        "prediction_error": error,
    }
