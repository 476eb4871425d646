"""The planner benchmark scripts run end to end on small inputs."""

import importlib
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    return importlib.import_module(f"benchmarks.{name}")


@pytest.mark.integration
def test_planner_benchmark_small(tmp_path):
    out = tmp_path / "bench.json"
    rows = _load("planner").main(["--small", "--output", str(out)])
    assert [r["tables"] for r in rows] == [26, 50]
    for r in rows:
        assert r["anyrec_plan_s"] > 0  # speed is the benchmark's to report, not a test's to time
        assert r["anyrec_step_ms_anyrec_model"] > 0 and r["anyrec_step_ms_torchrec_model"] > 0
        # torchrec's planner plans both small workloads: an error here is a broken comparison
        assert r["torchrec_error"] is None and r["torchrec_step_ms_anyrec_model"] > 0, r["torchrec_error"]
    assert json.loads(out.read_text())["rows"][0]["workload"] == "dlrmv2"


@pytest.mark.integration
def test_planner_validate_quick(tmp_path):
    out = tmp_path / "val.json"
    rows = _load("planner_validate").main(["--quick", "--output", str(out)])
    assert {r["set"] for r in rows} == {"fit", "hold-out"}
    data = json.loads(out.read_text())
    assert data["calibrated"]["lookup_bw_bytes_per_s"] > 0 and data["calibrated"]["kind"] == "empirical"
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in data["shapes"])


@pytest.mark.integration  # four torchrun jobs, planned with the run's one 2-rank calibration
def test_planner_accuracy_small(tmp_path, two_rank_calibration):
    out = tmp_path / "acc.json"
    rows = _load("planner_accuracy").main(["--small", "--calibration", str(two_rank_calibration.output),
                                           "--output", str(out)])
    assert [r["workload"] for r in rows] == ["tiny_26x8"]
    for r in rows:
        for label in ("uncal", "cal"):
            assert r[f"{label}_error_msg"] is None, r
            assert r[f"{label}_predicted_ms"] > 0 and len(r[f"{label}_measured_ms_per_rank"]) == 2
            # the summary's error is computed in seconds, the row's times are in ms: equal to rounding
            assert r[f"{label}_error"] == pytest.approx(
                r[f"{label}_predicted_ms"] / r[f"{label}_measured_ms"] - 1, rel=1e-12, abs=1e-12)
        # The calibration file changed the prediction (measured figures, not the SKU table's).
        assert r["cal_predicted_ms"] != r["uncal_predicted_ms"]
    data = json.loads(out.read_text())
    assert "embedding:" in data["calibration"] and data["rows"][0]["workload"] == "tiny_26x8"


@pytest.mark.integration
def test_plan_vs_torchrec_small(tmp_path):
    out = tmp_path / "pvt.json"
    rows = _load("plan_vs_torchrec").main(["--small", "--segments", "4", "--output", str(out)])
    assert [r["workload"] for r in rows] == ["tiny_26x8"]
    for r in rows:
        assert r["error_msg"] is None, r
        a, t = r["anyrec_segments_ms"], r["torchrec_segments_ms"]
        assert len(a) == len(t) == 4 and all(v > 0 for v in a + t), r
        pairs = sorted(x / y for x, y in zip(a, t, strict=True))
        assert r["ratio"] == (pairs[1] + pairs[2]) / 2 and r["ratio_q1"] <= r["ratio"] <= r["ratio_q3"]
        assert r["anyrec_ms"] == (sorted(a)[1] + sorted(a)[2]) / 2
        assert r["anyrec_predicted_ms"] > 0 and r["verdict"] == "-"  # 4 rounds: too few for 95 %
        # Two trainers, one per plan, in one job: the same data and initial weights train to the
        # same loss whatever the plan (fp32 summation order aside).
        assert r["anyrec_final_loss"] == pytest.approx(r["torchrec_final_loss"], rel=1e-4)
    # torchrec replicates dlrm_tiny's small tables, anyrec's calibrated-free plan shards them: the two
    # plans differ, and the row says so.
    assert rows[0]["same_plan"] is False and "data_parallel" in rows[0]["torchrec_plan"]
    assert json.loads(out.read_text())["rows"][0]["workload"] == "tiny_26x8"


def test_paired_ratio_and_order():
    mod = _load("plan_vs_torchrec")
    assert mod.segment_order(("a", "t"), 4) == [("a", "t"), ("t", "a"), ("a", "t"), ("t", "a")]
    with pytest.raises(ValueError, match="must be even"):
        mod.segment_order(("a", "t"), 3)  # one order would run once more than the other
    got = mod.paired_ratio([10.0, 30.0, None, 12.0], [20.0, 15.0, 9.0, 12.0])
    # rounds with a missing side are dropped, from the ratios and the medians alike:
    # ratios 0.5, 2.0, 1.0 -> median 1.0; anyrec 10, 30, 12 -> 12; torchrec 20, 15, 12 -> 15
    assert got["ratio"] == 1.0 and got["ratio_q1"] == 0.75 and got["ratio_q3"] == 1.5
    assert got["anyrec_ms"] == 12.0 and got["torchrec_ms"] == 15.0
    assert mod.paired_ratio([None], [1.0])["ratio"] is None


