"""How many threads a CPU rank runs, chosen from the cores it can get, and re-checked while it trains.

A rank's ceiling is its share of the cores the process may use (all of them for one rank per host). Under
`backend.threads=auto` other processes' use of the cores (`core_load.CoreLoad.other_cores`, the figure the
binding rule reads) comes off that share, split evenly over the local ranks, and the rank runs one OpenMP
thread per core left: an OpenMP team spins at every barrier, so a thread whose core another process holds
makes the whole team wait for it (1 rank of dlrm_small at batch 256 on a 2-core host running other jobs,
load 2.6-3.1: 74.9 ms per step with 2 threads, 10.0 ms with 1). On a quiet host the count is the share,
as before this rule existed, so a quiet run's threads (and numbers) are unchanged.

The host changes under a long job, so `ThreadTuner`, a step hook, looks again every `RECHECK_S` seconds at
what the cores did since its last look (`core_load.LoadMeter`: two reads of /proc/stat, no sleep) and
lowers the count at once when other processes take cores, raises it only after `RAISE_AFTER` looks in a
row agree (a short-lived process does not make it flap), and re-decides the binding the same way where
`backend.bind_cores=auto` chose it; each change is logged once. `backend.threads=N` forces N threads and
nothing is re-checked.

The other pools follow the intra-op count: torch's inter-op pool is sized to it once at start (torch
allows that only before its first inter-op work), and the data threads (`data.prefetch_workers`, which
run at idle priority with one intra-op thread each) are at most one per intra-op thread (data/prefetch.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from anyrec.calibration.core_load import OTHER_BUSY_MAX_CORES, CoreLoad, LoadMeter, choose_binding

logger = logging.getLogger(__name__)

RECHECK_S = 2.0  # between looks at the cores: a /proc scan costs ~1 ms, so < 0.1 % of the time
RAISE_AFTER = 2  # looks in a row that must find cores freed before threads go up or a rank binds again


def thread_setting(value: int | str) -> int | None:
    """`backend.threads` as None (auto) or a positive thread count."""
    s = str(value).strip().lower()
    if s == "auto":
        return None
    try:
        n = int(s)
    except ValueError:
        n = 0
    if n < 1 or isinstance(value, bool):
        raise ValueError(f"backend.threads={value!r}: choose auto or a thread count >= 1")
    return n


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
        if self.load is None:
            return f"{head} (backend.threads=auto, core load unreadable: the share, {self.share_cores})"
        return (f"{head} (backend.threads=auto: share {self.share_cores} cores, other processes used "
                f"{self.load.other_cores:.2f} over {self.load.sample_s:.2f} s, {self.local_world_size} "
                f"local rank(s))")


def choose_threads(setting: int | None, share_cores: int, local_world_size: int,
                   load: CoreLoad | None) -> ThreadChoice:
    """A forced count as given; auto: the rank's share less its part of other processes' busy cores, where
    a core counts as free while others use at most `OTHER_BUSY_MAX_CORES` of it (the binding rule's limit),
    at least 1."""
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


@dataclass
class Rebinder:
    """The binding a rank re-decides under `backend.bind_cores=auto`: bound to `share`, or free on
    `allowed`, applied by `bind` (cpu.bind_threads)."""

    share: list[int]
    allowed: list[int]
    bound: bool
    bind: Callable[[Sequence[int]], None]


class ThreadTuner:
    """A step hook (`Trainer.step_hooks`): every `every_s` seconds, the window's core load; threads and
    binding follow other processes' use of the cores (see the module doc). `choice` is the current one."""

    def __init__(self, choice: ThreadChoice, cpus: Sequence[int], rebinder: Rebinder | None = None,
                 meter: Callable[[Sequence[int]], LoadMeter] = LoadMeter,
                 apply: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.monotonic, every_s: float = RECHECK_S) -> None:
        if choice.setting is not None:
            raise ValueError(f"backend.threads={choice.setting} is fixed: nothing to re-check")
        self.choice, self.rebinder = choice, rebinder
        self._cpus, self._meter_of, self._apply = list(cpus), meter, apply
        self._clock, self._every_s = clock, every_s
        self._meter = meter(self._cpus)
        self._last = clock()
        self._raise_votes = self._bind_votes = 0

    def __call__(self, _trainer: object = None) -> None:
        now = self._clock()
        if now - self._last < self._every_s:
            return
        load = self._meter.read()
        self._meter, self._last = self._meter_of(self._cpus), now
        if load is not None:
            self.observe(load)

    def observe(self, load: CoreLoad) -> None:
        """Act on one window's load: fewer threads (or unbind) at once, more (or bind) after agreement."""
        c = self.choice
        want = choose_threads(None, c.share_cores, c.local_world_size, load)
        self._raise_votes = self._raise_votes + 1 if want.intra_op > c.intra_op else 0
        if want.intra_op < c.intra_op or self._raise_votes >= RAISE_AFTER:
            self._raise_votes = 0
            self._apply(want.intra_op)
            self.choice = want
            logger.info("threads %d -> %d: other processes used %.2f cores over the last %.1f s",
                        c.intra_op, want.intra_op, load.other_cores, load.sample_s)
        if self.rebinder is not None:
            self._rebind(load)

    def _rebind(self, load: CoreLoad) -> None:
        r = self.rebinder
        bind = choose_binding("auto", lambda: load).bind
        self._bind_votes = self._bind_votes + 1 if bind and not r.bound else 0
        if (not bind and r.bound) or self._bind_votes >= RAISE_AFTER:
            self._bind_votes = 0
            r.bind(r.share if bind else r.allowed)
            r.bound = bind
            logger.info("threads now %s cores %s: other processes used %.2f cores over the last %.1f s "
                        "(limit %s)", "bound to" if bind else "free on",
                        ",".join(map(str, r.share if bind else r.allowed)), load.other_cores, load.sample_s,
                        OTHER_BUSY_MAX_CORES)
