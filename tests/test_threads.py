"""backend.threads: auto's start from the cores a rank can get, the timing of the job's own step that picks
the count (agreed by the ranks, timed again when the load changes), and the option reaching torch."""

from __future__ import annotations

import functools
import logging
import math
import os
import statistics
import threading
from collections.abc import Callable

import pytest
import torch

import anyrec.backends.cpu as cpu
import anyrec.backends.threads as threads_module
from anyrec._hydra import cli_problem
from anyrec.backends.core_load import CoreLoad
from anyrec.backends.threads import (
    LOAD_CHANGE_CORES,
    RECHECK_STEPS,
    TIE_FRACTION,
    TRIAL_STEPS,
    Rebinder,
    ThreadChoice,
    ThreadTuner,
    choose_threads,
    thread_candidates,
)
from anyrec.choices import Switch
from anyrec.config import parse_threads
from anyrec.data.prefetch import PrefetchIterator
from anyrec.trainer import trainer as trainer_module

from .conftest import compose_config
from .test_train_loop import TINY, one_rank  # noqa: F401 - one_rank is a fixture

TWO_CORES = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                               reason="needs two cores")


def _load(other: float, own: float = 0.5) -> CoreLoad:
    return CoreLoad(busy_cores=own + other, own_cores=own, sample_s=2.0)


QUIET, LOADED = _load(0.1), _load(1.9)


def test_auto_starts_from_the_share_less_other_processes_cores():
    # one rank on 2 cores: quiet keeps both, a busy core costs a thread, never below 1
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
    loaded = choose_threads(None, 2, 1, LOADED).describe()
    assert "other processes used 1.90 over 2.00 s" in loaded and "timed at 1, 2 threads" in loaded
    assert "nothing to time" in choose_threads(None, 1, 2, None).describe()


def test_candidates_are_one_the_powers_of_two_below_the_share_and_the_share():
    assert thread_candidates(1) == [1]
    assert thread_candidates(2) == [1, 2]
    assert thread_candidates(3) == [1, 2, 3]
    assert thread_candidates(8) == [1, 2, 4, 8]
    assert thread_candidates(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError, match="share_cores must be >= 1"):
        thread_candidates(0)


def test_setting_parses_auto_and_counts_and_rejects_the_rest():
    # parsed once, where the config is built: auto is None, a count an int
    assert parse_threads("auto") is None and parse_threads("AUTO") is None
    assert parse_threads(2) == 2 and parse_threads("4") == 4
    for bad in ("0", "-1", "many", "1.5", True):
        with pytest.raises(ValueError, match="^backend.threads=.*: choose auto or a thread count >= 1$"):
            parse_threads(bad)
    assert cli_problem(["backend.threads=0"]) == "backend.threads=0: choose auto or a thread count >= 1"
    with pytest.raises(ValueError, match="share_cores and local_world_size must be >= 1"):
        choose_threads(None, 0, 1, None)


class FakeMeter:
    """A LoadMeter whose window's load is whatever `loads[0]` holds now (None: unreadable)."""

    def __init__(self, loads: list[CoreLoad | None]) -> None:
        self.loads = loads

    def read(self) -> CoreLoad | None:
        return self.loads[0]


