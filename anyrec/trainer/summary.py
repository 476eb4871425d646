"""What one `Trainer.train()` call accumulates between its steps, where its numbers go, and the JSON
summary it returns (README documents the summary's keys).

Train and eval records go to `<run_dir>/metrics.jsonl` (one JSON object per line) and TensorBoard
events to `<run_dir>/tb/` when the `tensorboard` package is installed (a warning says so when it is
not), from rank 0 only; a progress bar shows the steps.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from anyrec.history.cache import FAR_MISS, reject_entry
from anyrec.history.steplearn import Correction, ObservedSteps, describe
from anyrec.io_checks import LinkError, open_nofollow
from anyrec.runtime.distributed import DistInfo, gather_objects
from anyrec.trainer.memcheck import memory_check
from anyrec.trainer.perfcheck import StepProfiler, StepTimer, prediction_check

if TYPE_CHECKING:
    from anyrec.planner.memory import MemoryPrediction
    from anyrec.planner.types import Perf

logger = logging.getLogger(__name__)


class LossWindow:
    """The last `size` losses, kept on the device: adding one never waits for the device; `mean()`
    (the finite ones' mean, NaN when none is finite) reads it back once."""

    def __init__(self, size: int, device: torch.device) -> None:
        self._buf = torch.full((size,), math.nan, dtype=torch.float32, device=device)
        self._next = 0

    def add(self, loss: torch.Tensor) -> None:
        self._buf[self._next % len(self._buf)] = loss.detach().float()
        self._next += 1

    def mean(self) -> float:
        finite = torch.isfinite(self._buf)
        total, count = torch.stack([torch.where(finite, self._buf, 0.0).sum(), finite.sum()]).tolist()
        return total / count if count else math.nan


class MetricWriter:
    """Scalars by step to JSONL and TensorBoard; a no-op on ranks other than 0 or without a run dir."""

    def __init__(self, run_dir: str | None, enabled: bool, tensorboard: bool = True) -> None:
        self._jsonl: Any = None
        self._tb: Any = None
        if not enabled or not run_dir:
            return
        path = Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        self._jsonl = open_nofollow(path / "metrics.jsonl", "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning("tensorboard is not installed: TensorBoard logging is off "
                               "(pip install tensorboard, or set trainer.tensorboard=false)")
            else:
                if (path / "tb").is_symlink():
                    raise LinkError(f"{path / 'tb'} is a symbolic link: anyrec does not write through links "
                                    "(remove it)")
                # TensorBoard opens its event file without O_NOFOLLOW: a random suffix makes its name one
                # nobody can plant a link at in advance.
                self._tb = SummaryWriter(log_dir=str(path / "tb"), filename_suffix=f".{secrets.token_hex(8)}")

    def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
        """One record: `kind` is "train" or "eval"; numeric values also go to TensorBoard."""
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "kind": kind, "time": time.time(), **values}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        for out in (self._jsonl, self._tb):
            if out is not None:
                out.close()
        self._jsonl = self._tb = None


@dataclass(frozen=True)
class JobFacts:
    """What the summary says of the job, fixed once the Trainer is built."""

    backend: str
    embedding_kernel: str
    dist: DistInfo
    batch_size: int  # per rank
    sharding_group_size: int  # the ranks each table is sharded over (the world in 1D)
    step_key: str | None = None  # where this workload's measured steps are learnt (rank 0; None: nowhere)
    hardware_file: str = ""  # the hardware file the plan's figures came from ("" = the datasheet's)
    correction: Correction = Correction()  # what earlier runs of this workload here measured (agreed)


@dataclass
class Outcome:
    """What a finished `train()` hands to the summary, read from the trainer once."""

    step: int
    final_loss: float | None
    train_loss: float | None
    eval_result: dict[str, float] | None
    skipped_batches: int
    malformed_rows: int
    resumed_from: int | None
    stopped_by: str | None  # SIGINT/SIGTERM, or None
    predicted_perf: Perf | None  # the plan's slowest rank, None where nothing predicted it
    predicted_memory: list[MemoryPrediction] | None  # each rank's peak, the data's resident bytes included
    peak_allocated_bytes: int | None  # this rank's; None where the backend does not measure it
    peak_reserved_bytes: int | None
    weights_sha256: str | None = None  # where trainer.fingerprint_weights asked for it


