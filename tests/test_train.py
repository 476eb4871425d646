"""End to end: torchrun + Hydra overrides train a few steps; the summary contract holds."""

from __future__ import annotations

import json
import math
import sys

import pytest

from .conftest import ROOT, last_json_line, torchrun
from .test_readme import summary_example

pytestmark = pytest.mark.integration  # every test here starts processes


@pytest.mark.cpu_only  # expects backend "cpu" and two ranks on one host
def test_torchrun_trains_and_prints_summary(tmp_path):
    proc = torchrun(
        ["-m", "anyrec.train", "model=dlrm_tiny", "trainer.steps=60", "trainer.seed=7",
         "trainer.log_every=10", "trainer.eval_steps=4", "data.batch_size=128",
         f"hydra.run.dir={tmp_path}/run"],
        nproc=2, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = last_json_line(proc.stdout)
    assert list(summary) == list(summary_example())  # the README shows every key, in order
    assert summary["steps"] == 60 and summary["world_size"] == 2 and summary["backend"] == "cpu"
    assert summary["samples_per_s"] > 0 and math.isfinite(summary["final_loss"])
    assert 0.5 < summary["eval_auc"] <= 1.0
    # The loss falls: the last window is well below the first logged window (in the log file: the
    # console has the progress bar).
    log = (tmp_path / "run" / "train_rank0.log").read_text()
    first = [ln for ln in log.splitlines() if "step 10 loss" in ln]
    assert first and "step 10 loss" not in proc.stdout, log[-2000:]
    first_loss = float(first[0].rsplit(" ", 1)[-1])
    assert summary["train_loss"] < first_loss
    # One run directory: .hydra from rank 0, a log file per rank.
    run = tmp_path / "run"
    assert (run / ".hydra" / "config.yaml").is_file()
    assert {p.name for p in run.glob("*.log")} == {"train_rank0.log", "train_rank1.log"}
    # Rank 0's metric logs: one JSONL record per logging step and eval, and TensorBoard events.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("split", r.get("kind")) == "train"][:2] == [10, 20]
    assert list((run / "tb").glob("events.out.tfevents.*"))


def test_unknown_key_fails_clearly(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "anyrec.train", "trainer.bogus=1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    assert "bogus" in proc.stderr
