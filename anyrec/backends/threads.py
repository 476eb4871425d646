"""How many threads a CPU rank runs: a start from the cores it can get, then the count that ran the job's
own step fastest, timed while it trains and timed again when the load on the cores changes.

A rank's ceiling is its share of the cores the process may use (all of them for one rank per host). Under
`backend.threads=auto` the rank starts from that share less its part of other processes' use of the cores
(`core_load.CoreLoad.other_cores`, the figure the binding rule reads, split evenly over the local ranks),
the count the calibration and the first steps run at. Which count is fastest depends on more than the load
(an OpenMP team spins at every barrier, so a thread whose core another process holds makes the whole team
wait: 1 rank of dlrm_small at batch 256 on a 2-core host running other jobs, load 2.6-3.1: 74.9 ms per step
with 2 threads, 10.0 ms with 1; yet a load sample alone picked 2 threads at 12.7 ms against 9.1 ms with 1),
so `ThreadTuner`, a step hook, times the job's step at each candidate count (`thread_candidates`: 1, the
powers of two below the share, the share) during the first steps: one step to settle after each change,
then `TRIAL_STEPS` timed steps (none where the settling step already ran `ABANDON_FACTOR` times the best
count so far on some rank: a bad count costs one step, not four); the median per count, the slowest
rank's (an all-reduce), decides: the fewest threads within `TIE_FRACTION` of the fastest. With several
ranks every decision is a collective made at the same step on every rank (the step count alone says when:
never a local clock or load sample), so the ranks make the same calls and take the same count.

Every `RECHECK_S` seconds (with several ranks: that many seconds' worth of steps at the kept count's
agreed time, as the look ends in a collective) the tuner reads what the cores did since its last look
(`core_load.LoadMeter`: /proc/stat, no sleep) and how long the steps took; where other processes' use
stayed `LOAD_CHANGE_CORES` or more away from what it was while the counts were timed, or the steps ran
`SLOWER_FACTOR` times the kept count's timed step, for `RAISE_AFTER` looks in a row, on any rank, every
rank times them again (a short-lived process does not set it off). Under `backend.bind_cores=auto`
the binding is re-decided at the same looks by the binding rule (unbound at once, bound again after
`RAISE_AFTER` looks in a row agree). `backend.threads=N` forces N threads and nothing is timed.

The other pools follow the starting count: torch's inter-op pool is sized to it once at start (torch
allows that only before its first inter-op work), and the data threads (`data.prefetch_workers`, which
run at idle priority with one intra-op thread each) are at most one per intra-op thread (data/prefetch.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from anyrec.backends.core_load import OTHER_BUSY_MAX_CORES, CoreLoad, LoadMeter, choose_binding
from anyrec.choices import Switch

logger = logging.getLogger(__name__)

TRIAL_STEPS = 3  # timed steps per candidate count (after one settling step): 2 counts fit a 10-step warm-up
TIE_FRACTION = 0.05  # a count within this of the fastest counts as fast: the fewest threads win, leaving
# cores to gloo's, the data's and other processes' threads (and more threads are the ones a burst of
# another process slows most: 10-50x on the 2-core host, against at most ~1.3x for one thread too few)
ABANDON_FACTOR = 3.0  # a count whose settling step ran this many times the best median so far, on any
# rank, is not timed further (2 threads beside a busy core: 100-750 ms a step against 8-25 ms with 1)
SLOWER_FACTOR = 2.0  # steps this many times the kept count's timed step, at two looks in a row: time again
RECHECK_S = 2.0  # between looks at the cores: a /proc scan costs ~1 ms, so < 0.1 % of the time
RECHECK_STEPS = (20, 500)  # several ranks: the look's period in steps (RECHECK_S at the kept count's step)
LOAD_CHANGE_CORES = 0.5  # other processes' use of the cores that moved this much since the timing: time again
RAISE_AFTER = 2  # looks in a row that must agree before a rank binds again or times the counts again


@dataclass(frozen=True)
class ThreadChoice:
    """A rank's thread counts and what they were chosen from (`load` is None unless measured)."""

    intra_op: int  # torch.set_num_threads: the OpenMP team of each op
    share_cores: int  # the rank's share of the allowed cores: the ceiling under auto
    setting: int | None  # None: auto
    load: CoreLoad | None = None
    local_world_size: int = 1

    def describe(self) -> str:
        head = f"{self.intra_op} intra-op"
        if self.setting is not None:
            return f"{head} (backend.threads={self.setting})"
        counts = thread_candidates(self.share_cores)
        timed = (f"the job's step timed at {', '.join(map(str, counts))} threads during its first steps"
                 if len(counts) > 1 else "one candidate: nothing to time")
        if self.load is None:
            return f"{head} to start (backend.threads=auto, core load unreadable: the share, " \
                   f"{self.share_cores}; {timed})"
        return (f"{head} to start (backend.threads=auto: share {self.share_cores} cores, other processes "
                f"used {self.load.other_cores:.2f} over {self.load.sample_s:.2f} s, {self.local_world_size} "
                f"local rank(s); {timed})")


