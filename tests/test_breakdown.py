"""The step breakdown: profiled steps split into the trainer's phases, comms counted once."""

from __future__ import annotations

import time

import pytest
from torch.profiler import record_function

from anyrec.planner.types import Perf
from anyrec.trainer.perfcheck import (
    KEYS,
    LABEL,
    StepProfiler,
    breakdown_window,
    format_breakdown,
    phase,
    predicted_phases,
)


def test_window_leaves_timed_steps_before_it():
    assert breakdown_window(60, 10, 20) == 39  # 39: the profiler's warm-up step, 40-59 profiled
    assert breakdown_window(12, 2, 4) == 7
    with pytest.raises(ValueError, match=r"trainer.breakdown_steps=4 needs trainer.steps > 7 .*; got 7"):
        breakdown_window(7, 2, 4)


def _step(ms: dict[str, float], warm_up: bool = False) -> None:
    with phase("forward"):
        time.sleep(ms["forward"] / 1e3)
        # A collective's wait nested in another wait: counted once, at the outer range.
        with record_function("## FakeAwaitable wait() ##"):
            time.sleep(ms["wait"] / 1e3)
            with record_function("All2All_Pooled_Wait"):
                time.sleep(ms["wait"] / 1e3)
    with phase("backward"):
        time.sleep(ms["backward"] / 1e3)
    if warm_up:  # only the profiler's warm-up step has an optimizer phase: it must not be counted
        with phase("optimizer"):
            time.sleep(ms["optimizer"] / 1e3)
    time.sleep(ms["other"] / 1e3)


def _per_step_ms(prof: StepProfiler, name: str, steps: int) -> float:
    """The profiler's own total for the ranges called `name`, in ms per step."""
    return sum(e.cpu_time_total for e in prof.events() if e.name == name) / steps / 1e3


def test_profiled_steps_split_into_phases():
    ms = {"forward": 6.0, "wait": 2.0, "backward": 8.0, "optimizer": 3.0, "other": 5.0}
    with StepProfiler(3, "cpu") as prof:
        for i in range(4):  # the first is the profiler's warm-up step
            _step(ms, warm_up=i == 0)
            prof.step()
    got = prof.ms_per_step()
    assert set(got) == set(KEYS)
    # Each phase is the profiler's total for its range (lower bounds: a sleep lasts at least its time).
    assert got["forward"] == pytest.approx(_per_step_ms(prof, LABEL.format("forward"), 3))
    assert got["backward"] == pytest.approx(_per_step_ms(prof, LABEL.format("backward"), 3))
    assert got["forward"] >= ms["forward"] + 2 * ms["wait"] and got["backward"] >= ms["backward"]
    assert got["optimizer"] == 0.0  # the warm-up step's phase is left out
    assert got["other"] >= 0.8 * ms["other"]
    # The nested wait is counted once, at the outer range: outer + inner would exceed it.
    outer = _per_step_ms(prof, "## FakeAwaitable wait() ##", 3)
    inner = _per_step_ms(prof, "All2All_Pooled_Wait", 3)
    assert inner >= ms["wait"] and got["collectives"] == pytest.approx(outer)
    assert got["step"] == pytest.approx(sum(got[k] for k in ("forward", "backward", "optimizer", "other")))
    assert got["device_compute"] == got["device_comms"] == 0.0  # a CPU run has no device timeline


def test_prediction_beside_measurement():
    perf = Perf(fwd_compute_s=0.002, bwd_compute_s=0.004, fwd_comms_s=0.001, bwd_comms_s=0.0015)
    pred = predicted_phases(perf)
    assert pred == pytest.approx({"step": 8.5, "forward": 3.0, "backward": 5.5, "collectives": 2.5})
    assert predicted_phases(None) is None
    rank = dict.fromkeys(KEYS, 0.0) | {"step": 9.0, "forward": 3.5, "backward": 5.0, "optimizer": 0.25,
                                        "other": 0.25, "collectives": 2.0}
    table = format_breakdown([rank], pred).splitlines()
    assert table[0].split() == ["ms/step", "step", "forward", "backward", "optimizer", "other", "collectives"]
    assert table[1].split() == ["rank", "0", "9.000", "3.500", "5.000", "0.250", "0.250", "2.000"]
    assert table[2].split() == ["plan", "8.500", "3.000", "5.500", "-", "-", "2.500"]
