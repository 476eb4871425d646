"""What bounds and shows one calibration run: its time limit, the signals that stop it, its progress bar.

`anyrec.calibrate` and the calibration on first contact (anyrec.calibration.first_contact) measure inside one
`CalibrationRun`. SIGINT, SIGTERM and SIGHUP are caught by the trainer's `StopRequest` (its watcher
thread notices them even while the main thread is busy); the measurements check `check()` between
repetitions, and a step point's trainer stops at its own step boundary, so the run raises
`CalibrationStopped` within a measurement's repetition; a rank still not out `STOP_GRACE_S` after the
signal (e.g. in a collective with a rank that left) exits at once, 128 + the signal's number, as training
does. Nothing is written before the last measurement, and then whole (atomic writes).

The time limit (`calibrate.time_limit_s`) is split into phase shares; a measurement repeats until its
repetition budget or its phase's share is spent, a phase whose share is gone keeps its datasheet figures,
and the run lists what fell back (`fallbacks`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from anyrec.runtime.agreement import Agreement, How
from anyrec.runtime.shutdown import StopRequest

STOP_GRACE_S = 4.0  # after a signal, a rank not out by then exits at once (the promise is 5 s)


class CalibrationStopped(Exception):
    """A signal stopped the calibration: nothing was written; the entry point exits 128 + its number."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}: nothing written")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@dataclass(frozen=True)
class Timing:
    """A measurement's repetitions: the median seconds per call and their spread (interquartile range over
    the median; 0 for fewer than two repetitions)."""

    median_s: float
    spread: float
    reps: int

    @classmethod
    def of(cls, times_s: list[float]) -> Timing:
        t = sorted(times_s)
        n = len(t)
        median = t[n // 2]
        spread = (t[(3 * n) // 4] - t[n // 4]) / median if n > 1 and median > 0 else 0.0
        return cls(median, spread, n)


@dataclass
class CalibrationRun:
    """One calibration's clock, stop request and progress bar (a bar only on rank 0, and only with
    `progress`); `spreads` and `fallbacks` are what it records on the way."""

    limit_s: float
    deadline: float  # time.monotonic() seconds: the whole run's end
    world_size: int = 1
    rank: int = 0
    stop: StopRequest | None = None
    bar: tqdm | None = None
    until: float = 0.0  # the current phase's end (<= deadline)
    agreement: Agreement | None = None  # the ranks' decisions (None: one process, a library call)
    spreads: dict[str, float] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    approximated: list[str] = field(default_factory=list)

    @classmethod
    def begin(cls, limit_s: float, rank: int = 0, world_size: int = 1, progress: bool = True,
              timeout_s: float = 600.0, agreement: Agreement | None = None,
              started: float | None = None) -> CalibrationRun:
        """Catch the stop signals (main thread only; `close()` undoes it). `limit_s` counts from `started`
        (time.monotonic() when the job began: `Runtime.started`, its launcher's start for an entry point,
        so the limit bounds what a user waits, start-up included), else from now. With several ranks,
        `agreement` (every rank's, begun at the same point) takes the run's decisions."""
        stop = StopRequest(rank, world_size, 1, STOP_GRACE_S, timeout_s,
                           boundary="the current measurement", lost="nothing written")
        stop.install()
        bar = tqdm(total=0, desc="calibrate", unit="pt", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
                   disable=not (rank == 0 and progress))
        deadline = (time.monotonic() if started is None else started) + limit_s
        return cls(limit_s, deadline, world_size, rank, stop, bar, deadline, agreement=agreement)

    @classmethod
    def unbounded(cls) -> CalibrationRun:
        """No limit, no signals, no bar (a library call's default)."""
        return cls(float("inf"), float("inf"), until=float("inf"))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.stop is not None:
            self.stop.restore()

    # ---- time -----------------------------------------------------------------------------------

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def phase(self, share: float) -> None:
        """The next phase may take `share` of the time left."""
        now = time.monotonic()
        self.until = min(self.deadline, now + share * max(0.0, self.deadline - now))

    def expired(self) -> bool:
        """The current phase's share is spent (this rank's clock)."""
        return time.monotonic() >= self.until

    def agree(self, name: str, local: Callable[[], Any], how: How = "main") -> Any:
        """Decision `name`, taken once for every rank from each rank's `local()` view (`how`: rank 0's, the
        min, the max, any): what decides which collectives follow is never a rank's own clock or sample.
        A stop signal any rank caught stops every rank here (CalibrationStopped), at the same decision."""
        if self.agreement is None:
            self.check()
            return local()
        value = self.agreement.decide(name, local, how, extra=self._signum)
        if self.agreement.extra:
            raise CalibrationStopped(self.agreement.extra)
        return value

    def _signum(self) -> int:
        return (self.stop.signum or 0) if self.stop is not None else 0

    def agreed_left_s(self, what: str = "time left") -> float:
        """The least time left over the ranks, agreed as decision `what`: what ranks that must train or
        measure a collective together decide by, so they decide alike."""
        return self.agree(what, lambda: min(self.left_s(), self.until - time.monotonic()), "min")

    def fell_back(self, what: str) -> None:
        """`what` was not measured in time (or not usable): it keeps its built-in figure; said once."""
        self.fallbacks.append(what)

    def approximate(self, what: str) -> None:
        """`what` was measured only in part, or fits its points poorly (a busy host): its figures are used,
        and the run's verdict says they are not to be trusted later."""
        self.approximated.append(what)

    # ---- signals and progress -------------------------------------------------------------------

    def check(self) -> None:
        """Raise CalibrationStopped once a stop signal arrived."""
        if self.stop is not None and self.stop.signum:
            raise CalibrationStopped(self.stop.signum)

    def stopped_by(self, signal_name: str | None) -> None:
        """A trainer inside the run stopped for `signal_name` (it caught the signal itself): stop too."""
        if signal_name:
            raise CalibrationStopped(int(signal.Signals[signal_name]))

    def expect(self, count: int) -> None:
        """`count` more measurements are planned (the bar's total)."""
        if self.bar is not None:
            self.bar.total += count
            self.bar.refresh()

    def measuring(self, name: str) -> None:
        """`name` is being measured now (checks for a stop first)."""
        self.check()
        if self.bar is not None:
            left = max(0.0, self.left_s())
            self.bar.set_postfix_str(f"{name} | {left:.0f} s left" if left < float("inf") else name,
                                     refresh=True)

    def measured(self, name: str, timing: Timing | None = None) -> None:
        """`name` is done: one step of the bar, and its spread recorded where it was repeated."""
        if timing is not None and timing.reps > 1:
            self.spreads[name] = timing.spread
        if self.bar is not None:
            self.bar.update(1)


def exit_stopped(prog: str, e: CalibrationStopped, is_main: bool) -> None:
    """Leave as training stopped by a signal does: one line (rank 0), 128 + the signal's number, and no
    interpreter teardown (seconds with torch loaded) while whoever sent the signal waits."""
    if is_main:
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(e.exit_code)