def test_median_interval_and_verdict():
    mod = _load("plan_vs_torchrec")
    # Order statistics with binomial coverage >= 95 %: n = 40 -> the 14th and 27th values (1-based),
    # n = 6 -> the extremes; below 6 values no interval reaches 95 %.
    assert mod.median_interval([float(i) for i in range(40)]) == (13.0, 26.0)
    assert mod.median_interval([float(i) for i in range(6)]) == (0.0, 5.0)
    assert mod.median_interval([1.0] * 5) is None
    assert mod.verdict((0.8, 0.95)) == "faster" and mod.verdict((1.01, 1.2)) == "slower"
    assert mod.verdict((0.97, 1.02)) == "equal" and mod.verdict(None) == "-"
    got = mod.paired_ratio([9.0] * 10, [10.0] * 9 + [8.0])
    assert got["ratio_ci95"] == [0.9, 0.9] and got["verdict"] == "faster"


@pytest.mark.integration
def test_failed_job_names_its_error(tmp_path):
    """A job that fails says why in one line (the exception, not torchrun's footer); an odd segment
    count is refused before any job starts."""
    mod = _load("plan_vs_torchrec")
    got = mod.train("tiny_26x8", "no_such_sku", 2, 2, 8, tmp_path, 300.0)
    assert "no_such_sku" in got["error"] and "traceback" not in got["error"], got
    with pytest.raises(SystemExit):
        mod.main(["--small", "--segments", "3", "--output", str(tmp_path / "x.json")])


def test_accuracy_table_flags_rows_a_drifting_host_measured():
    mod = _load("planner_accuracy")
    assert mod.spread([10.0, None, 12.5]) == pytest.approx(0.25) and mod.spread([10.0, None]) is None

    def row(name, cal_runs):
        cal = sorted(cal_runs)[1]
        return {"workload": name, "uncal_predicted_ms": 2.0, "uncal_measured_ms": 10.0, "uncal_error": -0.8,
                "uncal_measured_ms_runs": [10.0, 10.0, 10.0], "uncal_spread": 0.0,
                "cal_predicted_ms": 10.0, "cal_measured_ms": cal, "cal_error": 10.0 / cal - 1,
                "cal_measured_ms_runs": cal_runs, "cal_spread": mod.spread(cal_runs),
                "cal_measured_ms_per_rank": [cal, cal]}

    lines = mod.table([row("quiet", [10.0, 11.0, 12.0]), row("drifted", [10.0, 15.0, 14.0])]).splitlines()
    assert lines[1].split()[7] == "20%" and lines[2].split()[7] == "50%"  # the cal spread column
    assert lines[-2] == "cal: median |error| 19%, worst 29% over 2 workloads"  # every row counts
    assert lines[-1].startswith("noisy host: runs of one plan differ by more than 30% in drifted "
                                "(cal runs 10.00-15.00 ms);")
    assert "noisy host" not in mod.table([row("quiet", [10.0, 11.0, 12.0])])


def test_held_out_workloads_are_valid_jobs_unlike_the_six():
    """The held-out set composes as training jobs and spans what the six do not: other table counts,
    DCN and dot, one-hot and multi-hot, 1 and 2 ranks, batches of their own."""
    from .conftest import compose_config

    mod = _load("planner_accuracy")
    assert len(mod.HELD_OUT) >= 6 and not set(mod.HELD_OUT) & set(mod.WORKLOADS)
    seen = {"interaction": set(), "ranks": set(), "multi_hot": set(), "tables": set(), "batch": set()}
    for overrides in mod.HELD_OUT.values():
        cfg = compose_config(mod._expand([o for o in overrides if not o.startswith("ranks=")]))[1]
        seen["interaction"].add(str(cfg.model.interaction))
        seen["ranks"].add(next((o for o in overrides if o.startswith("ranks=")), "ranks=2"))
        seen["multi_hot"].add(bool(cfg.model.multi_hot))
        seen["tables"].add(len(cfg.model.table_rows))
        seen["batch"].add(cfg.data.batch_size)
    assert seen["interaction"] == {"dot", "dcn"} and seen["ranks"] == {"ranks=1", "ranks=2"}
    assert seen["multi_hot"] == {True, False} and len(seen["tables"]) >= 5 and len(seen["batch"]) >= 4
