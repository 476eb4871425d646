"""A calibration run's bounds (anyrec.calibration.run): its time limit and the signals that stop it,
inside a measurement; and the verdict on whether its figures are this machine's (anyrec.history.trust)."""

from __future__ import annotations

import signal

import pytest

from anyrec.backends import get_backend
from anyrec.backends.core_load import CoreLoad
from anyrec.calibration.measure import embedding
from anyrec.calibration.measure import timing as measure_timing
from anyrec.calibration.run import CalibrationRun, CalibrationStopped, Timing
from anyrec.choices import Switch
from anyrec.history.trust import assess


class _Signalled:
    """A stop request that has seen `signum` (the watcher thread's part, done)."""

    def __init__(self, signum: int | None) -> None:
        self.signum = signum

    def restore(self) -> None:
        pass


def _counting() -> tuple[list[int], callable]:
    calls: list[int] = []
    return calls, lambda: calls.append(1)


def test_a_measurement_ends_at_its_phase_end_after_one_timed_call():
    run = CalibrationRun.unbounded()
    run.until = 0.0  # the phase's share is spent already
    calls, fn = _counting()
    timing = measure_timing.timeit(fn, get_backend("cpu"), budget_s=60, min_reps=3, run=run)
    assert len(calls) == 2 and timing.reps == 1  # the warm-up and one timed call: a figure, then stop
    calls, fn = _counting()
    assert measure_timing.timeit(fn, get_backend("cpu"), budget_s=0, min_reps=3).reps == 3  # no limit: all


def test_a_signal_stops_a_measurement_between_its_repetitions():
    run = CalibrationRun.unbounded()
    calls: list[int] = []

    def fn() -> None:
        calls.append(1)
        if len(calls) == 4:  # the watcher thread saw SIGTERM during the fourth call
            run.stop = _Signalled(signal.SIGTERM)

    with pytest.raises(CalibrationStopped) as e:
        measure_timing.timeit(fn, get_backend("cpu"), budget_s=60, min_reps=100, run=run)
    assert len(calls) == 4 and e.value.exit_code == 128 + signal.SIGTERM
    assert "SIGTERM" in str(e.value) and "nothing written" in str(e.value)


def test_a_trainer_stopped_by_a_signal_stops_the_run():
    run = CalibrationRun.unbounded()
    run.stopped_by(None)  # it ran to its end: nothing happens
    with pytest.raises(CalibrationStopped) as e:
        run.stopped_by("SIGHUP")
    assert e.value.exit_code == 128 + signal.SIGHUP


def test_a_phase_gets_its_share_of_the_time_left():
    run = CalibrationRun.unbounded()
    run.deadline = 1e12  # far away: a share of it is far too
    run.phase(0.5)
    assert not run.expired()
    run.deadline = 0.0  # the whole run's time is gone: every phase has none
    run.phase(0.5)
    assert run.expired() and run.agreed_left_s() < 0


def test_timing_spread():
    assert Timing.of([1.0, 1.0, 1.0, 1.0]).spread == 0
    t = Timing.of([1.0, 2.0, 2.0, 3.0])
    assert t.median_s == 2.0 and t.spread == pytest.approx(0.5) and t.reps == 4
    assert Timing.of([5.0]).spread == 0


def test_busy_host_is_said_in_one_line_and_not_trusted():
    busy = assess(CoreLoad(busy_cores=2.0, own_cores=0.6, sample_s=60), 2, {"copy": 0.02}, [])
    assert not busy.trusted
    assert busy.line() == ("calibration: host busy: other processes used 1.4 of 2 cores during calibration; "
                           "figures not cached as trusted (a later run on a quiet host measures again)")
    quiet = assess(CoreLoad(busy_cores=1.1, own_cores=1.0, sample_s=60), 2, {"copy": 0.02}, [])
    assert quiet.trusted and quiet.other_cores == pytest.approx(0.1)


def test_noisy_measurements_and_fallbacks_are_not_trusted():
    noisy = assess(None, 2, {"copy": 0.5, "gemm fp32": 0.9, "dlrm mlp": 0.4}, [])
    assert not noisy.trusted and "noisy" in noisy.reasons[0] and "gemm fp32: 90 %" in noisy.reasons[0]
    fell = assess(None, 2, {}, ["trainer step (fit error 86 %)"])
    assert not fell.trusted and "trainer step (fit error 86 %)" in fell.line()
    assert assess(None, 2, {}, []).trusted  # unreadable load, nothing else wrong: trusted