class FakeJob:
    """A rank training under a tuner: each step takes `step_ms[threads]` (the injected step timer), the
    tuner runs after it as the trainer's step hook; `loads[0]` is the cores' load its meter reads, and
    `reduce` the all-reduce (default: this rank's figures max `others`' next vector, else its own)."""

    def __init__(self, step_ms: dict[int, float], share: int = 2, start: int = 2,
                 others: list[list[float]] | None = None, rebinder: Rebinder | None = None,
                 reduce: Callable[[list[float]], list[float]] | None = None, ranks: int = 1) -> None:
        self.step_ms, self.threads = step_ms, start
        self.applied: list[int] = []
        self.reduces: list[int] = []  # the length of each all-reduce, in call order
        self.others = others or []
        self.loads: list[CoreLoad | None] = [QUIET]
        self.last_step_s: float | None = None
        self.now = 0.0
        self._reduce = reduce
        self.tuner = ThreadTuner(ThreadChoice(start, share, None, QUIET), [0, 1], rebinder,
                                 meter=lambda cpus: FakeMeter(self.loads), apply=self._apply,
                                 reduce_max=self._reduce_max, world_size=ranks,
                                 clock=lambda: self.now)

    def _apply(self, n: int) -> None:
        self.applied.append(n)
        self.threads = n

    def _reduce_max(self, values: list[float]) -> list[float]:
        self.reduces.append(len(values))
        if self._reduce is not None:
            return self._reduce(values)
        other = self.others.pop(0) if self.others else values
        return [max(a, b) for a, b in zip(values, other, strict=True)]

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.last_step_s = self.step_ms[self.threads] / 1e3
            self.now += self.last_step_s
            self.tuner(self)


class FakeGroup:
    """All-reduce (max) between ranks run as threads: a rank that asks for a different all-reduce, or none,
    breaks the barrier within seconds instead of hanging."""

    def __init__(self, ranks: int) -> None:
        self._barrier = threading.Barrier(ranks, timeout=10)
        self._slots: list[list[float]] = [[] for _ in range(ranks)]

    def reduce_for(self, rank: int) -> Callable[[list[float]], list[float]]:
        def reduce(values: list[float]) -> list[float]:
            self._slots[rank] = list(values)
            self._barrier.wait()
            out = [max(col) for col in zip(*self._slots, strict=True)]
            self._barrier.wait()
            return out
        return reduce


def tuner_lines(caplog) -> list[str]:
    """What the tuner logged (another test's leftover thread may log meanwhile)."""
    return [r.getMessage() for r in caplog.records if r.name == "anyrec.backends.threads"]


TRIAL = 1 + 2 * (1 + TRIAL_STEPS)  # steps until the count is kept: the first, then per count settle + timed


@pytest.mark.parametrize(("step_ms", "best"), [({1: 9.1, 2: 12.7}, 1), ({1: 12.0, 2: 7.0}, 2)])
def test_auto_keeps_the_count_that_ran_the_step_fastest(step_ms, best, caplog):
    """The issue's host: 2 threads started (the load sample said so) but 1 ran the step faster; and the
    other way round: the timing decides, not the start."""
    caplog.set_level(logging.INFO, logger="anyrec.backends.threads")
    job = FakeJob(step_ms)
    job.steps(TRIAL - 1)
    assert job.tuner.trial is None  # still timing
    job.steps(1)
    assert job.threads == best and job.tuner.choice.intra_op == best and job.applied == [1, 2, best]
    assert job.tuner.trial.step_ms == pytest.approx(step_ms)
    lines = tuner_lines(caplog)
    assert lines == [f"threads: {best} intra-op, the job's step timed at 1 -> {step_ms[1]:.2f} ms, 2 -> "
                     f"{step_ms[2]:.2f} ms (median of {TRIAL_STEPS} steps each, slowest rank)"]
    job.steps(3 * RECHECK_STEPS[1])  # a steady host: nothing is timed again
    assert job.applied == [1, 2, best] and len(tuner_lines(caplog)) == 1


