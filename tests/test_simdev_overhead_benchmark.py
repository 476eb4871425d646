"""benchmarks/simdev_overhead.py: its cases run, a device whose results differ is refused before timing,
and the table reports what simdev adds per op. simdev itself is not loaded here (it would register a device
in this process): the cases run on the host only."""

from __future__ import annotations

import pytest
import torch

from benchmarks import simdev_overhead as bench


def test_every_op_case_runs_and_is_timed_on_the_host():
    ops = [name for name in bench.CASES if name != bench.STEP]  # the step's optimizer costs seconds to make
    rows = bench.measure(["cpu"], repeats=1, iters=1, cases=ops)
    assert [r["case"] for r in rows] == ops
    assert all(r["cpu_us"] > 0 and len(r["runs_us"]["cpu"]) == 1 for r in rows)


def test_a_device_whose_result_differs_is_refused_before_timing():
    same = torch.arange(4.0)
    bench.check_equal("add", {"cpu": same, "simdev": same.clone()})
    with pytest.raises(AssertionError, match="add: simdev differs from cpu"):
        bench.check_equal("add", {"cpu": same, "simdev": same + 1e-7})
    # uninitialised memory: only the shape and dtype must agree
    bench.check_equal("empty", {"cpu": torch.zeros(2, 3), "simdev": torch.ones(2, 3)})
    with pytest.raises(AssertionError, match="empty"):
        bench.check_equal("empty", {"cpu": torch.zeros(2, 3), "simdev": torch.zeros(3, 2)})


def test_the_table_shows_what_simdev_adds_per_call_and_the_median_over_single_ops():
    rows = bench.with_overhead([{"case": "add", "cpu_us": 2.0, "simdev_us": 30.0},
                                {"case": "view", "cpu_us": 1.0, "simdev_us": 11.0},
                                {"case": "sum", "cpu_us": 3.0, "simdev_us": 23.0},
                                {"case": bench.STEP, "cpu_us": 100.0, "simdev_us": 900.0}])
    assert [(r["added_us"], r["ratio"]) for r in rows] == [(28.0, 15.0), (10.0, 11.0), (20.0, 23.0 / 3),
                                                           (800.0, 9.0)]
    text = bench.table(rows)
    assert "add" in text and text.splitlines()[-1].split()[-1] == "20.0"  # not the step's 800
