"""benchmarks/vs_reference.py and its timing runner: the reference's arguments follow anyrec's model
configs, only training calls are timed, ratios pair runs, a missing reference is said in one line; with
the reference on the machine ($DLRM_REFERENCE), a real run of both contenders."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_reference_arguments_follow_the_model_configs():
    vs = _load("vs_reference")
    dot = vs.reference_args("dlrm_small", 256, 300)
    assert "--interaction_type" not in dot and "--multi_hot_sizes" not in dot  # the reference's default: dot
    assert _arg(dot, "--embedding_dim") == "16" and _arg(dot, "--dense_arch_layer_sizes") == "64,32,16"
    assert _arg(dot, "--over_arch_layer_sizes") == "64,32,1" and _arg(dot, "--batch_size") == "256"
    assert len(_arg(dot, "--num_embeddings_per_feature").split(",")) == 26
    assert "--adagrad" in dot and _arg(dot, "--learning_rate") == "0.05" and _arg(dot, "--eps") == "1e-08"
    assert _arg(dot, "--limit_train_batches") == "300"
    dcn = vs.reference_args("dlrmv2_small", 128, 50)
    assert _arg(dcn, "--interaction_type") == "dcn" and _arg(dcn, "--dcn_low_rank_dim") == "64"
    assert _arg(dcn, "--dcn_num_layers") == "3" and _arg(dcn, "--embedding_dim") == "32"
    hot = [int(x) for x in _arg(dcn, "--multi_hot_sizes").split(",")]
    assert len(hot) == 26 and sum(hot) == 214  # DLRMv2's ids per sample
    with pytest.raises(vs.BenchmarkError, match="no model config dlrm_huge"):
        vs.reference_args("dlrm_huge", 256, 10)


def test_only_training_calls_are_timed():
    runner = _load("progress_runner")

    class Model:
        training = True

    class Pipeline:
        _model = Model()

    runner.CALLS.clear()
    runner.CPU.clear()
    timed = runner._timed(lambda self, it: next(it))
    p, it = Pipeline(), iter([1, 2, 3])
    assert timed(p, it) == 1
    p._model.training = False
    assert timed(p, it) == 2  # evaluation: not timed
    p._model.training = True
    timed(p, it)
    with pytest.raises(StopIteration):  # the end of the data: not a step
        timed(p, it)
    assert len(runner.CALLS) == 2
    assert len(runner.CPU) == 2 and all(end >= start for start, end in runner.CPU)  # CPU time, same calls


def test_ratios_pair_runs_and_the_table_shows_medians():
    vs = _load("vs_reference")
    runs = [{"contender": c, "samples_per_s": s, "step_ms": 512e3 / s, "cpu_ms": cpu, "bind": b}
            for c, s, cpu, b in [("anyrec", 1100.0, 7.25, "auto: free"), ("reference", 1000.0, 9.0, None),
                                 ("reference", 1000.0, 8.0, None), ("anyrec", 900.0, 7.0, "auto: free"),
                                 ("anyrec", 1300.0, 6.0, "auto: free"), ("reference", 1000.0, 8.5, None)]]
    s = vs.summarize(runs, ["anyrec", "reference"])
    r = s["ratio_to_reference"]["anyrec"]
    assert r["every"] == pytest.approx([1.1, 0.9, 1.3]) and r["median"] == pytest.approx(1.1)
    assert r["faster_in"] == 2 and r["pairs"] == 3
    assert s["median_samples_per_s"] == {"anyrec": 1100.0, "reference": 1000.0}
    assert s["median_cpu_ms"] == {"anyrec": 7.0, "reference": 8.5}
    text = vs.table({"shapes": {"dlrm_small": {"runs": runs, "summary": s}}})
    assert "1.10x" in text and "2/3" in text and "anyrec binding: auto: free" in text
    assert "cpu ms" in text.splitlines()[0] and "   7.00 " in text and "   8.50 " in text


def test_a_baseline_checkout_is_paired_with_anyrec(tmp_path, capsys):
    vs = _load("vs_reference")
    runs = [{"contender": c, "samples_per_s": s, "step_ms": 512e3 / s, "cpu_ms": 5.0, "bind": None}
            for c, s in [("anyrec", 1200.0), ("reference", 1000.0), ("anyrec-baseline", 1000.0),
                         ("reference", 1000.0), ("anyrec-baseline", 1000.0), ("anyrec", 1100.0)]]
    s = vs.summarize(runs, ["anyrec", "reference", "anyrec-baseline"])
    assert s["anyrec_to_baseline"]["every"] == pytest.approx([1.2, 1.1])
    assert s["ratio_to_reference"]["anyrec-baseline"]["median"] == pytest.approx(1.0)
    assert "anyrec / baseline 1.150x" in vs.table({"shapes": {"dlrm_small": {"runs": runs, "summary": s}}})
    # each anyrec contender imports its own checkout; the reference neither
    assert vs._env(tmp_path)["PYTHONPATH"] == str(tmp_path) and vs._env(None)["PYTHONPATH"] == ""
    (tmp_path / "dlrm_main.py").write_text("")
    assert vs.main(["--reference", str(tmp_path / "dlrm_main.py"), "--baseline", str(tmp_path)]) == 2
    assert "not an anyrec checkout" in capsys.readouterr().err


@pytest.mark.integration
def test_missing_reference_is_one_line_and_nothing_runs(tmp_path):
    script = str(ROOT / "benchmarks" / "vs_reference.py")
    env = {k: v for k, v in os.environ.items() if k != "DLRM_REFERENCE"}
    for extra in ([], ["--reference", str(tmp_path / "nowhere")]):
        proc = subprocess.run([sys.executable, script, *extra, "--json", str(tmp_path / "out.json")],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2 and proc.stdout == ""
        assert len(proc.stderr.strip().splitlines()) == 1 and "no MLPerf DLRM reference" in proc.stderr
        assert "090956ee2319" in proc.stderr and not (tmp_path / "out.json").exists()


REFERENCE = os.environ.get("DLRM_REFERENCE")


@pytest.mark.integration
@pytest.mark.skipif(not REFERENCE or not Path(REFERENCE).exists(),
                    reason="the MLPerf DLRM reference is not on this machine (set DLRM_REFERENCE)")
def test_both_contenders_run_and_are_timed(tmp_path):
    out = tmp_path / "vs.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_reference.py"), "--reference",
                           REFERENCE, "--shapes", "dlrm_small", "--pairs", "1", "--steps", "8",
                           "--warmup", "3", "--batch-size", "64", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    runs = res["shapes"]["dlrm_small"]["runs"]
    assert {r["contender"] for r in runs} == {"anyrec", "reference"}
    for r in runs:
        assert r["steady_steps"] == 5 and r["samples_per_s"] > 0  # 8 training calls, 3 left out
        assert 0 < r["cpu_ms"] and len(r["cpu_ms_per_rank"]) == 2
    assert [r["bind"] for r in runs if r["contender"] == "anyrec"][0].startswith("backend.bind_cores=auto")
    assert res["reference"]["blob_matches_commit"]
