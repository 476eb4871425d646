"""The ranks' decisions (anyrec.runtime.agreement): one agreed value per decision, a mismatch or a missing
rank named in one line within the agreement's timeout, never a hang; and calibration's plan of its step
points taken from agreed figures, so a slow rank cannot send the ranks different ways."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from anyrec.backends import Hardware, get_backend
from anyrec.calibration.run import CalibrationRun, CalibrationStopped
from anyrec.runtime.agreement import Agreement, parse_delay
from anyrec.runtime.errors import PeerLostError


def _ranks(world: int, body, timeout_s: float = 5.0, delays: dict[int, float] | None = None) -> list:
    """Run `body(rank, agreement)` on `world` threads sharing one store: each rank's result or exception."""
    store = dist.HashStore()
    out: list = [None] * world

    def one(rank: int) -> None:
        a = Agreement(rank, world, store, "test", timeout_s, (("", (delays or {}).get(rank, 0.0)),))
        try:
            out[rank] = body(rank, a)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[rank] = e

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4)
        assert not t.is_alive(), "a rank hung"
    return out


def test_every_rank_gets_the_agreed_value():
    def body(rank, a):
        return [a.decide("main", lambda: rank * 10), a.decide("min", lambda: 5 - rank, "min"),
                a.decide("max", lambda: rank, "max"), a.decide("any", lambda: rank == 2, "any"),
                a.decide("text", lambda: f"from {rank}" if rank == 0 else None)]

    results = _ranks(3, body)
    assert results == [[0, 3, 2, True, "from 0"]] * 3


def test_a_slow_rank_still_agrees():
    """Rank 1 sleeps before forming each view (the delay the job tests inject): its clock
    reads later than rank 0's, yet both take the same decision."""
    def body(rank, a):
        t0 = time.monotonic()
        return a.decide("elapsed", lambda: time.monotonic() - t0, "max")

    r0, r1 = _ranks(2, body, delays={1: 0.3})
    assert r0 == r1 and r0 >= 0.3


def test_ranks_at_different_decisions_fail_in_one_line_naming_them():
    def body(rank, a):
        return a.decide("measure" if rank == 0 else "skip", lambda: 1)

    out = _ranks(2, body)
    for e in out:
        assert isinstance(e, PeerLostError)
        line = str(e)
        assert "\n" not in line and "disagree at decision #0" in line
        assert "rank(s) 0 at 'measure'" in line and "rank(s) 1 at 'skip'" in line


def test_a_rank_that_never_comes_is_named_within_the_timeout():
    def body(rank, a):
        a.decide("first", lambda: 0)
        if rank == 1:
            return "went another way"
        return a.decide("second", lambda: 0)

    t0 = time.monotonic()
    out = _ranks(2, body, timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    assert out[1] == "went another way"
    assert isinstance(out[0], PeerLostError)
    assert "rank(s) 1 did not reach decision #1 'second'" in str(out[0])
    assert "rank 1 last at #0 first" in str(out[0])


def test_a_stop_signal_on_one_rank_stops_every_rank_at_the_same_decision():
    store = dist.HashStore()
    out: list = [None, None]

    class Stop:  # a StopRequest that saw SIGTERM on rank 1 only
        def __init__(self, signum):
            self.signum = signum

    def one(rank: int) -> None:
        run = CalibrationRun.unbounded()
        run.stop = Stop(15 if rank == 1 else None)
        run.agreement = Agreement(rank, 2, store, "test", 5.0)
        try:
            out[rank] = run.agree("go on", lambda: True)
        except CalibrationStopped as e:
            out[rank] = e.signum

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == [15, 15]


def test_the_step_points_plan_from_agreed_figures(monkeypatch):
    """With a time limit between the two ranks' own estimates of a pass, the ranks still take one plan:
    rank 1's slower warm-up (its clock) decides for both, as the slowest rank's must; the pass that does
    not fit whole is started and ends with the time."""
    from anyrec.calibration import step

    calls: dict[int, list[str]] = {0: [], 1: []}
    store = dist.HashStore()
    results: list = [None, None]

    class FakeDist:
        def __init__(self, rank):
            self.rank, self.world_size = rank, 2

    class FakeRuntime:
        def __init__(self, rank):
            self.dist, self.device = FakeDist(rank), None

    def fake_train(p, runtime, hardware, steps, run):
        calls[runtime.dist.rank].append(p.name)
        if runtime.dist.rank == 1 and len(calls[1]) == 1:
            time.sleep(0.4)  # rank 1's warm-up point is slow
        return 0.001, 0.001

    monkeypatch.setattr(step, "_train_point", fake_train)
    points = step.points_at(2, quick=True)
    hardware = Hardware(get_backend("cpu").device_spec())

    def one(rank: int) -> None:
        run = CalibrationRun.unbounded()
        now = time.monotonic()
        # time for rank 0's estimate of a pass (about 0 s), not for rank 1's (0.8 s x points, or a third)
        run.deadline = run.until = now + 0.1 * len(points)
        run.agreement = Agreement(rank, 2, store, "test", 10.0)
        try:
            results[rank] = step.measure_step_costs(FakeRuntime(rank), hardware, 1.0,
                                                    lambda *a, **k: [0.0] * 9, quick=True, run=run)
        except Exception as e:  # noqa: BLE001
            results[rank] = e

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert not isinstance(results[0], Exception), results[0]
    assert not isinstance(results[1], Exception), results[1]
    assert calls[0] == calls[1]  # the same points trained: the same collectives
    # rank 1's estimate of a pass decided for both: fewer steps per point (rank 0's alone: 40), one pass
    assert results[0]["steps_per_point"] == results[1]["steps_per_point"] == 10
    assert results[0]["passes"] == results[1]["passes"] == 1


@pytest.mark.parametrize("text,rank,want", [
    (None, 0, ()), ("1:2.5", 1, (("", 2.5),)), ("1:2.5", 0, ()),
    ("1:5:step points: pass time;0:3:stop after step 10", 0, (("stop after step 10", 3.0),)),
    ("1:5:step points: pass time;0:3:stop", 1, (("step points: pass time", 5.0),))])
def test_delay_setting(text, rank, want):
    assert parse_delay(text, rank) == want


def test_a_named_delay_applies_to_its_decisions_only():
    a = Agreement(0, 1, None, "test", 1.0, (("slow", 0.3),))
    t0 = time.monotonic()
    a.decide("fast one", lambda: 0)
    assert time.monotonic() - t0 < 0.2
    a.decide("slow one", lambda: 0)
    assert time.monotonic() - t0 >= 0.3


@pytest.mark.parametrize("text", ["2", "a:1", "1:-1", "1:nan"])
def test_a_bad_delay_setting_is_one_line(text):
    with pytest.raises(ValueError, match="ANYREC_DELAY_DECISIONS"):
        parse_delay(text, 0)
