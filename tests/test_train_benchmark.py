"""benchmarks/train_step.py runs at toy size on CPU and reports every contender."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import ROOT


def test_train_step_benchmark_small(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "benchmarks" / "train_step.py")
    proc = subprocess.run([sys.executable, script, "--small", "--steps", "3", "--warmup", "1",
                           "--batch-size", "64", "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    names = {"torch eager", "torch compile", "anyrec eager", "anyrec pipelined", "anyrec loop"}
    assert set(result["samples_per_s"]) == names
    assert all(v > 0 for v in result["samples_per_s"].values())
    assert result["ratio_vs_torch_eager"]["torch eager"] == 1.0
    assert "vs torch eager" in proc.stdout
    assert result["loop_vs_step"] > 0 and len(result["pairs"]) == 1 and "loop/step" in proc.stdout
