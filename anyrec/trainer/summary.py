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

from anyrec.io_checks import LinkError, open_nofollow
from anyrec.steplearn import Correction, ObservedSteps, describe, run_key
from anyrec.trainer.distributed import gather_objects
from anyrec.trainer.fingerprint import weights_fingerprint
from anyrec.trainer.memcheck import memory_check
from anyrec.trainer.perfcheck import StepProfiler, StepTimer, prediction_check

if TYPE_CHECKING:
    from anyrec.planner.memory import MemoryPrediction
    from anyrec.trainer.trainer import Trainer

logger = logging.getLogger("anyrec.trainer.trainer")  # the trainer's own log lines


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


@dataclass
class RunState:
    """The loop's companions: loss window, progress bar, the one clock, the profiled window."""

    start_step: int
    window: LossWindow  # the last `log_every` losses, on the device
    timer: StepTimer
    bar: tqdm  # steps, rate and ETA on stderr (showing nothing where progress is off)
    last_checkpoint: Path | None = None
    profile_at: int | None = None  # the step where the breakdown's profiled window starts
    profiler: StepProfiler | None = None  # while the window runs
    flushed_at: int | None = None  # the step of the last deferred-check flush

    @classmethod
    def begin(cls, trainer: Trainer, progress: bool = False) -> RunState:
        """A fresh state at the trainer's step (with a progress bar on rank 0 when `progress`)."""
        tc, step = trainer.cfg.trainer, trainer.step
        bar = tqdm(total=tc.steps, initial=step, desc="train", unit="step", file=sys.stderr,
                   dynamic_ncols=True, mininterval=0.5, disable=not (trainer.dist.is_main and progress))
        return cls(step, LossWindow(max(1, tc.log_every), trainer.device), StepTimer(step, tc.steps), bar)


def log_train(trainer: Trainer, lr_factor: float) -> None:
    """A train record: the window's mean loss (one host read), the rate so far and the learning rates."""
    run = trainer.run
    mean = run.window.mean()
    if math.isnan(mean):
        return
    run.bar.set_postfix(loss=f"{mean:.4f}", refresh=False)
    rate = (trainer.batch_size * trainer.dist.world_size * (trainer.step - run.start_step)
            / max(run.timer.elapsed_s(), 1e-9))
    if trainer.dist.is_main:  # under a progress bar (which shows the loss), in the log file only
        level = logging.INFO if run.bar.disable else logging.DEBUG
        logger.log(level, "step %d loss %.5f", trainer.step, mean)
    optim = trainer.cfg.optim
    trainer.writer.write(trainer.step, "train", {
        "loss": mean, "samples_per_s": rate, "lr_factor": lr_factor,
        "dense_lr": optim.dense_lr * lr_factor, "embedding_lr": optim.embedding_lr * lr_factor})


def log_eval(trainer: Trainer, result: dict[str, float]) -> None:
    """An eval record (and a log line on rank 0)."""
    trainer.writer.write(trainer.step, "eval", result)
    if trainer.dist.is_main:
        logger.info("step %d eval %s", trainer.step, " ".join(f"{k} {v:.5f}" for k, v in result.items()))


def run_summary(trainer: Trainer, final_loss: float | None, train_loss: float | None,
                eval_result: dict[str, float] | None) -> dict[str, Any]:
    """The run's JSON summary: its figures, the prediction check, the step breakdown where one was
    profiled, the weights' fingerprint where asked (collectives: every rank calls it)."""
    run = trainer.run
    summary = _figures(trainer, run, final_loss, train_loss, eval_result)
    per_rank_s = gather_objects(run.timer.step_s, trainer.dist)
    perf = trainer.predicted_perf  # the plan's slowest rank, None where nothing predicted it
    model_s = perf.total_s if perf else None
    learnt = _learnt_correction(trainer, model_s)  # what earlier runs of this workload here measured
    summary.update(prediction_check(model_s * learnt[0].factor if model_s else None, per_rank_s,
                                    log=trainer.dist.is_main))
    summary.update(model_step_ms=model_s * 1e3 if model_s else None, step_correction=learnt[0].factor,
                   step_correction_runs=learnt[0].runs)
    _record_step(trainer, learnt[1], summary["measured_step_ms"], model_s)
    summary["measured_steps"] = run.timer.steps  # this rank's timed steps (the same on every rank)
    reserved = gather_objects(trainer.backend.max_memory_reserved(), trainer.dist)
    summary.update(memory_check(_predicted_memory(trainer), gather_objects(summary["peak_memory_bytes"],
                                                                           trainer.dist),
                                log=trainer.dist.is_main, measured_reserved=reserved))
    if run.profiler is not None:
        profiler, run.profiler = run.profiler, None  # stopped here, not again on the way out
        summary["step_breakdown_ms"] = profiler.report(trainer.dist, trainer.predicted_perf)
    if trainer.cfg.trainer.fingerprint_weights:
        summary["weights_sha256"] = weights_fingerprint(trainer.model, trainer.dist)
    return summary


