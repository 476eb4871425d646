"""An embedding implementation added from outside anyrec (tests/ext_impl_pkg, installed with pip into a
temporary target and found through the `anyrec.impls` entry point) is planned, sharded and trained on 2
ranks like a built-in one, with no edit to anyrec."""

from __future__ import annotations

import math

import pytest

from anyrec.backends import dispatch
from anyrec.plan import run
from anyrec.planner.report import plan_json

from .conftest import ROOT, compose_config, last_json_line, pip_install_target, torchrun


@pytest.fixture(scope="module")
def ext_path(tmp_path_factory):
    return pip_install_target(ROOT / "tests" / "ext_impl_pkg", tmp_path_factory.mktemp("ext_impl"))


@pytest.fixture
def ext_registered(ext_path, monkeypatch, fresh_impls):
    monkeypatch.syspath_prepend(str(ext_path))


def test_the_planner_costs_it_from_its_own_record(ext_registered):
    impl = dispatch.get_impl("embedding", "ext_tbe")
    assert impl.profile.source == "made up for the registry test"
    _, cfg = compose_config(["model=dlrm_tiny", "hardware=h100", "topology.world_size=2",
                             "backend.embedding_kernel=ext_tbe"])
    lines: list[str] = []
    ext = run(cfg, print_fn=lines.append)
    assert "kernel ext_tbe" in lines[0]
    assert {t["kernel"] for t in plan_json(ext)["tables"]} == {"fused_triton"}
    assert {o.placement.value for o in ext.tables.values()} == {"hbm"}
    _, cfg = compose_config(["model=dlrm_tiny", "hardware=h100", "topology.world_size=2",
                             "backend.embedding_kernel=torch"])
    torch_plan = run(cfg, print_fn=lambda s: None)
    # Its profile (40% of HBM bandwidth, 64-byte rows) is not torch's (28%, 32): the costs differ.
    lookups = [sum(o.total_perf_s for o in p.tables.values()) for p in (ext, torch_plan)]
    assert lookups[0] != pytest.approx(lookups[1], rel=1e-3)


@pytest.mark.integration
def test_two_ranks_train_through_it(ext_path, tmp_path):
    run_dir = tmp_path / "run"
    proc = torchrun(
        ["-m", "anyrec.train", "model=dlrm_tiny", "backend.embedding_kernel=ext_tbe", "trainer.steps=4",
         "trainer.eval_steps=0", "trainer.progress=false", "planner.sharding=row_wise",
         f"hydra.run.dir={run_dir}"],
        nproc=2, cwd=tmp_path, timeout=180, env={"PYTHONPATH": str(ext_path)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = last_json_line(proc.stdout)
    assert summary["embedding_kernel"] == "ext_tbe" and summary["world_size"] == 2 and summary["steps"] == 4
    assert math.isfinite(summary["final_loss"])
    log = (run_dir / "train_rank0.log").read_text()
    assert "op embedding -> ext_tbe (forced by backend.embedding_kernel)" in log
    assert "ext_tbe sharder: 26 tables (fused_triton)" in proc.stderr + log
    plan_text = log[log.index("torchrec sharding plan"):]
    assert "row_wise" in plan_text and "fused_triton" in plan_text and "'fused'" not in plan_text