def choose_threads(setting: int | None, share_cores: int, local_world_size: int,
                   load: CoreLoad | None) -> ThreadChoice:
    """A forced count as given; auto's start: the rank's share less its part of other processes' busy
    cores, where a core counts as free while others use at most `OTHER_BUSY_MAX_CORES` of it (the binding
    rule's limit), at least 1 (the timing on the job's own step then decides: `ThreadTuner`)."""
    if share_cores < 1 or local_world_size < 1:
        raise ValueError(f"share_cores and local_world_size must be >= 1, got {share_cores}, "
                         f"{local_world_size}")
    if setting is not None:
        return ThreadChoice(setting, share_cores, setting, None, local_world_size)
    if load is None:
        n = share_cores
    else:
        free = share_cores - load.other_cores / local_world_size
        n = max(1, min(share_cores, math.floor(free + OTHER_BUSY_MAX_CORES + 1e-9)))
    return ThreadChoice(n, share_cores, None, load, local_world_size)


def thread_candidates(share_cores: int) -> list[int]:
    """The counts auto times: 1, the powers of two below the share, and the share."""
    if share_cores < 1:
        raise ValueError(f"share_cores must be >= 1, got {share_cores}")
    return [1 << k for k in range(share_cores.bit_length()) if 1 << k < share_cores] + [share_cores]


def set_interop_threads(n: int) -> int:
    """Size torch's inter-op pool to `n` where it is still possible (torch allows it once, before any
    inter-op work); the pool's size either way."""
    if torch.get_num_interop_threads() != n:
        try:
            torch.set_num_interop_threads(n)
        except RuntimeError:
            logger.info("inter-op threads stay %d (set earlier in this process)",
                        torch.get_num_interop_threads())
    return torch.get_num_interop_threads()


def all_reduce_max(values: list[float], world_size: int) -> list[float]:
    """The largest of every rank's `values`, element by element, over the default process group of
    `world_size` ranks (a collective; as given for one rank)."""
    if world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class TimedStep(Protocol):
    """What the tuner reads of the trainer after each step."""

    last_step_s: float | None  # the step just run, None for a chunk's first (it fills the pipeline)


@dataclass
class Rebinder:
    """The binding a rank re-decides under `backend.bind_cores=auto`: bound to `share`, or free on
    `allowed`, applied by `bind` (cpu.bind_threads)."""

    share: list[int]
    allowed: list[int]
    bound: bool
    bind: Callable[[Sequence[int]], None]


@dataclass(frozen=True)
class ThreadTrial:
    """One timing of the candidate counts: each count's median step, the slowest rank's, and the count
    taken."""

    step_ms: dict[int, float]  # this rank's count -> agreed ms per step (inf: no step timed)
    chosen: int
    other_cores: float | None  # other processes' use of the cores while it ran, where readable

    def describe(self) -> str:
        times = ", ".join(f"{n} -> {ms:.2f} ms" for n, ms in self.step_ms.items())
        return (f"{self.chosen} intra-op, the job's step timed at {times} (median of {TRIAL_STEPS} steps "
                f"each, slowest rank)")