def _learnt_correction(trainer: Trainer, model_s: float | None) -> tuple[Correction, str | None]:
    """Rank 0's correction for this workload on this machine (every rank gets it: a collective) and the
    key this run's step is recorded under (rank 0; None where nothing is learnt: no calibrated file)."""
    key, correction = None, Correction()
    if trainer.dist.is_main and model_s:
        choice = getattr(trainer.backend, "bind_choice", None)
        other = choice.load.other_cores if choice is not None and choice.load is not None else None
        key = run_key(trainer.cfg, trainer.batch_size, trainer.embedding_kernel, trainer.dist.world_size,
                      trainer.dist.local_world_size, other)
        if key is not None:
            correction = ObservedSteps().correction(key)
            if correction.runs:
                logger.info("%s", describe(correction, model_s, key.rsplit("/", 1)[1]))
    return gather_objects(correction, trainer.dist)[0], key


def _record_step(trainer: Trainer, key: str | None, measured_ms: float | None, model_s: float | None) -> None:
    """Rank 0 writes this run's measured step back to the machine's cache (a run stopped early or too
    short to time teaches nothing)."""
    stopped = trainer.stopper is not None and trainer.stopper.stopped_by
    if key is None or not measured_ms or not model_s or stopped:
        return
    try:
        ObservedSteps().record(key, measured_ms / 1e3, model_s)
    except (OSError, ValueError) as e:  # a read-only cache still trains; the next run learns nothing
        logger.warning("the measured step was not written back to the calibration cache: %s", e)


def _predicted_memory(trainer: Trainer) -> list[MemoryPrediction] | None:
    """The plan's predicted peak per rank (the data sources' resident bytes included), or None where
    nothing predicted it."""
    return trainer.predicted_memory


def _figures(trainer: Trainer, run: RunState, final_loss: float | None, train_loss: float | None,
             eval_result: dict[str, float] | None) -> dict[str, Any]:
    samples = (trainer.step - run.start_step) * trainer.batch_size * trainer.dist.world_size
    elapsed_s = run.timer.total_s
    return {
        "steps": trainer.step,
        "samples_per_s": samples / elapsed_s if elapsed_s > 0 else None,
        "train_loss": train_loss,
        "final_loss": final_loss,
        **{f"eval_{k}": eval_result[k] if eval_result else None
           for k in ("auc", "ne", "logloss", "accuracy")},
        "backend": trainer.backend.name,
        "embedding_kernel": trainer.embedding_kernel,
        "world_size": trainer.dist.world_size,
        "sharding_group_size": getattr(trainer.sharding_plan, "sharding_group_size", trainer.dist.world_size),
        "hosts": trainer.dist.hosts,
        "local_world_size": trainer.dist.local_world_size,
        "batch_size_per_rank": trainer.batch_size,
        "elapsed_s": elapsed_s,
        "peak_memory_bytes": trainer.backend.max_memory_allocated(),  # null where not measured
        "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "skipped_batches": trainer.state.skipped_batches,
        "data_malformed_rows": getattr(trainer.train_data, "malformed_rows", 0),
        "resumed_from_step": trainer.resumed_from,
        "checkpoint": str(run.last_checkpoint) if run.last_checkpoint else None,
        "stopped_by": trainer.stopper.stopped_by if trainer.stopper else None,  # SIGINT/SIGTERM, or null
    }
