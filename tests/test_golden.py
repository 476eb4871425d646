"""The stored loss baseline: model=dlrm_tiny, 20 steps, fixed seed, one file per optimizer.

A failure means the numerics moved. If that was the point of the change, regenerate the files with
`python scripts/update_golden_losses.py` and say in the commit message why the losses moved.
"""

from __future__ import annotations

import json

import pytest

from anyrec.parity import train_losses
from anyrec.trainer.optim import OPTIMIZERS

from .golden import GOLDEN_DIR, STEPS, golden_overrides

# fp32 reduction order may differ between CPUs (SIMD width, thread count); 20 steps stay far inside
LOSS_RTOL = 1e-5


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_losses_match_the_golden_trajectory(optimizer):
    stored = json.loads((GOLDEN_DIR / f"dlrm_tiny_{optimizer}.json").read_text())
    assert stored["overrides"] == golden_overrides(optimizer), \
        "the golden job changed: regenerate with scripts/update_golden_losses.py"
    assert len(stored["losses"]) == STEPS
    losses = train_losses(stored["overrides"])
    assert len(losses) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, stored["losses"], strict=True))
    assert worst <= LOSS_RTOL, f"per-step loss off the golden trajectory by {worst:.2e} (relative)"
    assert losses[-1] < losses[0]  # the job learns: a baseline of a broken run would be worthless
