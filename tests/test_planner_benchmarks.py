"""The planner benchmark scripts run end to end on small inputs."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_planner_benchmark_small(tmp_path):
    out = tmp_path / "bench.json"
    rows = _load("planner").main(["--small", "--output", str(out)])
    assert [r["tables"] for r in rows] == [26, 50]
    for r in rows:
        assert r["anyrec_plan_s"] > 0  # speed is the benchmark's to report, not a test's to time
        assert r["anyrec_step_ms_anyrec_model"] > 0 and r["anyrec_step_ms_torchrec_model"] > 0
        assert r["torchrec_error"] or r["torchrec_step_ms_anyrec_model"] > 0
    assert json.loads(out.read_text())["rows"][0]["workload"] == "dlrmv2"


def test_planner_validate_quick(tmp_path):
    out = tmp_path / "val.json"
    rows = _load("planner_validate").main(["--quick", "--output", str(out)])
    assert {r["set"] for r in rows} == {"fit", "hold-out"}
    data = json.loads(out.read_text())
    assert data["calibrated"]["lookup_bw_bytes_per_s"] > 0 and data["calibrated"]["kind"] == "empirical"
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in data["shapes"])


def test_planner_accuracy_small(tmp_path):
    out = tmp_path / "acc.json"
    rows = _load("planner_accuracy").main(["--small", "--output", str(out)])
    assert [r["workload"] for r in rows] == ["tiny_26x8", "small_26x16"]
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


def test_plan_vs_torchrec_small(tmp_path):
    out = tmp_path / "pvt.json"
    rows = _load("plan_vs_torchrec").main(["--small", "--output", str(out)])
    assert [r["workload"] for r in rows] == ["tiny_26x8", "small_26x16"]
    for r in rows:
        assert r["anyrec_error_msg"] is None and r["torchrec_error_msg"] is None, r
        assert r["anyrec_measured_ms"] > 0 and r["torchrec_measured_ms"] > 0, r
        assert r["ratio"] == r["anyrec_measured_ms"] / r["torchrec_measured_ms"]
    assert json.loads(out.read_text())["rows"][1]["workload"] == "small_26x16"
