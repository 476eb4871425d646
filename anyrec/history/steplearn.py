"""What each training run's measured step teaches the next run's prediction on the same machine.

A calibration measures primitives; a real workload on a real (perhaps shared) host still runs slower or
faster than the model says. Every run that planned with a calibrated hardware file records, in the
calibration cache folder (`$ANYREC_CACHE_DIR/observed-steps.json`), the ratio of its measured step
(slowest rank, after warm-up) to the model's prediction, under a key made of that hardware file, the
workload's shape (model, batch per rank, optimizer, embedding kernel, world size, ranks per host) and
the host's load when the run started (quiet, busy, or unknown). The next run of the same key predicts
the model's step times a factor learnt from the last `KEEP` ratios, and says so in one line: their
median, shrunk toward 1 by as much as one more run at the model's own figure would (a geometric weight
n / (n + 1) on the median's logarithm). One run on a shared host measures its step 20 % off the next
one's now and then; a calibrated model is already close on the machine it measured, so one ratio moves
the prediction half way and five move it five sixths. Nothing else changes: the plan, the numbers
trained, the model's own figures (`model_step_ms` in the summary).

Concurrent jobs update the file under an exclusive lock (`fcntl.flock` on a lock file beside it) and
replace it whole; a damaged or oversized file is ignored (and replaced by the next record).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anyrec.config import AnyrecConfig, Precision
from anyrec.history.cache import cache_dir
from anyrec.history.trust import BUSY_OTHER_CORES
from anyrec.io_checks import atomic_write, open_nofollow
from anyrec.safe_load import load_json

if TYPE_CHECKING:
    from anyrec.backends import Hardware

logger = logging.getLogger(__name__)

FILE = "observed-steps.json"
KEEP = 5  # ratios kept per key: the median of a few runs, so one disturbed run does not swing it
MAX_KEYS = 500  # the oldest keys go beyond this


@dataclass(frozen=True)
class Correction:
    """The factor the model's step is multiplied by and how many earlier runs it comes from (0: none)."""

    factor: float = 1.0
    runs: int = 0


def _calibrated_file(source: str) -> Path | None:
    """The hardware file a job planned with (`Hardware.measured_by`), where it is one a calibration
    measured."""
    path = Path(source).expanduser()
    try:
        if path.suffix in (".yaml", ".yml") and path.is_file() and "measurements:" in path.read_text():
            return path
    except OSError:
        pass
    return None


def load_class(other_cores: float | None) -> str:
    """quiet / busy / unknown, from the cores' worth of time other processes took at the run's start."""
    if other_cores is None:
        return "unknown"
    return "busy" if other_cores > BUSY_OTHER_CORES else "quiet"


def run_key(cfg: AnyrecConfig, hardware: Hardware, batch_per_rank: int, kernel: str, precision: Precision,
            world_size: int, local_world_size: int, other_cores: float | None,
            sharding_group_size: int | None = None) -> str | None:
    """The key of this run's observations, or None when it did not plan with a calibrated file (`hardware`:
    what it planned with, a `hardware.sku` file or the calibration on first contact's cache entry;
    `precision`: the dense part's, as the job resolved it and the plan costed it; a `sharding_group_size`
    under the world size: a 2D job, whose steps are its own)."""
    hw = _calibrated_file(hardware.measured_by)
    if hw is None:
        return None
    shape = {"model": dataclasses.asdict(cfg.model), "batch_per_rank": batch_per_rank,
             "optim": cfg.optim.name, "kernel": kernel, "precision": str(precision), "world_size": world_size,
             "local_world_size": local_world_size, "pipeline": cfg.trainer.pipeline,
             "hardware_sha256": hashlib.sha256(hw.read_bytes()).hexdigest(),
             "hardware_spec": cfg.hardware.spec,
             **({"sharding_group_size": sharding_group_size}
                if sharding_group_size not in (None, world_size) else {})}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{digest}/{load_class(other_cores)}"


class ObservedSteps:
    """The observations file of one cache folder (default: `anyrec.history.cache.cache_dir()`)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.path = (directory or cache_dir()) / FILE

    def correction(self, key: str) -> Correction:
        """The key's last runs' median ratio shrunk toward 1 by weight n / (n + 1) on its logarithm
        (none yet: factor 1)."""
        ratios = [o["ratio"] for o in self._read().get(key, [])]
        if not ratios:
            return Correction()
        ordered, n = sorted(ratios), len(ratios)
        mid = n // 2
        median = ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        return Correction(median ** (n / (n + 1)), n)

    def record(self, key: str, measured_s: float, model_s: float) -> None:
        """Add one run's measured / model ratio under `key` (locked against concurrent jobs)."""
        if not (measured_s > 0 and model_s > 0 and math.isfinite(measured_s / model_s)):
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            data = self._read()
            runs = [*data.pop(key, []), {"ratio": measured_s / model_s, "measured_ms": measured_s * 1e3,
                                          "model_ms": model_s * 1e3, "time": time.time()}][-KEEP:]
            data[key] = runs  # last in the dict: the most recently used key
            while len(data) > MAX_KEYS:
                data.pop(next(iter(data)))
            with atomic_write(self.path) as f:
                json.dump(data, f)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open_nofollow(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _read(self) -> dict[str, list[dict[str, Any]]]:
        """The file's observations; {} when it is missing or not what this module writes."""
        if not self.path.exists():
            return {}
        try:
            data = load_json(self.path, "the observed steps")
        except (ValueError, OSError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, list) and all(
            isinstance(o, dict) and isinstance(o.get("ratio"), int | float) and math.isfinite(o["ratio"])
            and o["ratio"] > 0 for o in v)}


def describe(correction: Correction, model_s: float, load: str) -> str:
    """The log line of a corrected prediction."""
    return (f"step prediction: {model_s * 1e3:.2f} ms from the cost model x {correction.factor:.2f}, the "
            f"median measured/model ratio of {correction.runs} earlier run(s) of this workload on this "
            f"machine ({load} host), weighted {correction.runs}/{correction.runs + 1} against the model "
            f"= {model_s * correction.factor * 1e3:.2f} ms")
