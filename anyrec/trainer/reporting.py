"""Where training numbers go: a JSONL log and TensorBoard (rank 0 only), and a progress bar.

One JSON object per line in `<run_dir>/metrics.jsonl`; TensorBoard events in `<run_dir>/tb/`
when the `tensorboard` package is installed (a warning says so when it is not).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

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
        self._jsonl = None
        self._tb = None
        if not enabled or not run_dir:
            return
        path = Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        self._jsonl = (path / "metrics.jsonl").open("a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning("tensorboard is not installed: TensorBoard logging is off "
                               "(pip install tensorboard, or set trainer.tensorboard=false)")
            else:
                self._tb = SummaryWriter(log_dir=str(path / "tb"))

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
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def progress_bar(enabled: bool, total: int, initial: int) -> tqdm:
    """A tqdm bar on stderr (rate and ETA in steps); one that shows nothing unless `enabled`."""
    return tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stderr,
                dynamic_ncols=True, mininterval=0.5, disable=not enabled)
