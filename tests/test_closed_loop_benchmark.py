"""benchmarks/closed_loop.py: its usage, its refusal of a loop with nothing to learn, and its table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import closed_loop

from .conftest import ROOT


def test_help_exits_zero():
    proc = subprocess.run([sys.executable, "benchmarks/closed_loop.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--loops" in proc.stdout


def test_a_loop_of_one_run_is_refused():
    with pytest.raises(SystemExit) as e:
        closed_loop.main(["--runs", "1"])
    assert e.value.code == 2


def test_table_names_the_calibrating_run_and_the_error():
    run = {"loop": 1, "predicted_step_ms": 100.0, "measured_step_ms": 107.0, "prediction_error": 0.07,
           "step_correction": 1.0, "step_correction_runs": 0, "loadavg_before": (3.2, 3.0, 2.9)}
    text = closed_loop.table([{**run, "run": 1, "calibration": "calibration: cache miss, measured in 60 s"},
                              {**run, "run": 2, "calibration": "calibration: cache hit, planning with x"}])
    rows = text.splitlines()[2:]
    assert "| miss |" in rows[0] and "| hit |" in rows[1] and "+7.0 %" in rows[0]
