"""Every run checks the plan's prediction: measured seconds per step after warm-up, per rank, beside
the planner's predicted step time; and, with `trainer.breakdown_steps`, where a step's time goes: the
last steps of the run under torch.profiler, split into the step's phases beside the plan's split.

Timing adds no host sync to the steady-state step: the clock is read at the warm-up boundary (host
time, no sync) and at the end of each chunk, after the trainer's existing drain of the pipeline, so
whole chunks are timed between sync points; evaluation and checkpoints between chunks are not counted.
Where a step's work is done when its host call returns (the backend queues no device work: the host
CPU), each step is also timed alone and the measured step is the median step: on a shared host, the
steps another process's burst lands on are its cost, not the step's, and the mean moves 20-40 % from
run to run where the median moves a few percent. Elsewhere the measured step is the chunks' mean.

The breakdown: the trainer labels its three step functions (`anyrec.forward`, `anyrec.backward` with
the fused embedding update inside it, `anyrec.optimizer` for the dense one); the rest of a step on the
training thread (the next batch's input distribution, data, loss bookkeeping) is `other`.
`collectives` is the training thread's time issuing collectives (c10d ops) or waiting for their
results (torchrec's awaitables' `wait()`), counted once where they nest and also inside the phase it
happened in: comms are separable where the thread waits for them (gloo on a CPU). On an accelerator
the thread runs ahead of the device, so its phases measure launches; the device's own kernel time is
added as `device_compute` and `device_comms` (NCCL/RCCL kernels).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule, supported_activities

from anyrec.planner.types import Perf
from anyrec.runtime.distributed import DistInfo, gather_objects

logger = logging.getLogger(__name__)

MISS_WARN_FRACTION = 0.30  # a prediction off by more than this is worth calibrating for
MAX_WARMUP_STEPS = 10  # compile, allocator and cache warm-up happen in the first few steps


def warmup_steps(steps: int) -> int:
    """Steps left out of the measurement at the start of a run of `steps` steps (a fifth, 1 to 10)."""
    return max(1, min(MAX_WARMUP_STEPS, steps // 5))


class StepMedian:
    """The median of many step times in bounded memory: counts in 0.5 %-wide logarithmic bins (the
    median is its bin's centre, within 0.25 %), whatever the run's length."""

    BIN = math.log(1.005)

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()
        self.n = 0

    def add(self, seconds: float) -> None:
        """One step's seconds (positive and finite; anything else is not a step time)."""
        if seconds > 0 and math.isfinite(seconds):
            self.counts[round(math.log(seconds) / self.BIN)] += 1
            self.n += 1

    def median(self) -> float | None:
        """The median step (the lower median of an even count), None before any step."""
        if not self.n:
            return None
        seen, half = 0, (self.n + 1) // 2
        for key in sorted(self.counts):
            seen += self.counts[key]
            if seen >= half:
                return math.exp(key * self.BIN)
        raise AssertionError("counts add up to n")


class StepTimer:
    """The one clock of the training loop, read at chunk boundaries (after the pipeline is drained):
    all training time (the summary's samples_per_s and elapsed_s) and, apart, the seconds and steps
    after warm-up outside profiled chunks (the prediction check); `per_step`: the backend's steps
    finish on the host, so each one is timed too and the measured step is their median."""

    MIN_PER_STEP = 5  # fewer timed steps than this: the chunks' mean

    def __init__(self, first_step: int, steps: int, per_step: bool = False) -> None:
        self.warm_step = first_step + warmup_steps(steps - first_step)
        self.total_s = 0.0  # every finished chunk
        self.seconds = 0.0  # after warm-up, timed chunks only
        self.steps = 0
        self.per_step = StepMedian() if per_step else None
        self._start: float | None = None  # the running chunk's start
        self._timed = False
        self._t0: float | None = None
        self._s0 = 0
        self._last: float | None = None  # the end of the previous timed step (per-step timing)

    def chunk_start(self, step: int, timed: bool = True) -> None:
        """A chunk begins at `step` (just after a sync point); `timed=False`: not in the measured steps."""
        self._start = time.perf_counter()
        self._timed = timed
        self._t0, self._s0 = (self._start, step) if timed and step >= self.warm_step else (None, step)
        self._last = self._t0

    def after_step(self, step: int) -> None:
        """`step` steps are done; at the warm-up boundary the clock starts (a host read, no sync)."""
        if not self._timed:
            return
        if step == self.warm_step:
            self._t0, self._s0 = time.perf_counter(), step
            self._last = self._t0
        elif self.per_step is not None and self._last is not None:
            now = time.perf_counter()
            self.per_step.add(now - self._last)
            self._last = now

    def chunk_end(self, step: int) -> None:
        """The chunk ended at `step` and the device is drained: count its time."""
        now = time.perf_counter()
        if self._start is not None:
            self.total_s += now - self._start
        if self._t0 is not None and step > self._s0:
            self.seconds += now - self._t0
            self.steps += step - self._s0
        self._start = self._t0 = self._last = None

    def elapsed_s(self) -> float:
        """Training time so far, the running chunk included."""
        running = time.perf_counter() - self._start if self._start is not None else 0.0
        return self.total_s + running

    @property
    def mean_step_s(self) -> float | None:
        """Timed seconds per timed step on this rank, None if no step ran after warm-up."""
        return self.seconds / self.steps if self.steps else None

    @property
    def step_s(self) -> float | None:
        """The measured step on this rank: the median step where steps are timed one by one (and enough
        ran), else the mean; None if no step ran after warm-up."""
        if self.per_step is not None and self.per_step.n >= self.MIN_PER_STEP:
            return self.per_step.median()
        return self.mean_step_s


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


PHASES = ("forward", "backward", "optimizer")
LABEL = "anyrec.{}"  # the record_function name of each phase
STEP_EVENT = "ProfilerStep"  # torch.profiler's range around each profiled step ("ProfilerStep*" or "#N")
COLLECTIVE_PREFIX = "c10d::"  # torch.distributed's collective ops as the profiler names them
# torchrec's ranges around waiting for a collective's result: "## <Awaitable> wait() ##" and the
# all-to-all autograd functions' "All2All_Pooled_Wait" / "..._WaitBackward".
WAIT_MARKS = ("wait()", "_Wait")
COMMS_KERNELS = ("nccl", "rccl")  # device kernels of the collectives libraries
# One step to start up in (it pays the profiler's set-up and, after a drain, the pipeline's refill)
PROFILER_WARMUP_STEPS = 1
KEYS = ("step", *PHASES, "other", "collectives", "device_compute", "device_comms")


def phase(name: str):
    """The profiler range of step phase `name` (one of PHASES); cheap when no profiler runs."""
    return record_function(LABEL.format(name))


def breakdown_window(steps: int, warm_step: int, breakdown_steps: int) -> int:
    """The first step of the profiled window (its warm-up step included) of a run that ends at `steps`
    and times from `warm_step`; ValueError without room for it and a timed step before it."""
    first = steps - breakdown_steps - PROFILER_WARMUP_STEPS
    if first <= warm_step:
        raise ValueError(f"trainer.breakdown_steps={breakdown_steps} needs trainer.steps > "
                         f"{warm_step + breakdown_steps + PROFILER_WARMUP_STEPS} (warm-up, timed steps, the "
                         f"profiler's own warm-up step, then the profiled steps); got {steps}")
    return first


class StepProfiler(profile):
    """torch.profiler over `steps` steps after one warm-up step; `step()` after each training step."""

    def __init__(self, steps: int, device_type: str) -> None:
        # the device's own activity where torch's profiler has one for its type and can record it here
        # (CUDA and ROCm, XPU, MTIA, HPU); other devices: host activity only
        device = getattr(ProfilerActivity, device_type.upper(), None)
        super().__init__(activities=list({ProfilerActivity.CPU} | ({device} & supported_activities())),
                         schedule=schedule(wait=0, warmup=PROFILER_WARMUP_STEPS, active=steps, repeat=1))
        self.steps = steps
        self._device = device_type != "cpu"

    def report(self, info: DistInfo, perf: Perf | None) -> dict[str, Any]:
        """Stop; every rank's ms per step by phase beside the plan's `perf` (logged on rank 0; collective)."""
        self.__exit__(None, None, None)
        per_rank = gather_objects(self.ms_per_step(), info)
        predicted = predicted_phases(perf)
        if info.is_main:
            logger.info("step breakdown over the last %d steps (torch.profiler; collectives are part of "
                        "the phases they ran in):\n%s", self.steps, format_breakdown(per_rank, predicted))
        return {"steps": self.steps, "per_rank": per_rank, "predicted": predicted}

    def ms_per_step(self) -> dict[str, float]:
        """Milliseconds per profiled step in each of KEYS (after the profiler stopped)."""
        events = self.events()
        totals = dict.fromkeys(KEYS, 0.0)
        steps = 0
        labels = {LABEL.format(p): p for p in PHASES}
        # The training thread is the one that runs the steps; collectives' own threads (gloo's) are not it.
        thread = next((e.thread for e in events if e.name.startswith(STEP_EVENT)), None)
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU:
                if e.thread != thread:
                    continue
                if e.name.startswith(STEP_EVENT):
                    totals["step"] += e.cpu_time_total
                    steps += 1
                elif e.name in labels:
                    totals[labels[e.name]] += e.cpu_time_total
                if _is_comms(e.name) and not _inside_comms(e):
                    totals["collectives"] += e.cpu_time_total
            elif self._device:
                kind = "device_comms" if any(k in e.name.lower() for k in COMMS_KERNELS) else "device_compute"
                totals[kind] += e.device_time_total
        if steps == 0:
            return dict.fromkeys(KEYS, 0.0)
        totals["other"] = max(0.0, totals["step"] - sum(totals[p] for p in PHASES))
        return {k: v / steps / 1e3 for k, v in totals.items()}  # the profiler counts microseconds


def _is_comms(name: str) -> bool:
    """Whether a profiler range issues a collective or waits for one."""
    return name.startswith(COLLECTIVE_PREFIX) or any(m in name for m in WAIT_MARKS)


def _inside_comms(event: Any) -> bool:
    """Whether a comms range runs inside another (counted there)."""
    parent = event.cpu_parent
    while parent is not None:
        if _is_comms(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def predicted_phases(perf: Perf | None) -> dict[str, float] | None:
    """The plan's milliseconds per step of the rank it predicts slowest, in the phases it models."""
    if perf is None:
        return None
    return {"step": perf.total_s * 1e3, "forward": (perf.fwd_compute_s + perf.fwd_comms_s) * 1e3,
            "backward": (perf.bwd_compute_s + perf.bwd_comms_s) * 1e3, "collectives": perf.comms_s * 1e3}


def format_breakdown(per_rank: list[dict[str, float]], predicted: dict[str, float] | None) -> str:
    """A table: one row per rank, the plan's prediction last."""
    cols = [k for k in KEYS if any(r[k] for r in per_rank) or k in ("step", *PHASES, "other")]
    lines = ["ms/step  " + " ".join(f"{k:>14}" for k in cols)]
    for i, r in enumerate(per_rank):
        lines.append(f"rank {i:<3} " + " ".join(f"{r[k]:>14.3f}" for k in cols))
    if predicted is not None:
        lines.append("plan     " + " ".join(f"{predicted[k]:>14.3f}" if k in predicted else f"{'-':>14}"
                                            for k in cols))
    return "\n".join(lines)
