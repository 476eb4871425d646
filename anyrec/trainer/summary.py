"""What one `Trainer.train()` call accumulates between its steps, and the JSON summary it returns
(README documents the summary's keys)."""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anyrec.trainer.breakdown import StepProfiler
from anyrec.trainer.perfcheck import StepTimer
from anyrec.trainer.reporting import LossWindow

if TYPE_CHECKING:
    from anyrec.trainer.trainer import Trainer


@dataclass
class RunState:
    """The loop's companions: loss window, progress bar, the one clock, the profiled window."""

    start_step: int
    window: LossWindow  # the last `log_every` losses, on the device
    timer: StepTimer
    bar: Any = None  # a tqdm bar or None
    last_checkpoint: Path | None = None
    profile_at: int | None = None  # the step where the breakdown's profiled window starts
    profiler: StepProfiler | None = None  # while the window runs
    flushed_at: int | None = field(default=None)  # the step of the last deferred-check flush


def run_summary(trainer: Trainer, run: RunState, final_loss: float | None, train_loss: float | None,
                eval_result: dict[str, float] | None) -> dict[str, Any]:
    """The run's JSON summary."""
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
