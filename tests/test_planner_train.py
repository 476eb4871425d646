"""The trainer runs on the co-design planner's plans: 2 ranks on CPU (gloo), one job per sharding type,
all in one torchrun launch (tests/dist/jobs_check.py: anyrec-train's loop, one job after the other)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from .conftest import ROOT, torchrun

pytestmark = pytest.mark.integration  # every test here starts processes

SHARDINGS = ["table_wise", "row_wise", "column_wise", "data_parallel"]
# dlrm_tiny's dim 8 cannot split into column shards of at least 16 columns: widen it for that case.
EXTRA = {"column_wise": ["model.embedding_dim=32", "model.bottom_mlp=[16,32]"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """Every sharding type's job, run once in one 2-rank launch: the run folder and the records."""
    tmp = tmp_path_factory.mktemp("planner_train")
    jobs = {s: ["model=dlrm_tiny", "trainer.steps=10", "trainer.eval_steps=0", "trainer.progress=false",
                "trainer.tensorboard=false", "planner=codesign", f"planner.sharding={s}", *EXTRA.get(s, [])]
            for s in SHARDINGS}
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    script = ROOT / "tests" / "dist" / "jobs_check.py"
    proc = torchrun([str(script), str(tmp / "jobs.json"), str(tmp / "out.json"), str(tmp / "runs")], nproc=2,
                    timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return tmp / "runs", json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_trainer_runs_on_codesign_plan(runs, sharding):
    run_dir, records = runs
    summary = records[sharding]["summary"]
    assert summary["steps"] == 10 and summary["world_size"] == 2
    assert math.isfinite(summary["final_loss"])
    # The plan the trainer sharded with is the planner's, with the forced sharding type on every table.
    log = (run_dir / sharding / "train_rank0.log").read_text()
    assert "co-design plan" in log
    plan_text = log[log.index("torchrec sharding plan"):]
    others = [s for s in SHARDINGS if s != sharding]
    assert sharding in plan_text and not any(s in plan_text for s in others), plan_text[:3000]
