"""The memory model (anyrec.planner.memory): its terms add up, follow the plan, round as the allocator
does; the report prints small sizes in MB; a simdev run's summary checks the prediction."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anyrec.backends import EmbeddingCost
from anyrec.backends.dispatch import TORCH_EMBEDDING
from anyrec.backends.specs import get_sku
from anyrec.planner import CoDesignPlanner, Topology
from anyrec.planner.memory import ALLOC_ROUND_BYTES, alloc_bytes, predict_memory, touched_rows_zipf
from anyrec.planner.report import format_report, size_text
from anyrec.planner.types import InfeasiblePlanError, ShardingType, TableSpec

ROOT = Path(__file__).resolve().parent.parent
TABLES = [TableSpec("t0", 10_000, 16, 1.0, ["f0"]), TableSpec("t1", 4_000, 16, 2.0, ["f1"])]


def _plan(optimizer: str = "adagrad", sharding: str = "table_wise", world: int = 2, **kw):
    return CoDesignPlanner().plan(TABLES, Topology(get_sku("h100"), world), 256, optimizer, 5_000,
                                  allowed_shardings=(ShardingType(sharding),), dense_tensors=6,
                                  dense_features=13, dense_activation_bytes_per_sample=1000,
                                  dense_gradient_bytes_per_sample=400, **kw)


def test_terms_add_up_and_round_like_the_allocator():
    assert alloc_bytes(1) == alloc_bytes(512) == 512 and alloc_bytes(513) == 1024
    assert alloc_bytes(1000, tensors=4) == 4 * 512 and alloc_bytes(0) == 0
    for p in predict_memory(_plan(), data_source_bytes=4096):
        terms = p.terms()
        allocated = {k: v for k, v in terms.items() if k != "allocator_overhead_bytes"}
        assert p.allocated_bytes == sum(allocated.values()) > 0
        assert p.reserved_bytes == p.allocated_bytes + p.allocator_overhead_bytes > p.allocated_bytes
        assert all(v % ALLOC_ROUND_BYTES == 0 for v in allocated.values()), allocated
        assert p.data_source_bytes == 4096 and p.peak_phase in ("lookup", "interaction", "update")


def test_terms_follow_the_plan():
    plan = _plan()
    preds = predict_memory(plan)
    for rank, p in enumerate(preds):  # each rank holds the weights of the tables placed on it
        held = sum(t.weight_bytes for t in TABLES if plan.tables[t.name].ranks == [rank])
        assert p.embedding_weights_bytes == alloc_bytes(held)
        assert p.embedding_optimizer_bytes == alloc_bytes(held)  # Adagrad: one fp32 per weight
        assert p.replica_gradient_bytes == 0
    assert sum(p.embedding_weights_bytes for p in preds) >= sum(t.weight_bytes for t in TABLES)
    adam, sgd = predict_memory(_plan("adam"))[0], predict_memory(_plan("sgd"))[0]
    assert adam.embedding_optimizer_bytes == 2 * preds[0].embedding_optimizer_bytes and \
        sgd.embedding_optimizer_bytes == 0
    assert adam.dense_optimizer_bytes == alloc_bytes(5_000 * 8, 6) and sgd.dense_optimizer_bytes == 0
    dp = predict_memory(_plan(sharding="data_parallel"))
    full = alloc_bytes(sum(t.weight_bytes for t in TABLES))
    assert all(p.embedding_weights_bytes == full and p.replica_gradient_bytes == 2 * full for p in dp)
    # a batch 4x the size: every per-sample term grows, persistent state stays
    big = predict_memory(CoDesignPlanner().plan(TABLES, Topology(get_sku("h100"), 2), 1024, "adagrad", 5_000,
                                                allowed_shardings=(ShardingType.TABLE_WISE,),
                                                dense_activation_bytes_per_sample=1000, dense_features=13))[0]
    assert big.batch_bytes > 3 * preds[0].batch_bytes and big.activation_bytes > 3 * preds[0].activation_bytes
    assert big.embedding_weights_bytes == predict_memory(_plan())[0].embedding_weights_bytes


def test_torch_workspace_and_skewed_ids():
    """anyrec's torch TBE allocates per-lookup temporaries (the lookup or the update is the peak); skewed
    ids touch fewer rows, so the update's temporaries shrink; the expected count matches the sum over rows
    of a power law continuous in rank (as the synthetic data draws ids)."""
    torch_tbe = EmbeddingCost.builtin(TORCH_EMBEDDING)
    uniform = predict_memory(_plan("adagrad", embedding=torch_tbe))[0]
    skewed = predict_memory(_plan("adagrad", embedding=torch_tbe, id_zipf_exponent=1.05))[0]
    assert uniform.peak_phase in ("lookup", "update") and uniform.workspace_bytes > 100_000
    assert skewed.workspace_bytes < uniform.workspace_bytes
    assert predict_memory(_plan("adagrad"))[0].workspace_bytes < uniform.workspace_bytes  # FBGEMM: in place
    n, rows, s = 5_000, 2_000, 1.05
    weights = [((k + 1) ** (1 - s) - k ** (1 - s)) / (1 - s) for k in range(1, rows + 1)]  # rank k's share
    exact = sum(-math.expm1(-n * wk / sum(weights)) for wk in weights)
    assert touched_rows_zipf(n, rows, s) == pytest.approx(exact, rel=0.03)
    assert touched_rows_zipf(n, rows, 0.0) == pytest.approx(rows * -math.expm1(-n / rows))


def test_sharded_adds_the_all_to_all_buffers():
    plan = _plan(world=1)
    one, unsharded = predict_memory(plan)[0], predict_memory(plan, sharded=False)[0]
    assert one.batch_bytes > unsharded.batch_bytes  # the input all-to-all's ids
    assert one.embedding_io_bytes > unsharded.embedding_io_bytes  # the lookups' own outputs


def test_report_prints_megabytes_where_gigabytes_round_to_zero():
    assert size_text(14.4e6) == "14.4 MB" and size_text(2.5e9) == "2.5 GB"
    text = format_report(_plan())
    rank_rows = [ln for ln in text.splitlines() if ln.strip().startswith(("0 ", "1 "))]
    assert len(rank_rows) == 2 and all(" MB " in ln and " 0.0 GB" not in ln for ln in rank_rows)


@pytest.mark.integration
def test_simdev_summary_checks_the_memory_prediction(tmp_path, simdev_site):
    """A 2-rank simdev run (the co-design plan, four steps) reports each rank's predicted and measured
    peak, and the model is within 15 % of the measurement."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(simdev_site)]), "OMP_NUM_THREADS": "1",
           "ANYREC_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "anyrec.train", "backend=simdev", "model=dlrm_tiny", "trainer.calibrate=never", "trainer.steps=4",
           "trainer.eval_steps=0", "trainer.progress=false", "trainer.tensorboard=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    measured = summary["measured_peak_memory_bytes_per_rank"]
    assert len(measured) == 2 and all(m > 0 for m in measured)
    assert len(summary["predicted_peak_memory_bytes_per_rank"]) == 2
    assert abs(summary["memory_prediction_error"]) <= 0.15, summary["memory_prediction_error_per_rank"]
    assert summary["predicted_memory_terms"]["embedding_weights_bytes"] > 0