@dataclass
class RunState:
    """The loop's companions, built once per Trainer: loss window, progress bar, the one clock, the
    profiled window, and where the records go."""

    start_step: int
    window: LossWindow  # the last `log_every` losses, on the device
    timer: StepTimer
    bar: tqdm  # steps, rate and ETA on stderr (showing nothing where progress is off)
    writer: MetricWriter
    samples_per_step: int  # over all ranks
    is_main: bool
    last_checkpoint: Path | None = None
    profile_at: int | None = None  # the step where the breakdown's profiled window starts
    profiler: StepProfiler | None = None  # while the window runs
    flushed_at: int | None = None  # the step of the last deferred-check flush

    @classmethod
    def begin(cls, step: int, steps: int, log_every: int, device: torch.device, writer: MetricWriter,
              samples_per_step: int, is_main: bool, progress: bool, per_step_timing: bool = False,
              ) -> RunState:
        """A fresh state at `step` of `steps` (with a progress bar on rank 0 when `progress`; each step
        timed alone where `per_step_timing`: the backend queues no device work)."""
        bar = tqdm(total=steps, initial=step, desc="train", unit="step", file=sys.stderr,
                   dynamic_ncols=True, mininterval=0.5, disable=not (is_main and progress))
        timer = StepTimer(step, steps, per_step_timing)
        return cls(step, LossWindow(max(1, log_every), device), timer, bar, writer, samples_per_step, is_main)


def log_train(run: RunState, step: int, lr_factor: float, dense_lr: float, embedding_lr: float) -> None:
    """A train record at `step`: the window's mean loss (one host read), the rate so far and the
    learning rates (the base rates times `lr_factor`)."""
    mean = run.window.mean()
    if math.isnan(mean):
        return
    run.bar.set_postfix(loss=f"{mean:.4f}", refresh=False)
    rate = run.samples_per_step * (step - run.start_step) / max(run.timer.elapsed_s(), 1e-9)
    if run.is_main:  # under a progress bar (which shows the loss), in the log file only
        level = logging.INFO if run.bar.disable else logging.DEBUG
        logger.log(level, "step %d loss %.5f", step, mean)
    run.writer.write(step, "train", {
        "loss": mean, "samples_per_s": rate, "lr_factor": lr_factor,
        "dense_lr": dense_lr * lr_factor, "embedding_lr": embedding_lr * lr_factor})


def log_eval(run: RunState, step: int, result: dict[str, float]) -> None:
    """An eval record (and a log line on rank 0)."""
    run.writer.write(step, "eval", result)
    if run.is_main:
        logger.info("step %d eval %s", step, " ".join(f"{k} {v:.5f}" for k, v in result.items()))


def run_summary(job: JobFacts, run: RunState, out: Outcome) -> dict[str, Any]:
    """The run's JSON summary: its figures, the prediction check (the model's step times the correction
    read at set-up), the step breakdown where one was profiled, the weights' fingerprint where asked
    (collectives: every rank calls it). It reads and writes no file: `remember_run` writes back."""
    dist, correction = job.dist, job.correction
    summary = _figures(job, run, out)
    per_rank_s = gather_objects(run.timer.step_s, dist)
    model_s = out.predicted_perf.total_s if out.predicted_perf else None
    summary.update(prediction_check(model_s * correction.factor if model_s else None, per_rank_s,
                                    log=dist.is_main))
    summary.update(model_step_ms=model_s * 1e3 if model_s else None, step_correction=correction.factor,
                   step_correction_runs=correction.runs)
    summary["measured_steps"] = run.timer.steps  # this rank's timed steps (the same on every rank)
    summary["measured_step_statistic"] = "median" if run.timer.per_step is not None else "mean"
    summary.update(memory_check(out.predicted_memory, gather_objects(out.peak_allocated_bytes, dist),
                                log=dist.is_main, measured_reserved=gather_objects(out.peak_reserved_bytes,
                                                                                   dist)))
    if run.profiler is not None:
        profiler, run.profiler = run.profiler, None  # stopped here, not again on the way out
        summary["step_breakdown_ms"] = profiler.report(dist, out.predicted_perf)
    if out.weights_sha256 is not None:
        summary["weights_sha256"] = out.weights_sha256
    return summary


