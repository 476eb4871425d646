"""The stored loss baseline: how it is produced (scripts/update_golden_losses.py writes it)."""

from __future__ import annotations

from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent
STEPS = 20
SEED = 1234


def golden_overrides(optimizer: str) -> list[str]:
    """The job a golden file records: dlrm_tiny, fixed seed, CPU, anyrec's torch embedding kernel."""
    return ["model=dlrm_tiny", f"optim={optimizer}", "backend=cpu", "backend.embedding_kernel=torch",
            f"trainer.seed={SEED}", f"trainer.steps={STEPS}", "trainer.eval_steps=0",
            "trainer.progress=false", "data.batch_size=128"]