class ThreadTuner:
    """A step hook (`Trainer.step_hooks`) under `backend.threads=auto`: times the job's step at each
    candidate count, keeps the fastest (agreed by the ranks), and times again when the load on the cores
    changes; see the module doc. `choice` is the count kept, `trial` the last timing."""

    def __init__(self, choice: ThreadChoice, cpus: Sequence[int], rebinder: Rebinder | None = None,
                 meter: Callable[[Sequence[int]], LoadMeter] = LoadMeter,
                 apply: Callable[[int], None] = torch.set_num_threads,
                 rank: int = 0, world_size: int = 1,
                 reduce_max: Callable[[list[float]], list[float]] | None = None,
                 clock: Callable[[], float] = time.monotonic, recheck_s: float = RECHECK_S) -> None:
        if choice.setting is not None:
            raise ValueError(f"backend.threads={choice.setting} is fixed: nothing to time")
        self.choice, self.rebinder = choice, rebinder
        self.candidates = thread_candidates(choice.share_cores)
        self.trial: ThreadTrial | None = None
        self._cpus, self._meter_of, self._apply = list(cpus), meter, apply
        self._reduce_max = reduce_max or (lambda values: all_reduce_max(values, world_size))
        self._rank, self._world_size, self._clock, self._recheck_s = rank, world_size, clock, recheck_s
        self._k = 0  # candidates every rank times (the most any rank has; agreed at the first step)
        self._by_steps = False  # looks end in a collective: the step count says when, not the clock
        self._schedule: list[tuple[int, bool]] = []  # the coming steps' (candidate index, timed)
        self._samples: list[list[float]] = []
        self._trial_meter: LoadMeter | None = None
        self._meter: LoadMeter | None = None  # since the last look
        self._timed_load: CoreLoad | None = None  # while the counts were last timed
        self._kept_s: float | None = None  # the kept count's timed step (the slowest rank's)
        self._every = RECHECK_STEPS[1]  # steps between looks, where they go by steps
        self._since_look = 0
        self._last_look = clock()
        self._moved_votes = self._bind_votes = 0
        self._look_s, self._look_steps = 0.0, 0  # the steps timed since the last look

    def __call__(self, trainer: TimedStep) -> None:
        """After each training step: the next step of a timing, or a look at the cores when one is due.
        Whether a collective follows depends on the number of calls alone, so every rank makes the same."""
        if not self._k:  # the first step: how many counts the ranks time (they may have other shares)
            self._k = int(self._reduce_max([float(len(self.candidates))])[0])
            self._by_steps = self._k > 1 and self._world_size > 1
            if self._k > 1:
                self._start_trial()
            else:
                self._meter = self._meter_of(self._cpus)
            return
        if self._schedule:
            self._trial_step(trainer.last_step_s)
            return
        if trainer.last_step_s is not None:
            self._look_s, self._look_steps = self._look_s + trainer.last_step_s, self._look_steps + 1
        self._since_look += 1
        if (self._since_look >= self._every if self._by_steps else
                self._clock() - self._last_look >= self._recheck_s):
            self._look()

    def count(self, index: int) -> int:
        """This rank's count for candidate `index` (a rank with fewer candidates repeats its largest)."""
        return self.candidates[min(index, len(self.candidates) - 1)]

    def _start_trial(self) -> None:
        self._schedule = [(i, k > 0) for i in range(self._k) for k in range(1 + TRIAL_STEPS)]
        self._samples = [[] for _ in range(self._k)]
        self._trial_meter = self._meter_of(self._cpus)
        self._apply(self.count(0))

    def _trial_step(self, step_s: float | None) -> None:
        index, timed = self._schedule.pop(0)
        if timed and step_s is not None:
            self._samples[index].append(step_s)
        if not timed and index > 0:  # a later count's settling step: one all-reduce on every rank
            best = min((statistics.median(s) for s in self._samples[:index] if s), default=math.inf)
            slow = step_s is not None and step_s > ABANDON_FACTOR * best
            if self._reduce_max([float(slow)])[0] > 0:  # far slower on some rank: timed no further
                self._samples[index] = [step_s] if step_s is not None else []
                self._schedule = [e for e in self._schedule if e[0] != index]
        if not self._schedule:
            self._decide()
        elif self._schedule[0][0] != index:
            self._apply(self.count(self._schedule[0][0]))

    def _decide(self) -> None:
        """The slowest rank's median per candidate (one all-reduce): every rank takes the same index."""
        mine = [statistics.median(s) if s else math.inf for s in self._samples]
        agreed = self._reduce_max(mine)
        load = self._trial_meter.read() if self._trial_meter is not None else None
        finite = [i for i, t in enumerate(agreed) if math.isfinite(t)]
        self._kept_s = None
        if finite:
            fastest = min(agreed[i] for i in finite)
            best = next(i for i in finite if agreed[i] <= fastest * (1 + TIE_FRACTION))
            n, self._kept_s = self.count(best), agreed[best]
            self._every = min(RECHECK_STEPS[1], max(RECHECK_STEPS[0], math.ceil(self._recheck_s / fastest)))
        else:  # no step was timed (chunks of one step): the count kept stays
            n = self.choice.intra_op
        self._apply(n)
        step_ms = {self.count(i): t * 1e3 for i, t in enumerate(agreed)}
        self.trial = ThreadTrial(step_ms, n, load.other_cores if load is not None else None)
        self.choice = dataclasses.replace(self.choice, intra_op=n, load=load or self.choice.load)
        self._timed_load = load
        self._meter, self._since_look, self._last_look = self._meter_of(self._cpus), 0, self._clock()
        self._moved_votes, self._look_s, self._look_steps = 0, 0.0, 0
        if self._rank == 0:
            logger.info("threads: %s", self.trial.describe())

    def _look(self) -> None:
        """The cores since the last look: rebind by the rule; where other processes' use moved, or the steps
        ran `SLOWER_FACTOR` times the timed one, on any rank at `RAISE_AFTER` looks in a row, every rank
        times the counts again."""
        load = self._meter.read() if self._meter is not None else None
        step_s = self._look_s / self._look_steps if self._look_steps else None
        self._meter, self._since_look, self._last_look = self._meter_of(self._cpus), 0, self._clock()
        self._look_s, self._look_steps = 0.0, 0
        if load is not None and self.rebinder is not None:
            self._rebind(load)
        if self._k < 2:
            return
        if self._timed_load is None:
            self._timed_load = load  # unreadable during the timing: compare with the first look that reads
        moved = (load is not None and self._timed_load is not None and
                 abs(load.other_cores - self._timed_load.other_cores) >= LOAD_CHANGE_CORES)
        slower = step_s is not None and self._kept_s is not None and step_s > SLOWER_FACTOR * self._kept_s
        self._moved_votes = self._moved_votes + 1 if moved or slower else 0
        if self._reduce_max([float(self._moved_votes >= RAISE_AFTER)])[0] > 0:
            if self._rank == 0:
                was = self._timed_load.other_cores if self._timed_load is not None else math.nan
                now = load.other_cores if load is not None else math.nan
                took = f"{step_s * 1e3:.2f}" if step_s is not None else "-"
                kept = f"{self._kept_s * 1e3:.2f}" if self._kept_s is not None else "-"
                logger.info("threads: the load changed on a rank since the counts were timed (here other "
                            "processes %.2f -> %.2f cores, step %s -> %s ms): timing them again", was, now,
                            kept, took)
            self._start_trial()

    def _rebind(self, load: CoreLoad) -> None:
        r = self.rebinder
        bind = choose_binding(Switch.auto, lambda: load).bind
        self._bind_votes = self._bind_votes + 1 if bind and not r.bound else 0
        if (not bind and r.bound) or self._bind_votes >= RAISE_AFTER:
            self._bind_votes = 0
            r.bind(r.share if bind else r.allowed)
            r.bound = bind
            logger.info("threads now %s cores %s: other processes used %.2f cores over the last %.1f s "
                        "(limit %s)", "bound to" if bind else "free on",
                        ",".join(map(str, r.share if bind else r.allowed)), load.other_cores, load.sample_s,
                        OTHER_BUSY_MAX_CORES)
