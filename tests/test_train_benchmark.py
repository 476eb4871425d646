"""benchmarks/train_step.py runs at toy size on CPU and reports every contender."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.integration  # every test here starts processes


def test_train_step_benchmark_small(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "benchmarks" / "train_step.py")
    proc = subprocess.run([sys.executable, script, "--small", "--steps", "3", "--warmup", "1",
                           "--batch-size", "64", "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    rates = result["samples_per_s"]
    assert set(rates) == {"torch eager", "torch compile", "anyrec eager", "anyrec pipelined", "anyrec loop"}
    assert result["steps"] == 3 and result["batch_size"] == 64
    rows = {ln[:18].strip(): ln[18:].split() for ln in proc.stdout.splitlines() if ln[:18].strip() in rates}
    for name, rate in rates.items():
        assert rate > 0
        assert result["ratio_vs_torch_eager"][name] == pytest.approx(rate / rates["torch eager"])
        # the printed table shows the JSON's figures
        assert rows[name] == [f"{rate:,.0f}", f"{rate / rates['torch eager']:.2f}x"], rows
    # one alternating pair: the loop/step ratio is the pair's, the medians are the pair's rates
    (pair,) = result["pairs"]
    assert result["loop_vs_step"] == pytest.approx(pair["anyrec loop"] / pair["anyrec pipelined"])
    assert rates["anyrec loop"] == pair["anyrec loop"] and "loop/step" in proc.stdout
