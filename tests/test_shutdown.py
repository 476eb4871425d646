"""Clean shutdown under torchrun: a signal stops every rank at one step boundary (with a checkpoint),
a stopped rank fails the job naming it, an orphaned worker stops, and errors reach torchrun's report.

Every job is 2 ranks on loopback, bounded in time, and the test checks that no process is left.
"""

from __future__ import annotations

import json

import pytest

from .conftest import ROOT, torchrun


@pytest.mark.parametrize("signal_rank", [0, 1])
def test_a_signal_on_one_rank_stops_all_at_one_step(tmp_path, signal_rank):
    # tests/dist/stop_check.py: one all-reduce per step, SIGINT on one rank after step 7, checks
    # every 3 steps: every rank stops after step 9, and says why.
    proc = torchrun([str(ROOT / "tests" / "dist" / "stop_check.py"), str(tmp_path), str(signal_rank)],
                    cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results == [{"step": 9, "stopped_by": "SIGINT"}] * 2