def test_a_plan_it_accepts_fits_its_predicted_peak_and_one_that_cannot_is_refused_per_rank():
    """The search fits per-shard storage; the planner then checks each rank's predicted step peak (here the
    torch TBE's lookup temporaries of a 50-ids-a-sample table dominate it) against the usable memory,
    plans again with less where it does not fit, and refuses in one line naming each rank's shortfall."""
    tables = [TableSpec("big", 1_000_000, 64, 50.0, ["f0"]), TableSpec("small", 1000, 64, 1.0, ["f1"])]

    def plan(cap: int | None = None):
        return CoDesignPlanner().plan(tables, Topology(get_sku("h100"), 2, hbm_cap_bytes=cap), 8192,
                                      "adagrad", 10_000, embedding=EmbeddingCost.builtin(TORCH_EMBEDDING))

    roomy = plan()
    runtime = get_sku("h100").runtime_reserved_bytes
    stored = max(s.hbm_bytes for s in roomy.rank_storage)
    peak = max(p.reserved_bytes for p in predict_memory(roomy))
    assert peak > 2 * stored  # the step's transients, not the stored bytes, set the peak
    accepted = refused = 0
    for cap in (peak + runtime, int(peak * 1.02) + runtime, (stored + peak) // 2 + runtime, stored + runtime):
        try:
            got = plan(cap)
        except InfeasiblePlanError as e:
            refused += 1
            msg = str(e)
            assert "\n" not in msg and "rank 0:" in msg and "rank 1:" in msg and "short)" in msg, msg
            continue
        accepted += 1
        assert max(p.reserved_bytes for p in predict_memory(got)) <= got.caps.hbm_bytes == cap - runtime
    assert accepted == 2 and refused == 2
