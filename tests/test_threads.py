"""backend.threads: the count chosen from the cores a rank can get (its share less other processes' use),
the re-check that follows the host while the job trains, and the option reaching torch."""

from __future__ import annotations

import functools
import logging
import os

import pytest
import torch

import anyrec.backends.cpu as cpu
from anyrec.backends.threads import (
    RAISE_AFTER,
    Rebinder,
    ThreadChoice,
    ThreadTuner,
    choose_threads,
    thread_setting,
)
from anyrec.calibration.core_load import CoreLoad
from anyrec.data.prefetch import PrefetchIterator
from anyrec.trainer import trainer as trainer_module

from .conftest import compose_config
from .test_train_loop import TINY, one_rank  # noqa: F401 - one_rank is a fixture

TWO_CORES = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                               reason="needs two cores")


def _load(other: float, own: float = 0.5) -> CoreLoad:
    return CoreLoad(busy_cores=own + other, own_cores=own, sample_s=2.0)


QUIET, LOADED = _load(0.1), _load(1.9)


def test_auto_takes_the_share_less_other_processes_cores():
    # one rank on 2 cores: quiet keeps both (today's count), a busy core costs a thread, never below 1
    assert choose_threads(None, 2, 1, QUIET).intra_op == 2
    assert choose_threads(None, 2, 1, _load(0.25)).intra_op == 2  # the binding rule's limit still counts free
    assert choose_threads(None, 2, 1, _load(0.3)).intra_op == 1
    assert choose_threads(None, 2, 1, LOADED).intra_op == 1
    assert choose_threads(None, 2, 1, _load(5.0)).intra_op == 1
    # 8 cores, 2 ranks (4 each): other processes' 3 cores split over the ranks, 1.5 each
    assert choose_threads(None, 4, 2, _load(3.0)).intra_op == 2
    assert choose_threads(None, 4, 2, _load(0.4)).intra_op == 4
    assert choose_threads(None, 4, 2, None).intra_op == 4  # unreadable: the share, as on a quiet host
    # forced: as given, whatever the load
    fixed = choose_threads(3, 2, 1, None)
    assert fixed.intra_op == 3 and fixed.describe() == "3 intra-op (backend.threads=3)"
    assert "other processes used 1.90 over 2.00 s" in choose_threads(None, 2, 1, LOADED).describe()


def test_setting_parses_auto_and_counts_and_rejects_the_rest():
    assert thread_setting("auto") is None and thread_setting("AUTO") is None
    assert thread_setting(2) == 2 and thread_setting("4") == 4
    for bad in ("0", "-1", "many", "1.5", True):
        with pytest.raises(ValueError, match="backend.threads=.*: choose auto or a thread count >= 1"):
            thread_setting(bad)
    with pytest.raises(ValueError, match="share_cores and local_world_size must be >= 1"):
        choose_threads(None, 0, 1, None)


class FakeMeter:
    """A LoadMeter whose window's load is whatever `loads` holds now (None: unreadable)."""

    loads: list[CoreLoad | None] = []

    def __init__(self, cpus) -> None:
        self.cpus = list(cpus)

    def read(self) -> CoreLoad | None:
        return self.loads[0]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _tuner(start: int, every_s: float = 2.0, rebinder: Rebinder | None = None):
    applied: list[int] = []
    clock = Clock()
    choice = ThreadChoice(start, 2, None, QUIET, 1)
    tuner = ThreadTuner(choice, [0, 1], rebinder, meter=FakeMeter, apply=applied.append, clock=clock,
                        every_s=every_s)
    return tuner, applied, clock


def test_recheck_lowers_at_once_and_raises_after_agreement(monkeypatch, caplog):
    monkeypatch.setattr(FakeMeter, "loads", [LOADED])
    tuner, applied, clock = _tuner(2)
    caplog.set_level(logging.INFO, logger="anyrec.backends.threads")
    tuner()
    assert applied == []  # not before the period has passed
    clock.now = 2.0
    tuner()
    assert applied == [1] and tuner.choice.intra_op == 1
    clock.now = 4.0
    tuner()  # still loaded: no change, nothing logged again
    assert applied == [1]
    FakeMeter.loads[0] = QUIET  # the other job ended
    for i in range(RAISE_AFTER):
        clock.now = 6.0 + 2 * i
        tuner()
    assert applied == [1, 2] and tuner.choice.intra_op == 2
    changes = [r.getMessage() for r in caplog.records if "threads" in r.getMessage()]
    assert changes == ["threads 2 -> 1: other processes used 1.90 cores over the last 2.0 s",
                       "threads 1 -> 2: other processes used 0.10 cores over the last 2.0 s"]
    FakeMeter.loads[0] = None  # unreadable: nothing changes
    clock.now = 20.0
    tuner()
    assert applied == [1, 2]