def test_a_step_far_off_does_not_swing_the_median_and_ties_go_to_fewer_threads():
    job = FakeJob({1: 10.0, 2: 10.1})  # within TIE_FRACTION: the fewer threads leave a core to others
    job.steps(TRIAL)
    assert job.threads == 1
    job = FakeJob({1: 10.0, 2: 8.0})
    job.steps(3)  # into 1's timed steps
    job.step_ms[1] = 80.0  # one step 1 ran beside a burst of another process
    job.steps(1)
    job.step_ms[1] = 10.0
    job.steps(TRIAL - 4)
    assert job.threads == 2 and job.tuner.trial.step_ms[1] == 10.0


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_load_change_times_the_counts_again(ranks, caplog):
    """Looks every 2 s (one rank: by the clock; several: by the steps 2 s take at the kept count, as the
    look ends in an all-reduce); a load that moved at two looks in a row sets off a new timing."""
    job = FakeJob({1: 12.0, 2: 7.0}, ranks=ranks)
    job.steps(TRIAL)
    assert job.threads == 2
    every = round(2.0 / 7e-3)
    if ranks > 1:
        assert job.tuner._every == pytest.approx(every, abs=1)
        assert RECHECK_STEPS[0] <= every <= RECHECK_STEPS[1]
    job.steps(every * 5)  # looks that find the load unchanged: nothing timed again
    assert job.applied == [1, 2, 2]
    job.loads[0] = _load(QUIET.other_cores + LOAD_CHANGE_CORES + 0.4)  # a busy loop started
    job.steps(every + 1)  # one look that sees it: not yet (it may be a short-lived process)
    assert job.applied == [1, 2, 2]
    job.step_ms = {1: 9.1, 2: 40.0}  # 2 threads now wait for the core it holds
    caplog.set_level(logging.INFO, logger="anyrec.backends.threads")
    caplog.clear()  # from here on (another test may have left the logger at INFO before)
    for _ in range(every + 1):
        job.steps(1)
        if job.tuner._schedule:
            break
    assert job.tuner._schedule  # the second look saw it too: timing again
    job.steps(TRIAL - 1)
    assert job.threads == 1 and job.applied == [1, 2, 2, 1, 2, 1]
    lines = tuner_lines(caplog)
    assert "the load changed on a rank" in lines[0] and "other processes 0.10 -> 1.00 cores" in lines[0]
    assert lines[-1].startswith("threads: 1 intra-op")
    job.steps(every * 5)  # the load stays where it was timed: nothing timed again
    job.loads[0] = None  # unreadable: nothing is timed again either
    job.steps(every * 5)
    assert job.applied == [1, 2, 2, 1, 2, 1]


def test_a_count_far_slower_is_timed_no_further_and_a_slower_step_times_again(caplog):
    """2 threads beside a busy core: its settling step ran 60x the 1-thread steps, so its timed steps are
    skipped (one slow step, not four). Later the steps turn slower with no load change /proc shows
    (a burst the sample misses): two looks in a row at 2x the timed step time the counts again."""
    job = FakeJob({1: 10.0, 2: 600.0})
    job.steps(1 + 1 + TRIAL_STEPS + 1)  # the first, 1's settling and timed steps, 2's settling step
    assert job.threads == 1 and job.tuner.trial.step_ms == pytest.approx({1: 10.0, 2: 600.0})
    assert job.reduces == [1, 1, 2]  # the count, the settling check, the decision
    job.steps(1000)  # 10 s at 10 ms: looks every 2 s, nothing moved
    assert job.applied == [1, 2, 1]
    caplog.set_level(logging.INFO, logger="anyrec.backends.threads")
    caplog.clear()  # from here on (another test may have left the logger at INFO before)
    job.step_ms = {1: 25.0, 2: 15.0}
    steps = 0
    while not job.tuner._schedule and steps < 400:
        job.steps(1)
        steps += 1
    assert 80 < steps <= 3 * 80  # 2 s of steps is one look, and one look at 2.5x is not enough
    assert "step 10.00 -> 25.00 ms" in tuner_lines(caplog)[0]
    job.steps(TRIAL)
    assert job.threads == 2 and job.applied == [1, 2, 1, 1, 2, 2]
    # a peer's far slower settling step stops this rank's timing of that count too
    job = FakeJob({1: 10.0, 2: 7.0}, others=[[2.0], [1.0], [11e-3, 0.5]])
    job.steps(1 + 1 + TRIAL_STEPS + 1)
    assert job.threads == 1 and job.tuner.trial is not None and job.reduces == [1, 1, 2]


