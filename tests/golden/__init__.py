"""The stored loss baseline: the jobs it records (scripts/update_golden_losses.py writes the files)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from anyrec.trainer.optim import OPTIMIZERS

GOLDEN_DIR = Path(__file__).resolve().parent
STEPS = 20
SEED = 1234
_CPU = ["backend=cpu", f"trainer.seed={SEED}", f"trainer.steps={STEPS}", "trainer.eval_steps=0",
        "trainer.progress=false"]


def golden_overrides(optimizer: str) -> list[str]:
    """The job a per-optimizer golden file records: dlrm_tiny, fixed seed, CPU, anyrec's torch
    embedding kernel (one rank, unsharded)."""
    return ["model=dlrm_tiny", f"optim={optimizer}", "backend=cpu", "backend.embedding_kernel=torch",
            f"trainer.seed={SEED}", f"trainer.steps={STEPS}", "trainer.eval_steps=0",
            "trainer.progress=false", "data.batch_size=128"]


@dataclass(frozen=True)
class GoldenJob:
    """One recorded job: its Hydra overrides and ranks (> 1: launched by torchrun)."""

    name: str
    overrides: list[str]
    nproc: int = 1

    @property
    def path(self) -> Path:
        return GOLDEN_DIR / f"{self.name}.json"


JOBS: dict[str, GoldenJob] = {
    **{f"dlrm_tiny_{opt}": GoldenJob(f"dlrm_tiny_{opt}", golden_overrides(opt)) for opt in OPTIMIZERS},
    # The +experiment=dlrmv2_cpu schedule (Adagrad, linear warm-up, plateau, polynomial decay,
    # gradient clipping) shrunk to 20 steps of dlrm_tiny: warm-up 4, decay from step 10 over 10.
    "dlrm_tiny_lr_schedule": GoldenJob("dlrm_tiny_lr_schedule", [
        "+experiment=dlrmv2_cpu", "model=dlrm_tiny", "backend.embedding_kernel=torch", *_CPU,
        "trainer.eval_every=0", "data.global_batch_size=128", "optim.warmup_steps=4",
        "optim.decay_start_step=10", "optim.decay_steps=10"]),
    # Two ranks, tables sharded by the planner, FBGEMM's TBE and sparse ops: the default path of a
    # multi-device job.
    "dlrm_tiny_fbgemm_2rank": GoldenJob("dlrm_tiny_fbgemm_2rank", [
        "model=dlrm_tiny", "optim=adagrad", "backend.embedding_kernel=fbgemm", *_CPU,
        "data.global_batch_size=256"], nproc=2),
}


def job_losses(job: GoldenJob) -> list[float]:
    """Run `job` through anyrec-train's loop (`Trainer.train()`, via anyrec-parity's worker for
    several ranks) and return its per-step losses, averaged over ranks."""
    from anyrec import parity
    from anyrec._hydra import compose_job
    from anyrec.trainer.trainer import Trainer

    if job.nproc == 1:  # in this process
        trainer = Trainer(compose_job([*job.overrides, *parity.STEPS_ONLY]))
        try:
            return parity.train_losses(trainer)
        finally:
            trainer.close()
    record = parity.run_variant(job.overrides, parity.Variant(job.name, nproc=job.nproc), timeout_s=600)
    if "error" in record:
        raise RuntimeError(f"golden job {job.name}: {record['error']}")
    return record["losses"]
