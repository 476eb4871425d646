"""Run several anyrec jobs one after the other in one torchrun launch (one interpreter start and one
rendezvous for all of them), each trained by `Trainer.train()`, anyrec-train's loop.

JOBS is a JSON file {LABEL: [override, ...]}; each job runs in RUN_DIR/LABEL (its run folder), its log
in train_rank<r>.log there (as anyrec-train's log file: everyone's INFO, anyrec's DEBUG). Rank 0 writes
OUT as JSON: {LABEL: {"summary": the run summary, "losses": every step's loss averaged over the ranks,
"weights": anyrec-parity's weight record (shape and values per tensor)}}.

Usage: jobs_check.py JOBS OUT RUN_DIR
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from anyrec.parity import full_weights
from anyrec.runtime.distributed import all_reduce_mean
from anyrec.trainer.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import compose_config  # noqa: E402


def job(run_dir: Path, overrides: list[str]) -> dict:
    """Train one job; its record on rank 0 (an empty dict elsewhere)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = logging.FileHandler(run_dir / f"train_rank{os.environ.get('RANK', '0')}.log")
    log.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(log)
    try:
        return _train(run_dir, overrides)
    finally:
        logging.getLogger().removeHandler(log)
        log.close()


def _train(run_dir: Path, overrides: list[str]) -> dict:
    _, cfg = compose_config([*overrides, f"trainer.run_dir={run_dir}"])
    trainer = Trainer(cfg)
    losses: list[float] = []
    trainer.step_hooks.append(lambda t: losses.append(float(t.last_loss)))
    try:
        summary = trainer.train()
        mean = all_reduce_mean(losses, trainer.device)
        weights = full_weights(trainer.model, trainer.dist)
        is_main = trainer.dist.is_main
    finally:
        trainer.close()
    if not is_main:
        return {}
    record = {n: {"shape": list(t.shape), "values": t.reshape(-1).tolist()} for n, t in weights.items()}
    return {"summary": summary, "losses": mean, "weights": record}


def main(jobs: Path, out: Path, run_dir: Path) -> None:
    logging.getLogger().setLevel(logging.INFO)  # configs/hydra/job_logging's levels
    logging.getLogger("anyrec").setLevel(logging.DEBUG)
    spec: dict[str, list[str]] = json.loads(jobs.read_text())
    results = {label: job(run_dir / label, overrides) for label, overrides in spec.items()}
    if all(results.values()):  # rank 0
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