def test_a_fit_past_30_percent_is_used_and_not_trusted():
    """A busy host's points scatter: the fit is still this host's figure (the built-in one is several
    times off), so the job that measured it uses it, and the verdict keeps it from being trusted later."""
    backend = get_backend("cpu")
    device, spec = backend.device(0), backend.device_spec()
    points = embedding.EMB_POINTS["small"][:3]
    run = CalibrationRun.unbounded()
    measure_max = embedding.MAX_FIT_ERROR
    try:
        embedding.MAX_FIT_ERROR = -1.0  # every fit misses by more
        out = embedding.measure_embedding(backend, device, spec, points, 0.0, run)
    finally:
        embedding.MAX_FIT_ERROR = measure_max
    assert out["torch"].profile is not None and len(out["torch"].points) == 3
    assert any(a.startswith("embedding torch (fit error") for a in run.approximated)
    verdict = assess(None, 2, {}, run.fallbacks, run.approximated)
    assert not verdict.trusted and "fitted poorly (used as measured)" in verdict.line()
    close = CalibrationRun.unbounded()
    try:
        embedding.MAX_FIT_ERROR = float("inf")  # every fit close enough
        out = embedding.measure_embedding(backend, device, spec, points, 0.0, close)
        assert out["torch"].profile is not None
    finally:
        embedding.MAX_FIT_ERROR = measure_max
    assert not close.approximated


def test_step_figures_measured_in_part_scale_the_built_in_ones():
    """Step points cut short by the time limit: the built-in figures scaled to the points measured, never
    the built-in figures as they are."""
    from anyrec.backends.hardware_file import STEP_FIELDS
    from anyrec.calibration.step import builtin_scale

    bare = get_backend("cpu").device_spec().replace(**{f: 0.0 for f in STEP_FIELDS})
    spec = bare.replace(step_fixed_s=1e-3, step_per_sample_s=1e-6)
    rows = [[1.0, 8, 32, 0, 0, 0, 4, 0, 0], [1.0, 8, 512, 0, 0, 0, 4, 0, 0]]
    builtin = [1e-3 + 32e-6, 1e-3 + 512e-6]
    # a host three times slower than the built-in figures say, beside 0.1 ms of bytes and FLOPs
    measured = [3 * b + 1e-4 for b in builtin]
    assert builtin_scale(rows, measured, [1e-4, 1e-4], spec) == pytest.approx(3.0)
    assert builtin_scale(rows, measured, [1e-4, 1e-4], bare) == 1.0


def test_a_signal_a_step_points_trainer_caught_stops_the_run(monkeypatch):
    """A signal while a step point trains is the trainer's to catch (it stops at its step boundary and
    returns): the calibration must stop too, not go on to the next point."""
    import os
    import threading

    from anyrec.backends import Hardware
    from anyrec.calibration import step as calibrate_step
    from anyrec.runtime.distributed import close_runtime, start_runtime

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are the main thread's (the trainer's would not catch the signal)")

    class SignalledTrainer(calibrate_step.Trainer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.step_hooks.append(lambda t: os.kill(os.getpid(), signal.SIGTERM) if t.step == 1 else None)

    monkeypatch.setattr(calibrate_step, "Trainer", SignalledTrainer)
    runtime = start_runtime("cpu", bind_cores=Switch.false)
    try:
        hardware = Hardware(runtime.backend.device_spec())
        with pytest.raises(CalibrationStopped) as e:
            calibrate_step._train_point(calibrate_step.POINTS[0], runtime, hardware, steps=40,
                                        run=CalibrationRun.unbounded())
    finally:
        close_runtime(runtime, barrier=False)
    assert e.value.signum == signal.SIGTERM


def test_the_step_points_fit_what_bytes_and_flops_leave_unexplained(monkeypatch):
    """The points are costed without the spec's own step figures (those are what the fit replaces): a
    spec whose built-in step figures are large must not make the points' model swallow the framework
    costs the fit is for."""
    from anyrec.backends import Hardware
    from anyrec.calibration import step

    seen = []

    def fake_train(p, runtime, hardware, steps, run):
        seen.append(hardware.spec.step_fixed_s)
        return 0.005, 0.001

    class Rt:
        class dist:  # noqa: N801 - a stand-in for the DistInfo
            world_size = 1
        device = None

    monkeypatch.setattr(step, "_train_point", fake_train)
    spec = get_backend("cpu").device_spec().replace(step_fixed_s=0.05)
    out = step.measure_step_costs(Rt(), Hardware(spec), 0.0, measure_timing.fit_nonnegative, quick=True)
    assert seen and set(seen) == {0.0}
    assert out["fields"]["step_fixed_s"] > 0  # the 4 ms bytes and FLOPs leave unexplained, fitted


def test_the_time_limit_counts_from_when_the_job_began_as_the_entry_point_says():
    """An entry point hands the job's start (launch_started: this process's, here) to the run, so start-up
    counts against the limit; a library call's limit starts with the run. Nothing is read from argv."""
    import os
    import time

    from anyrec.runtime.clock import launch_started

    with open(f"/proc/{os.getpid()}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[19]) > 0  # /proc answers: launch_started reads it
    before = time.monotonic()
    started = launch_started()
    assert started < before - 0.5  # this test process began well before now (imports, collection)
    run = CalibrationRun.begin(100.0, progress=False, started=started)
    try:
        assert run.left_s() == pytest.approx(100.0 - (time.monotonic() - started), abs=0.5)
    finally:
        run.close()
    library = CalibrationRun.begin(100.0, progress=False)
    try:
        assert 99.0 < library.left_s() <= 100.0
    finally:
        library.close()
