"""Every run checks the plan's prediction: step time after warm-up beside the plan's predicted step."""

from __future__ import annotations

import logging

import pytest

from anyrec.trainer import perfcheck
from anyrec.trainer.perfcheck import StepTimer, prediction_check

from .conftest import last_json_line, torchrun


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_timer_leaves_out_warmup_and_time_between_chunks(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(perfcheck.time, "perf_counter", clock)
    timer = StepTimer(first_step=0, steps=20)  # warm-up: 4 steps
    assert timer.warm_step == 4
    timer.chunk_start(0)
    for step in range(1, 11):  # 100 ms per warm-up step, 10 ms per step after
        clock.now += 0.1 if step <= 4 else 0.01
        timer.after_step(step)
    timer.chunk_end(10)
    clock.now += 5.0  # an evaluation between chunks is not a training step
    timer.chunk_start(10)
    for step in range(11, 21):
        clock.now += 0.01
        timer.after_step(step)
    timer.chunk_end(20)
    assert timer.steps == 16 and timer.step_s == pytest.approx(0.01)


def test_one_clock_gives_training_time_and_timed_steps(monkeypatch):
    """total_s: every chunk (warm-up and profiled ones included), never the time between chunks;
    the timed steps leave out warm-up and the profiled chunk."""
    clock = _Clock()
    monkeypatch.setattr(perfcheck.time, "perf_counter", clock)
    timer = StepTimer(first_step=0, steps=20)  # warm-up: 4 steps
    timer.chunk_start(0)
    for step in range(1, 11):
        clock.now += 0.1
        timer.after_step(step)
    assert timer.elapsed_s() == pytest.approx(1.0)  # the running chunk counts
    timer.chunk_end(10)
    clock.now += 5.0  # an evaluation between chunks
    timer.chunk_start(10, timed=False)  # a profiled chunk
    for step in range(11, 21):
        clock.now += 0.2
        timer.after_step(step)
    timer.chunk_end(20)
    assert timer.total_s == pytest.approx(3.0) and timer.elapsed_s() == pytest.approx(3.0)
    assert timer.steps == 6 and timer.step_s == pytest.approx(0.1)


def test_steps_timed_one_by_one_measure_the_median_step(monkeypatch):
    """Where the backend's steps finish on the host, a burst of another process on three steps (200 ms
    each against 10 ms) moves the mean by half and the measured (median) step by nothing."""
    clock = _Clock()
    monkeypatch.setattr(perfcheck.time, "perf_counter", clock)
    timers = {per_step: StepTimer(first_step=0, steps=20, per_step=per_step) for per_step in (True, False)}
    for timer in timers.values():
        clock.now = 0.0
        timer.chunk_start(0)
        for step in range(1, 21):
            clock.now += 0.1 if step <= 4 else 0.2 if step in (8, 12, 15) else 0.01
            timer.after_step(step)
        timer.chunk_end(20)
    median, mean = timers[True], timers[False]
    assert median.mean_step_s == mean.step_s == pytest.approx((13 * 0.01 + 3 * 0.2) / 16)
    assert median.step_s == pytest.approx(0.01, rel=0.003)  # a 0.5 % bin: within a quarter percent
    assert median.per_step.n == 16 and mean.per_step is None


def test_the_step_median_is_bounded_and_exact_to_its_bin():
    m = perfcheck.StepMedian()
    assert m.median() is None
    for s in (0.003, 0.001, 0.002, float("nan"), 0.0, -1.0):  # not step times: left out
        m.add(s)
    assert m.n == 3 and m.median() == pytest.approx(0.002, rel=0.003)
    for _ in range(100_000):
        m.add(0.0050001)
    assert len(m.counts) == 4 and m.median() == pytest.approx(0.005, rel=0.003)


def test_no_step_after_warmup_measures_nothing():
    timer = StepTimer(first_step=0, steps=1)
    timer.chunk_start(0)
    timer.after_step(1)
    timer.chunk_end(1)
    assert timer.step_s is None
    assert prediction_check(0.01, [None, None], log=False)["measured_step_ms"] is None


def test_prediction_check_reports_and_warns(caplog):
    with caplog.at_level(logging.INFO, logger="anyrec.trainer.perfcheck"):
        out = prediction_check(0.010, [0.012, 0.020])  # slowest rank: 20 ms; predicted 10 ms
    assert out["measured_step_ms"] == pytest.approx(20.0) and out["predicted_step_ms"] == pytest.approx(10.0)
    assert out["prediction_error"] == pytest.approx(-0.5)
    assert out["measured_step_ms_per_rank"] == pytest.approx([12.0, 20.0])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "anyrec.calibrate" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="anyrec.trainer.perfcheck"):
        close = prediction_check(0.019, [0.020])
    assert abs(close["prediction_error"]) < 0.1
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    # No prediction (planner=simple, one device): the error is null, the measurement stays.
    none = prediction_check(None, [0.02], log=False)
    assert none["prediction_error"] is None and none["predicted_step_ms"] is None
    assert none["measured_step_ms"] == pytest.approx(20.0)


@pytest.mark.integration
def test_training_summary_holds_prediction_measurement_and_breakdown(tmp_path):
    proc = torchrun(["-m", "anyrec.train", "model=dlrm_tiny", "trainer.steps=12", "data.batch_size=64",
                     "trainer.eval_steps=0", "trainer.breakdown_steps=4", f"hydra.run.dir={tmp_path}/run"],
                    nproc=2, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = last_json_line(proc.stdout)
    assert s["predicted_step_ms"] > 0 and s["measured_step_ms"] > 0
    assert len(s["measured_step_ms_per_rank"]) == 2 and all(v > 0 for v in s["measured_step_ms_per_rank"])
    assert s["measured_step_ms"] == max(s["measured_step_ms_per_rank"])
    assert s["prediction_error"] == pytest.approx(s["predicted_step_ms"] / s["measured_step_ms"] - 1)
    # 12 steps: 2 of warm-up, 5 timed, then the profiler's warm-up step and 4 profiled ones (not timed).
    assert s["measured_steps"] == 5
    # the CPU measures no device memory: the memory check's measurement and error are null
    assert s["measured_peak_memory_bytes_per_rank"] == [None, None] and s["memory_prediction_error"] is None
    assert len(s["predicted_peak_memory_bytes_per_rank"]) == 2
    b = s["step_breakdown_ms"]
    assert b["steps"] == 4 and len(b["per_rank"]) == 2
    for r in b["per_rank"]:
        assert min(r["forward"], r["backward"], r["optimizer"], r["collectives"]) > 0  # gloo waits: > 0
        assert r["forward"] + r["backward"] + r["optimizer"] + r["other"] == pytest.approx(r["step"])
    assert b["predicted"]["step"] == pytest.approx(s["predicted_step_ms"])
    assert b["predicted"]["forward"] + b["predicted"]["backward"] == pytest.approx(s["predicted_step_ms"])
    log = (tmp_path / "run" / "train_rank0.log").read_text()
    assert "step time after warm-up" in log and "step breakdown over the last 4 steps" in log
    # backend.bind_cores=auto by default: bound or free by the cores' load, the reason logged either way
    assert "local rank 0 of 2: threads " in log and "backend.bind_cores=auto: other processes used" in log
