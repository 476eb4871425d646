"""The trainer runs on the co-design planner's plans: 2 ranks on CPU (gloo), one case per sharding type."""

from __future__ import annotations

import math

import pytest

from .conftest import last_json_line, torchrun

pytestmark = pytest.mark.integration  # every test here starts processes

SHARDINGS = ["table_wise", "row_wise", "column_wise", "data_parallel"]
# dlrm_tiny's dim 8 cannot split into column shards of at least 16 columns: widen it for that case.
EXTRA = {"column_wise": ["model.embedding_dim=32", "model.bottom_mlp=[16,32]"]}


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_trainer_runs_on_codesign_plan(tmp_path, sharding):
    run = tmp_path / "run"
    proc = torchrun(
        ["-m", "anyrec.train", "model=dlrm_tiny", "trainer.steps=10", "trainer.eval_steps=0",
         "trainer.progress=false", "planner=codesign", f"planner.sharding={sharding}",
         f"hydra.run.dir={run}", *EXTRA.get(sharding, [])],
        nproc=2, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = last_json_line(proc.stdout)
    assert summary["steps"] == 10 and summary["world_size"] == 2
    assert math.isfinite(summary["final_loss"])
    # The plan the trainer sharded with is the planner's, with the forced sharding type on every table.
    log = (run / "train_rank0.log").read_text()
    assert "co-design plan" in log
    plan_text = log[log.index("torchrec sharding plan"):]
    others = [s for s in SHARDINGS if s != sharding]
    assert sharding in plan_text and not any(s in plan_text for s in others), plan_text[:3000]
