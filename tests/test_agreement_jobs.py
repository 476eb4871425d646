"""A job whose rank 1 is slow at every decision point (ANYREC_DELAY_DECISIONS: a delay before it forms
its view of each decision) still takes every decision with rank 0: its first-contact calibration, cut
short by its time limit while the ranks' clocks disagree, and its training both finish."""

from __future__ import annotations

import pytest

from .conftest import last_json_line, torchrun


@pytest.mark.integration
def test_a_rank_slow_at_every_decision_still_finishes(tmp_path):
    env = {"ANYREC_CACHE_DIR": str(tmp_path / "cache"), "ANYREC_CALIBRATE": "auto",
           "ANYREC_DELAY_DECISIONS": "1:0.2"}
    args = ["-m", "anyrec.train", "model=dlrm_tiny", "trainer.steps=20", "trainer.eval_steps=0",
            "trainer.stop_check_every=2", "backend.bind_cores=false",
            # a limit the step points run into: the ranks decide near it with clocks 0.2 s apart
            "calibrate.time_limit_s=12", "trainer.progress=false", "trainer.tensorboard=false",
            f"hydra.run.dir={tmp_path / 'run'}"]
    proc = torchrun(args, nproc=2, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert summary["steps"] == 20 and summary["world_size"] == 2
    assert "calibration: cache miss, measured in" in proc.stdout + proc.stderr
    assert "disagree" not in proc.stderr and "did not reach decision" not in proc.stderr