def test_recheck_ignores_one_quiet_window_and_rebinds_by_the_rule(monkeypatch):
    monkeypatch.setattr(FakeMeter, "loads", [QUIET])
    binds: list[list[int]] = []
    rebinder = Rebinder(share=[1], allowed=[0, 1], bound=False, bind=lambda c: binds.append(list(c)))
    tuner, applied, clock = _tuner(1, rebinder=rebinder)
    tuner.observe(QUIET)
    tuner.observe(LOADED)  # the quiet window did not last: no raise, no binding
    tuner.observe(QUIET)
    assert applied == [] and binds == [] and not rebinder.bound
    tuner.observe(QUIET)
    assert applied == [2] and binds == [[1]] and rebinder.bound
    tuner.observe(LOADED)  # load came back: unbound and lowered at once
    assert applied == [2, 1] and binds == [[1], [0, 1]] and not rebinder.bound


def test_a_fixed_count_has_nothing_to_recheck():
    with pytest.raises(ValueError, match="backend.threads=2 is fixed"):
        ThreadTuner(ThreadChoice(2, 2, 2), [0, 1])


def test_idle_data_workers_are_at_most_the_steps_threads():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        it = PrefetchIterator(lambda s: torch.tensor(s), 0, 6, depth=4, workers=3, idle=True)
        assert len(it._threads) == 1 and [int(b) for b in it] == list(range(6))
        torch.set_num_threads(2)
        it = PrefetchIterator(lambda s: torch.tensor(s), 0, 6, depth=4, workers=3, idle=True)
        assert len(it._threads) == 2 and [int(b) for b in it] == list(range(6))
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _trainer(*overrides):
    _, cfg = compose_config([*TINY, "trainer.eval_steps=0", "trainer.calibrate=never", *overrides])
    return trainer_module.Trainer(cfg)


def test_option_is_in_the_schema_and_every_backend_file():
    for backend in ("auto", "cpu", "cuda", "rocm"):
        _, cfg = compose_config([f"backend={backend}"])
        assert cfg.backend.threads == "auto"
    _, cfg = compose_config(["backend.threads=3"])
    assert cfg.backend.threads == "3"


@TWO_CORES
def test_fixed_option_reaches_torch(one_rank, keep_threads, monkeypatch):  # noqa: F811
    monkeypatch.setattr(cpu, "measure_core_load", lambda cpus: pytest.fail("a fixed count measures nothing"))
    torch.set_num_threads(2)
    t = _trainer("backend.threads=1", "trainer.steps=2")
    try:
        assert torch.get_num_threads() == 1 and t.backend.thread_choice.setting == 1
        assert not any(isinstance(h, ThreadTuner) for h in t.step_hooks)
    finally:
        t.close()


@TWO_CORES
def test_auto_follows_the_load_while_training(one_rank, keep_threads, monkeypatch):  # noqa: F811
    """The default: the count from the load at start, then re-checked from the trainer's step loop."""
    monkeypatch.setattr(cpu, "measure_core_load", lambda cpus: LOADED)
    monkeypatch.setattr(cpu, "ThreadTuner", functools.partial(ThreadTuner, meter=FakeMeter, every_s=0.0))
    monkeypatch.setattr(FakeMeter, "loads", [LOADED])
    seen: list[int] = []
    t = _trainer("trainer.steps=6")
    try:
        assert torch.get_num_threads() == 1 and t.backend.thread_choice.intra_op == 1
        t.step_hooks.append(lambda _: seen.append(torch.get_num_threads()))
        t.run_steps(2)
        FakeMeter.loads[0] = QUIET  # the host quietened: back to the share after RAISE_AFTER looks
        t.run_steps(RAISE_AFTER + 1)
    finally:
        t.close()
    assert seen == [1, 1] + [1] * (RAISE_AFTER - 1) + [2, 2], seen


def test_benchmark_summary_compares_auto_with_the_best_fixed_count():
    from benchmarks import threads as bench

    def run(threads: str, ms: float | None) -> dict:
        return {"nproc": 1, "threads": threads, "step_ms": ms}

    runs = [run("auto", 11.0), run("1", 10.0), run("2", None), run("auto", 13.0), run("1", 12.0),
            run("2", 80.0)]
    s = bench.summarize(runs)["1"]
    assert s["best_fixed"] == "1" and s["cases"]["auto"]["median_step_ms"] == 12.0
    assert s["auto_over_best_fixed"] == pytest.approx(12.0 / 11.0)
    assert s["cases"]["2"]["max_step_ms"] == float("inf")  # the timed-out run counts as slower than any
    assert bench._json_safe(s)["cases"]["2"]["max_step_ms"] is None  # and is null in the JSON
    for argv, code in ((["--help"], 0), (["--rounds", "0"], 2), (["--background", "maybe"], 2)):
        with pytest.raises(SystemExit) as e:  # before anything is launched
            bench.main(argv)
        assert e.value.code == code
