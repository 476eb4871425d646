"""The stored loss baseline: every golden job (tests/golden/) runs through anyrec-train's own loop
(`Trainer.train()`) and must reproduce its stored per-step losses.

A failure means the numerics moved. If that was the point of the change, regenerate the files with
`python scripts/update_golden_losses.py` and say in the commit message why the losses moved.
"""

from __future__ import annotations

import json

import pytest

from .golden import JOBS, STEPS, GoldenJob, job_losses

# fp32 reduction order may differ between CPUs (SIMD width, thread count); 20 steps stay far inside
LOSS_RTOL = 1e-5


def _check(name: str, job: GoldenJob | None = None) -> None:
    """`job` (default: the golden job `name`) reproduces the stored losses of `name`."""
    stored = json.loads(JOBS[name].path.read_text())
    assert stored["overrides"] == JOBS[name].overrides and stored.get("nproc", 1) == JOBS[name].nproc, \
        "the golden job changed: regenerate with scripts/update_golden_losses.py"
    assert len(stored["losses"]) == STEPS
    losses = job_losses(job or JOBS[name])
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


@pytest.mark.integration
def test_fbgemms_kernel_follows_the_schedule_as_the_torch_kernel_does():
    """The learning-rate schedule job on FBGEMM's TBE gives the golden trajectory recorded on anyrec's torch
    TBE: both fused optimizers update the rows at the rate the schedule set for the step (handed to the
    kernel at zero_grad, before the backward), not the previous step's."""
    job = JOBS["dlrm_tiny_lr_schedule"]
    fbgemm = [o.replace("backend.embedding_kernel=torch", "backend.embedding_kernel=fbgemm")
              for o in job.overrides]
    assert fbgemm != job.overrides
    _check(job.name, GoldenJob(job.name, fbgemm))
