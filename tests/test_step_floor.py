"""benchmarks/step_floor.py's floor: the trainer's plan costed with every overhead removed, on the best
figure each calibration measured (`--floor-only` runs no training)."""

from __future__ import annotations

import json

import pytest

from benchmarks import step_floor

from .conftest import ROOT

RESULTS = ROOT / "benchmarks" / "results"
LOADED = RESULTS / "2026-12-04_cpu-2core" / "calibration_cpu_2ranks_floor.yaml"
QUIET = RESULTS / "2026-12-02_cpu-2core" / "first_contact_calibration_cpu_2ranks.yaml"


@pytest.fixture(scope="module")
def floors(tmp_path_factory):
    out = tmp_path_factory.mktemp("floor") / "floor.json"
    assert step_floor.main(["--floor-only", "--shapes", "dlrm_small,dlrmv2_small", "--hardware", str(LOADED),
                            "--hardware", str(QUIET), "--json", str(out)]) == 0
    return json.loads(out.read_text())["shapes"]


def test_floor_is_the_sum_of_its_terms_below_the_plans_prediction(floors):
    for shape, res in floors.items():
        fl = res["floor"]
        for r in fl["floor_per_rank"]:
            compute = r["gemm_ms"] + r["embedding_ms"] + r["dense_optimizer_ms"] + r["critical_comms_ms"]
            assert r["floor_ms"] == pytest.approx(max(compute, r["overlappable_comms_ms"]))
            assert r["gemm_ms"] > 0 and r["embedding_ms"] > 0 and r["critical_comms_ms"] > 0, shape
        assert fl["floor_ms"] == max(r["floor_ms"] for r in fl["floor_per_rank"])
        assert 0 < fl["floor_ms"] < fl["predicted_step_ms"], shape  # the plan keeps the overheads
        # GEMM time is the FLOPs at the best measured FLOP/s
        assert fl["floor_per_rank"][0]["gemm_ms"] == pytest.approx(
            fl["gemm_flops_per_rank"] / fl["figures"]["peak_fp32_flops"] * 1e3)


def test_floor_takes_the_best_figure_of_each_calibration(floors):
    fl = floors["dlrm_small"]["floor"]
    loaded, quiet = fl["figures_per_file"]
    for key in ("memory_bw_bytes_per_s", "peak_fp32_flops", "scale_up_bw_bytes_per_s"):
        assert fl["figures"][key] == max(loaded[key], quiet[key])
    assert loaded["peak_fp32_flops"] < quiet["peak_fp32_flops"]  # each file lends a different best
    assert quiet["memory_bw_bytes_per_s"] < loaded["memory_bw_bytes_per_s"]


def test_the_dcn_models_floor_is_larger(floors):
    assert floors["dlrmv2_small"]["floor"]["floor_ms"] > 5 * floors["dlrm_small"]["floor"]["floor_ms"]


def test_bad_shape_is_one_line_exit_2(capsys):
    assert step_floor.main(["--floor-only", "--shapes", "nope"]) == 2
    assert capsys.readouterr().err.strip() == ("step_floor.py: error: unknown shape(s) nope; choose from "
                                               "dlrm_small, dlrmv2_small, default")
