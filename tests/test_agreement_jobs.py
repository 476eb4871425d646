"""Ranks slowed at decision points (ANYREC_DELAY_DECISIONS: a delay before a rank forms its view of a
decision) still take every decision together. Rank 1, slow before it estimates a pass of the
calibration's step points, would train them with fewer steps than rank 0 by its own clock (then wait in
another collective); with the estimate agreed (the slowest rank's), both ranks train the same steps, and
the job finishes. Rank 0, slow before a training stop check, only makes rank 1 wait."""

from __future__ import annotations

import time

import pytest
import yaml

from .conftest import last_json_line, torchrun


@pytest.mark.deadline
@pytest.mark.integration
def test_ranks_slowed_at_decision_points_still_finish(tmp_path):
    env = {"ANYREC_CACHE_DIR": str(tmp_path / "cache"), "ANYREC_CALIBRATE": "auto",
           # rank 1's estimate of a pass, 2 x (its warm-up + 30 s) x 10 points (a third at fewer steps), is
           # more than the time left of 120 s; rank 0's, from its warm-up alone, fits
           "ANYREC_DELAY_DECISIONS": "1:30:step points: pass time;0:3:stop after step 10;1:0.05"}
    args = ["-m", "anyrec.train", "model=dlrm_tiny", "trainer.steps=20", "trainer.eval_steps=0",
            "backend.bind_cores=false", "calibrate.time_limit_s=120", "trainer.progress=false",
            "trainer.tensorboard=false", f"hydra.run.dir={tmp_path / 'run'}"]
    start = time.monotonic()
    proc = torchrun(args, nproc=2, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert summary["steps"] == 20 and summary["world_size"] == 2
    out = proc.stdout + proc.stderr
    assert "calibration: cache miss, measured in" in out
    # both ranks trained the step points as rank 1's estimate planned them: 10 steps each, not rank 0's 40
    (entry,) = (tmp_path / "cache").glob("*.yaml")
    m = yaml.safe_load(entry.read_text())["measurements"]
    assert (m.get("step") or m["step_unused"])["steps_per_point"] == 10
    assert "disagree" not in out and "did not reach decision" not in out
    assert time.monotonic() - start < 300
