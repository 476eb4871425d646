"""The step breakdown: profiled steps split into the trainer's phases, comms counted once."""

from __future__ import annotations

import time

import pytest
from torch.profiler import record_function

from anyrec.planner.types import Perf
from anyrec.trainer.breakdown import (
    KEYS,
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


def _step(ms: dict[str, float]) -> None:
    with phase("forward"):
        time.sleep(ms["forward"] / 1e3)
        # A collective's wait nested in another wait: counted once, at the outer range.
        with record_function("## FakeAwaitable wait() ##"):
            time.sleep(ms["wait"] / 1e3)
            with record_function("All2All_Pooled_Wait"):
                time.sleep(ms["wait"] / 1e3)
    with phase("backward"):
        time.sleep(ms["backward"] / 1e3)
    with phase("optimizer"):
        time.sleep(ms["optimizer"] / 1e3)
    time.sleep(ms["other"] / 1e3)


def test_profiled_steps_split_into_phases():
    ms = {"forward": 6.0, "wait": 2.0, "backward": 8.0, "optimizer": 3.0, "other": 5.0}
    with StepProfiler(3, "cpu") as prof:
        for _ in range(4):  # the first is the profiler's warm-up step
            _step({k: 20 * v if _ == 0 else v for k, v in ms.items()})  # a slow first step, not counted
            prof.step()
    got = prof.ms_per_step()
    assert set(got) == set(KEYS)
    assert ms["forward"] + 2 * ms["wait"] <= got["forward"] < 3 * (ms["forward"] + 2 * ms["wait"])
    assert ms["backward"] <= got["backward"] < 3 * ms["backward"]
    assert ms["optimizer"] <= got["optimizer"] < 3 * ms["optimizer"]
    assert 0.8 * ms["other"] <= got["other"] < 3 * ms["other"]
    assert 2 * ms["wait"] <= got["collectives"] < 3 * ms["wait"]  # outer wait only, not outer + inner
    assert got["step"] == pytest.approx(sum(got[k] for k in ("forward", "backward", "optimizer", "other")))
    assert got["step"] < 3 * sum(ms.values())  # the slow warm-up step is left out
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
