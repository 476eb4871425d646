"""The AOT portability gate and the TBE benchmark script, run as their users run them (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


def test_aot_gate_compiles_every_kernel_for_all_targets(tmp_path):
    """The CI gate as CI runs it: default targets (sm_90, sm_100, gfx942, gfx950), every variant."""
    pytest.importorskip("triton")
    from anyrec.kernels.aot import TARGETS, _variants

    out = tmp_path / "aot.json"
    env = _env()
    env.pop("TRITON_DEFAULT_FP_FUSION")  # aot.py sets its own default: no Triton warning
    proc = subprocess.run([sys.executable, "-m", "anyrec.kernels.aot", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    results = json.loads(out.read_text())
    expected = len(_variants()) * len(TARGETS)
    # 9 pooled TBE variants, 2 sequence ones (forward and backward at batch 1, the one-id bags' launch),
    # 2 x 2 dot interaction (fwd/bwd x fp32/bf16), 2 x 2 DCN epilogue, 3 x 2 HSTU attention (fwd, bwd dq,
    # bwd dk/dv x bf16/fp32)
    assert len(results) == expected == 25 * 4
    sequence = {(r["kernel"], r["variant"]) for r in results if r["variant"].startswith("sequence")}
    assert sequence == {("tbe_forward", "sequence w=fp32 batch=1 D<=512"),
                        ("tbe_backward", "sequence rowwise_adagrad w=fp32 batch=1 D<=512")}
    assert {r["target"] for r in results} == set(TARGETS)
    assert {r["kernel"] for r in results} == {"tbe_forward", "tbe_backward", "dot_fwd", "dot_bwd",
                                              "dcn_epi_fwd", "dcn_epi_bwd", "hstu_fwd", "hstu_bwd_dq",
                                              "hstu_bwd_dkdv"}
    assert {r["variant"] for r in results if r["kernel"].startswith("hstu")} == {
        "x=bf16 H=4 D<=128", "x=fp32 H=4 D<=128"}
    assert all(r["ok"] and r["registers"] for r in results)
    # the production-shape (D=128) kernels must not spill on any target
    assert all(r["spills"] == 0 for r in results if "D<=128" in r["variant"]), proc.stdout
    assert f"{expected}/{expected} compiled" in proc.stdout
    assert "TRITON_DEFAULT_FP_FUSION" not in proc.stderr


def test_aot_rejects_unknown_target():
    proc = subprocess.run([sys.executable, "-m", "anyrec.kernels.aot", "--targets", "sm_1"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "unknown targets" in proc.stderr


def test_benchmark_small_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/tbe.py", "--small", "--out-dir", str(tmp_path),
                           "--execution", "torch", "--dtypes", "fp32"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "tbe.json").read_text())
    assert res["small"] and res["copy_GBps"] > 0
    names = [r["name"] for r in res["results"]]
    for shape in ("onehot", "multihot"):
        assert f"anyrec TBE fwd {shape} fp32" in names
        assert f"anyrec TBE fwd+bwd+rowwise_adagrad {shape} fp32" in names
        assert f"nn.EmbeddingBag fwd {shape} fp32" in names
        ratio = next(r for r in res["results"] if r["name"] == f"ratios {shape} fp32")
        assert ratio["fwd_vs_copy"] > 0 and ratio["fwd_vs_embeddingbag"] > 0
    assert "ratios onehot fp32" in proc.stdout
    assert res["gpu"] == "not run" and "GPU: not run" in proc.stdout


def test_interaction_benchmark_small(tmp_path):
    """benchmarks/interaction.py as its users run it: every contender checked against the anchor,
    a row per contender and shape, the anchor's ratio exactly 1."""
    out = tmp_path / "inter.json"
    proc = subprocess.run([sys.executable, "benchmarks/interaction.py", "--small", "--json", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["batch"], r["dim"]) for r in rows} == {(64, 16), (128, 32)}
    gpu = torch.accelerator.is_available()
    want = {"torch gather", "anyrec torch"} | ({"anyrec triton"} if gpu else set())
    assert {r["contender"] for r in rows} == want  # the Triton row only where a GPU is
    anchor = {(r["batch"], r["dim"]): r["us"] for r in rows if r["contender"] == "torch gather"}
    for r in rows:
        assert r["us"] > 0 and len(r["runs_us"]) == 3
        # each contender's ratio is its time over the anchor's at the same shape (anchor: exactly 1)
        assert r["ratio_to_anchor"] == pytest.approx(r["us"] / anchor[(r["batch"], r["dim"])], rel=1e-3)