def test_ranks_take_the_count_the_slowest_rank_ran_fastest():
    """This rank ran 2 threads faster, a peer ran 2 threads far slower (a busy core under it): the decision
    is the reduced timing's, so every rank keeps 1 thread."""
    # all-reduces: the candidates' count (first step), 2's settling step (far slower?), the medians
    job = FakeJob({1: 10.0, 2: 7.0}, others=[[2.0], [0.0], [11e-3, 60e-3]])
    job.steps(TRIAL)
    assert job.threads == 1 and job.tuner.trial.step_ms == pytest.approx({1: 11.0, 2: 60.0})
    # a peer with 4 cores while this rank has 2: it times 1, 2, 4 and this rank repeats 2 for its third
    job = FakeJob({1: 10.0, 2: 7.0}, others=[[3.0], [0.0], [0.0], [30e-3, 20e-3, 9e-3]])
    job.steps(1 + 3 * (1 + TRIAL_STEPS))
    assert job.threads == 2 and job.applied == [1, 2, 2, 2]  # its third count is its largest, 2
    assert job.tuner.trial.chosen == 2


def test_ranks_make_the_same_collectives_whatever_their_clocks_and_loads():
    """Two ranks as threads, one slow and on a core whose load moves, one quick and quiet: they ask for the
    same all-reduces at the same steps (a rank skipping one would hang its peers), and keep one count."""
    group = FakeGroup(2)
    fast = FakeJob({1: 5.0, 2: 3.0}, reduce=group.reduce_for(0), ranks=2)
    slow = FakeJob({1: 50.0, 2: 300.0}, reduce=group.reduce_for(1), ranks=2)
    errors: list[BaseException] = []

    def train(job: FakeJob, load_moves: bool) -> None:
        try:
            job.steps(500)
            if load_moves:
                job.loads[0] = LOADED
            job.steps(500)
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    ranks = [threading.Thread(target=train, args=(fast, False)),
             threading.Thread(target=train, args=(slow, True))]
    for r in ranks:
        r.start()
    for r in ranks:
        r.join(timeout=60)
    assert not errors and not any(r.is_alive() for r in ranks)
    assert fast.reduces == slow.reduces and len(fast.reduces) > 3  # the count, a decision, looks
    assert fast.reduces.count(2) == 2  # the load moved on one rank only: both timed again
    assert fast.threads == slow.threads == 1  # the slowest rank's timing: 2 threads cost it 300 ms


def test_one_candidate_times_nothing_and_rebinds_by_the_rule():
    """2 ranks on 2 cores: one thread each, nothing to time, no collective; the binding follows the load."""
    binds: list[list[int]] = []
    rebinder = Rebinder(share=[1], allowed=[0, 1], bound=False, bind=lambda c: binds.append(list(c)))
    job = FakeJob({1: 10.0}, share=1, start=1, rebinder=rebinder)
    job.steps(2000)  # 20 s of steps: looks every 2 s
    assert job.reduces == [1] and job.applied == [] and job.tuner.trial is None  # the candidates' count only
    assert binds == [[1]] and rebinder.bound
    job.loads[0] = LOADED  # load came back: unbound at the next look
    job.steps(300)
    assert binds == [[1], [0, 1]] and not rebinder.bound


def test_a_fixed_count_has_nothing_to_time():
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


def _trainer(*overrides):
    _, cfg = compose_config([*TINY, "trainer.eval_steps=0", "trainer.calibrate=never", *overrides])
    return trainer_module.Trainer(cfg)


def test_option_is_in_the_schema_and_every_backend_file():
    for backend in ("auto", "cpu", "cuda", "rocm"):
        _, cfg = compose_config([f"backend={backend}"])
        assert cfg.backend.threads is None  # auto
    _, cfg = compose_config(["backend.threads=3"])
    assert cfg.backend.threads == 3


