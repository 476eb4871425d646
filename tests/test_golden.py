"""The stored loss baseline: every golden job (tests/golden/) runs through anyrec-train's own loop
(`Trainer.train()`) and must reproduce its stored per-step losses.

A failure means the numerics moved. If that was the point of the change, regenerate the files with
`python scripts/update_golden_losses.py` and say in the commit message why the losses moved.
"""

from __future__ import annotations

import json

import pytest

from .golden import JOBS, STEPS, job_losses

# fp32 reduction order may differ between CPUs (SIMD width, thread count); 20 steps stay far inside
LOSS_RTOL = 1e-5


def _check(name: str) -> None:
    job = JOBS[name]
    stored = json.loads(job.path.read_text())
    assert stored["overrides"] == job.overrides and stored.get("nproc", 1) == job.nproc, \
        "the golden job changed: regenerate with scripts/update_golden_losses.py"
    assert len(stored["losses"]) == STEPS
    losses = job_losses(job)
    assert len(losses) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, stored["losses"], strict=True))
    assert worst <= LOSS_RTOL, f"per-step loss off the golden trajectory by {worst:.2e} (relative)"
    assert losses[-1] < losses[0]  # the job learns: a baseline of a broken run would be worthless


@pytest.mark.integration
@pytest.mark.parametrize("name", [n for n, j in JOBS.items() if j.nproc == 1])
def test_losses_match_the_golden_trajectory(name):
    _check(name)


@pytest.mark.integration
@pytest.mark.parametrize("name", [n for n, j in JOBS.items() if j.nproc > 1])
def test_sharded_losses_match_the_golden_trajectory(name):
    _check(name)