def learnt_correction(step_key: str | None, model_s: float | None, dist: DistInfo) -> Correction:
    """Rank 0's correction for this workload on this machine, read once at set-up (every rank gets it:
    a collective)."""
    correction = Correction()
    if step_key is not None and model_s:
        correction = ObservedSteps().correction(step_key)
        if correction.runs:
            logger.info("%s", describe(correction, model_s, step_key.rsplit("/", 1)[1]))
    return gather_objects(correction, dist)[0]


def remember_run(job: JobFacts, summary: dict[str, Any], out: Outcome) -> None:
    """What this run teaches the machine, written back once (rank 0): its measured step for the next
    prediction, and a cache entry whose prediction missed by more than FAR_MISS set aside."""
    if not job.dist.is_main:
        return
    model_s = out.predicted_perf.total_s if out.predicted_perf else None
    if not out.stopped_by:  # a run stopped early teaches nothing
        _record_step(job.step_key, summary["measured_step_ms"], model_s)
    _reject_far_miss(job.hardware_file, model_s, summary["measured_step_ms"])


def _reject_far_miss(entry: str, model_s: float | None, measured_ms: float | None) -> None:
    """A calibration cache entry whose prediction misses the measured step by more than FAR_MISS times
    (forged, or measured on another machine's terms): named in a warning and not used again."""
    if not entry or not model_s or not measured_ms:
        return
    ratio = model_s * 1e3 / measured_ms
    if 1 / FAR_MISS <= ratio <= FAR_MISS:
        return
    reason = (f"it predicted {model_s * 1e3:.2f} ms per step and this run measured {measured_ms:.2f} ms "
              f"({ratio:.3g}x)")
    try:
        rejected = reject_entry(entry, reason)
    except (OSError, ValueError) as e:
        logger.warning("calibration cache entry %s: %s, but it could not be marked rejected: %s",
                       entry, reason, e)
        return
    if rejected:
        logger.warning("calibration cache entry %s: %s: its figures are not this machine's; it is not used "
                       "again (the next hardware=auto run measures again)", entry, reason)


def _record_step(key: str | None, measured_ms: float | None, model_s: float | None) -> None:
    """Rank 0 writes this run's measured step back to the machine's cache (a run too short to time
    teaches nothing)."""
    if key is None or not measured_ms or not model_s:
        return
    try:
        ObservedSteps().record(key, measured_ms / 1e3, model_s)
    except (OSError, ValueError) as e:  # a read-only cache still trains; the next run learns nothing
        logger.warning("the measured step was not written back to the calibration cache: %s", e)


def _figures(job: JobFacts, run: RunState, out: Outcome) -> dict[str, Any]:
    samples = (out.step - run.start_step) * run.samples_per_step
    elapsed_s = run.timer.total_s
    return {
        "steps": out.step,
        "samples_per_s": samples / elapsed_s if elapsed_s > 0 else None,
        "train_loss": out.train_loss,
        "final_loss": out.final_loss,
        **{f"eval_{k}": out.eval_result[k] if out.eval_result else None
           for k in ("auc", "ne", "logloss", "accuracy")},
        "backend": job.backend,
        "embedding_kernel": job.embedding_kernel,
        "world_size": job.dist.world_size,
        "sharding_group_size": job.sharding_group_size,
        "hosts": job.dist.hosts,
        "local_world_size": job.dist.local_world_size,
        "batch_size_per_rank": job.batch_size,
        "elapsed_s": elapsed_s,
        "peak_memory_bytes": out.peak_allocated_bytes,  # null where not measured
        "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "skipped_batches": out.skipped_batches,
        "data_malformed_rows": out.malformed_rows,
        "resumed_from_step": out.resumed_from,
        "checkpoint": str(run.last_checkpoint) if run.last_checkpoint else None,
        "stopped_by": out.stopped_by,
    }