@TWO_CORES
def test_fixed_option_reaches_torch(one_rank, monkeypatch):  # noqa: F811
    monkeypatch.setattr(cpu, "measure_core_load", lambda cpus: pytest.fail("a fixed count measures nothing"))
    torch.set_num_threads(2)
    t = _trainer("backend.threads=1", "trainer.steps=2")
    try:
        assert torch.get_num_threads() == 1 and t.runtime.binding.threads.setting == 1
        assert not any(isinstance(h, ThreadTuner) for h in t.step_hooks)
        summary = t.train()
    finally:
        t.close()
    assert summary["intra_op_threads"] == 1 and summary["thread_trial_ms"] is None


@TWO_CORES
def test_auto_times_the_trainers_own_steps(one_rank, monkeypatch):  # noqa: F811
    """The default job's path: the tuner times the trainer's own steps (`last_step_s`, read by a hook after
    it) at 1 then 2 threads, keeps the count whose median step was the shorter, and the summary says so."""
    monkeypatch.setattr(cpu, "measure_core_load", lambda cpus: QUIET)  # the start: both cores
    # a steady load: no second timing within the run, whatever the host's other jobs do meanwhile
    steady = functools.partial(ThreadTuner, meter=lambda cpus: FakeMeter([QUIET]), recheck_s=1e6)
    monkeypatch.setattr(threads_module, "ABANDON_FACTOR", math.inf)  # every count timed in full
    monkeypatch.setattr(cpu, "ThreadTuner", steady)
    t = _trainer(f"trainer.steps={TRIAL + 3}")
    seen: list[tuple[int, float | None]] = []  # (threads the step ran at, its seconds)
    try:
        assert any(isinstance(h, ThreadTuner) for h in t.step_hooks) and torch.get_num_threads() == 2
        t.step_hooks.append(lambda tr: seen.append((torch.get_num_threads(), tr.last_step_s)))
        summary = t.train()
    finally:
        t.close()
    ran = [n for n, _ in seen]
    timed = {n: statistics.median(s for _, s in seen[k + 2:k + 2 + TRIAL_STEPS])
             for n, k in ((1, 0), (2, 1 + TRIAL_STEPS))}  # after each count's settling step
    keep = 1 if timed[1] <= timed[2] * (1 + TIE_FRACTION) else 2
    # the count each hook leaves for the next step: 1 for its settle and timed steps, then 2, then the choice
    assert ran == [1] * (1 + TRIAL_STEPS) + [2] * (1 + TRIAL_STEPS) + [keep] * 4
    assert summary["intra_op_threads"] == keep
    assert summary["thread_trial_ms"] == pytest.approx({str(n): ms * 1e3 for n, ms in timed.items()})


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
    # each case's environment: this checkout's anyrec, OMP_NUM_THREADS as the case says
    assert "OMP_NUM_THREADS" not in bench.case_env("auto") and bench.case_env("auto")["PYTHONPATH"] == str(
        bench.ROOT)
    assert bench.case_env("2")["OMP_NUM_THREADS"] == "2" and bench.case_env("omp1")["OMP_NUM_THREADS"] == "1"
    for argv, code in ((["--help"], 0), (["--rounds", "0"], 2), (["--background", "maybe"], 2),
                       (["--background", "on"], 2)):
        with pytest.raises(SystemExit) as e:  # before anything is launched
            bench.main(argv)
        assert e.value.code == code


def test_the_backend_hands_the_tuner_the_world_it_was_given(monkeypatch):
    """The ranks' agreement is over the world the runtime hands down (rank and world size as values, not
    looked up): with 2 ranks the first step's decision is an all-reduce, with 1 none is made."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(threads_module.dist, "all_reduce", lambda t, op: calls.append(t.tolist()))
    before = torch.get_num_threads()
    try:
        for world, expected in ((2, 1), (1, 0)):
            calls.clear()
            backend = cpu.CPUBackend()
            backend.bind_local_rank(0, 1, Switch.false, None, rank=world - 1, world_size=world)
            (tuner,) = backend.step_hooks()
            tuner(SimpleNamespace(last_step_s=None, step=1))
            assert len(calls) == expected, (world, calls)
    finally:
        torch.set_num_threads(before)
