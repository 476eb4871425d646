"""Whether a CPU rank should pin its threads, decided from what the host's cores are doing at start.

Pinning each local rank to its share of the cores keeps caches warm when the ranks have the cores to
themselves (a 2-rank step on a quiet 2-core host: ~25 % faster bound). When other processes use them, a
pinned rank cannot leave a shared core while its peer waits for it in the next collective (the same host
loaded by another 2-rank job: bound ranks ~25 % slower). So `backend.bind_cores=auto` samples the cores'
load for `SAMPLE_S` (`/proc/stat`), subtracts this job's own processes (this rank, its launcher and the
launcher's other children), and binds only where the rest stays under `OTHER_BUSY_MAX_CORES`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from anyrec.choices import Switch

SAMPLE_S = 0.25  # long enough for the kernel's tick accounting (10 ms) to average over 25 ticks per core
# Empirical: a pinned rank sharing its core with a process that needs a quarter of it already waits
# that long per step, and so does its peer in the collective; idle desktops and editors stay far below.
OTHER_BUSY_MAX_CORES = 0.25


@dataclass(frozen=True)
class CoreLoad:
    """Cores' worth of busy time over a sample: everything on the sampled cores and this job's part."""

    busy_cores: float
    own_cores: float
    sample_s: float

    @property
    def other_cores(self) -> float:
        """What processes outside this job used (never below zero: own time may run on other cores)."""
        return max(0.0, self.busy_cores - self.own_cores)


@dataclass(frozen=True)
class BindChoice:
    """The binding decision and what it was made from (`load` is None unless measured)."""

    bind: bool
    setting: Switch
    load: CoreLoad | None = None

    def describe(self) -> str:
        if self.setting is not Switch.auto:
            return f"backend.bind_cores={self.setting}"
        if self.load is None:
            return "backend.bind_cores=auto, core load unreadable: bound as on a quiet host"
        return (f"backend.bind_cores=auto: other processes used {self.load.other_cores:.2f} cores over "
                f"{self.load.sample_s:.2f} s (this job {self.load.own_cores:.2f}), limit "
                f"{OTHER_BUSY_MAX_CORES}: {'bound' if self.bind else 'free'}")


def choose_binding(setting: Switch, measure: Callable[[], CoreLoad | None]) -> BindChoice:
    """true/false force it; auto binds where other processes leave the cores (nearly) free."""
    if setting is not Switch.auto:
        return BindChoice(setting is Switch.true, setting)
    load = measure()
    return BindChoice(load is None or load.other_cores <= OTHER_BUSY_MAX_CORES, setting, load)


def _cpu_jiffies(cpus: set[int]) -> tuple[int, int]:
    """(busy, total) clock ticks of `cpus` since boot; busy counts steal (another VM's use) too."""
    busy = total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *vals = line.split()
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                continue
            ticks = [int(v) for v in vals[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (None once the process has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def job_pids() -> list[int]:
    """This process, its launcher (torchrun's agent) and the launcher's other children (local ranks)."""
    parent = os.getppid()
    children = {int(e) for e in os.listdir("/proc") if e.isdigit() and (_stat(e) or [0, 0])[1] == str(parent)}
    return sorted({os.getpid(), parent} | children)


def _process_ticks(pids: Iterable[int]) -> int:
    """User + system clock ticks of every thread of `pids` (ended ones count nothing)."""
    stats = [f for f in map(_stat, pids) if f is not None]
    return sum(int(f[11]) + int(f[12]) for f in stats)  # utime, stime (fields 14 and 15 of proc(5))


def measure_core_load(cpus: Iterable[int], sample_s: float = SAMPLE_S,
                      pids: Callable[[], list[int]] = job_pids) -> CoreLoad | None:
    """Busy cores on `cpus` over `sample_s`, and this job's share; None where /proc is unreadable."""
    cpu_set = set(cpus)
    try:
        own = pids()
        busy0, total0 = _cpu_jiffies(cpu_set)
        own0 = _process_ticks(own)
        time.sleep(sample_s)
        busy1, total1 = _cpu_jiffies(cpu_set)
        own1 = _process_ticks(own)
    except (OSError, ValueError, IndexError):
        return None
    per_core = (total1 - total0) / max(1, len(cpu_set))  # ticks one core had during the sample
    if per_core <= 0:
        return None
    return CoreLoad(busy_cores=(busy1 - busy0) / per_core, own_cores=(own1 - own0) / per_core,
                    sample_s=sample_s)


def own_pids() -> list[int]:
    """This job's processes: under torchrun its launcher and local ranks (`job_pids`); run alone, only this
    process (a shell's other children, e.g. a job started before it, are not this job)."""
    return job_pids() if "TORCHELASTIC_RUN_ID" in os.environ else [os.getpid()]


class LoadMeter:
    """The cores' load over a whole stretch of work (no sleeping sample): `read()` is what the cores did
    since the meter was made, and this job's part."""

    def __init__(self, cpus: Iterable[int], pids: Callable[[], list[int]] = own_pids) -> None:
        self._cpus, self._pids = set(cpus), pids
        self._start = time.monotonic()
        try:
            self._busy0, self._total0 = _cpu_jiffies(self._cpus)
            self._own0 = _process_ticks(pids())
        except (OSError, ValueError, IndexError):
            self._total0 = -1

    @property
    def cores(self) -> int:
        return len(self._cpus)

    def read(self) -> CoreLoad | None:
        """Busy and own cores since the meter started; None where /proc is unreadable or no tick passed."""
        if self._total0 < 0:
            return None
        try:
            busy1, total1 = _cpu_jiffies(self._cpus)
            own1 = _process_ticks(self._pids())
        except (OSError, ValueError, IndexError):
            return None
        per_core = (total1 - self._total0) / max(1, len(self._cpus))
        if per_core <= 0:
            return None
        return CoreLoad(busy_cores=(busy1 - self._busy0) / per_core, own_cores=(own1 - self._own0) / per_core,
                        sample_s=time.monotonic() - self._start)
