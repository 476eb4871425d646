"""benchmarks/data.py runs at toy size on CPU and reports every source this checkout has."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from anyrec.data import SOURCES

from .conftest import ROOT

pytestmark = pytest.mark.integration  # every test here starts processes


def test_data_benchmark_small(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "data.py"), "--batch-size", "256",
                           "--batches", "2", "--file-table-rows", "1000", "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    expected = {"synthetic cpu", "criteo_npy", *(s for s in SOURCES if s == "criteo_multihot")}
    assert expected <= set(result["sources"])
    assert all(r["samples_per_s"] > 0 and r["samples_per_cpu_s"] > 0 for r in result["sources"].values())
    assert "samples/cpu-s" in proc.stdout
