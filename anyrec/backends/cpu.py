"""The CPU backend: host memory is the device, gloo does the collectives."""

from __future__ import annotations

import functools
import logging
import os
import platform
from collections.abc import Callable, Sequence

import torch

from anyrec.backends.core_load import CoreLoad, choose_binding, measure_core_load
from anyrec.backends.interface import Backend, Binding, DeviceFacts
from anyrec.backends.specs import SKUS, DeviceSpec
from anyrec.backends.threads import (
    Rebinder,
    ThreadChoice,
    ThreadTuner,
    choose_threads,
    set_interop_threads,
)
from anyrec.choices import Switch

logger = logging.getLogger(__name__)


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return SKUS["cpu"].memory_bytes


def core_share(cpus: Sequence[int], local_rank: int, local_world_size: int) -> list[int] | None:
    """Local rank `local_rank`'s contiguous share of `cpus` when `local_world_size` ranks split them
    (the first ranks get one fewer where they do not divide evenly), None with fewer cpus than ranks."""
    cpus = sorted(cpus)
    n = len(cpus)
    if n < local_world_size:
        return None
    return cpus[local_rank * n // local_world_size:(local_rank + 1) * n // local_world_size]


def allowed_cores() -> list[int]:
    """The cores this process may run on now."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@functools.cache
def _host_cores() -> list[int]:
    """The cores the process could use before any binding: binding twice (a calibration before the
    trainer, or several trainers in one process) shares the same cores again, not the bound share."""
    return allowed_cores()


def bind_threads(cpus: Sequence[int]) -> None:
    """Bind every thread of this process (and so every thread they start later) to `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


class CPUBackend(Backend):
    """Runs everything on the host; always available."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    # Triton reaches the CPU only through its interpreter: never chosen by auto, only when forced.
    kernel_order = {**Backend.kernel_order, "embedding": ("fbgemm", "torch", "triton"),
                    "interaction": ("torch", "triton"), "dcn_cross": ("torch", "triton"),
                    "hstu_attention": ("torch", "triton")}
    _tuner: ThreadTuner | None = None  # under backend.threads=auto, once bind_local_rank ran

    @classmethod
    def probe_facts(cls) -> DeviceFacts:
        return DeviceFacts(device_count=1, device_name=platform.processor() or platform.machine(),
                           arch=platform.machine(), memory_bytes=_host_memory_bytes(),
                           multiprocessors=os.cpu_count() or 1)

    @classmethod
    def matches(cls, facts: DeviceFacts) -> bool:
        return True

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def bind_local_rank(self, local_rank: int, local_world_size: int, bind_cores: Switch = Switch.auto,
                        threads: int | None = None, rank: int = 0, world_size: int = 1) -> Binding:
        """Each rank runs torch's threads on its own contiguous share of the host's cores, bound to it
        where `bind_cores` says so (auto: see core_load), as many as `threads` says (None, auto: a start, see
        threads); returns the decisions (the thread count auto starts from), and under auto
        `self.step_hooks()` times the job's step at each candidate count while it trains, agreed over the
        job's `world_size` ranks (this one is `rank`)."""
        self._tuner: ThreadTuner | None = None
        forced = threads  # parsed where the config was built (anyrec.config.parse_threads)
        allowed = _host_cores()
        share = (core_share(allowed, local_rank, local_world_size) if allowed and local_world_size > 1
                 else allowed or None)
        if share is None:
            cores = len(allowed) or os.cpu_count() or 1
            if allowed:
                logger.warning("%d local ranks on %d cores: ranks share cores, threads not bound",
                               local_world_size, cores)
            choice = self._choose_threads(forced, max(1, cores // local_world_size), local_world_size,
                                          allowed, None, rank, world_size)
            return Binding(threads=choice)
        readable = os.path.isdir("/proc/self/task")
        load = None
        if readable and (forced is None or local_world_size > 1 and bind_cores is Switch.auto):
            load = measure_core_load(allowed)  # one sample serves both rules
        choice = self._choose_threads(forced, len(share), local_world_size, allowed, load, rank, world_size)
        if local_world_size <= 1 or not readable:
            self._log_threads(local_rank, local_world_size, choice)
            return Binding(threads=choice)
        bind_choice = choose_binding(bind_cores, lambda: load)
        bind = bind_choice.bind
        if bind:
            bind_threads(share)
        if self._tuner is not None and bind_choice.setting is Switch.auto:
            self._tuner.rebinder = Rebinder(share, allowed, bind, bind_threads)
        logger.info("local rank %d of %d: threads %s cores %s (%s)", local_rank, local_world_size,
                    "bound to" if bind else "free on", ",".join(map(str, share if bind else allowed)),
                    bind_choice.describe())
        self._log_threads(local_rank, local_world_size, choice)
        return Binding(tuple(share) if bind else None, bind_choice, choice)

    def _choose_threads(self, forced: int | None, share_cores: int, local_world_size: int,
                        allowed: list[int], load: CoreLoad | None, rank: int, world_size: int
                        ) -> ThreadChoice:
        choice = choose_threads(forced, share_cores, local_world_size, load)
        torch.set_num_threads(choice.intra_op)
        self.interop_threads = set_interop_threads(choice.intra_op)
        if forced is None:  # on every rank alike: the tuner's timings are collectives
            self._tuner = ThreadTuner(choice, allowed, rank=rank, world_size=world_size)
        return choice

    def _log_threads(self, local_rank: int, local_world_size: int, choice: ThreadChoice) -> None:
        # the start is detail: the count the timing keeps is logged once it is known
        logger.debug("local rank %d of %d: %s, %d inter-op threads", local_rank, local_world_size,
                     choice.describe(), self.interop_threads)

    def step_hooks(self) -> list[Callable[[object], None]]:
        """The thread timing (and binding re-check) under backend.threads=auto, as a step hook; else none."""
        return [self._tuner] if self._tuner is not None else []

    def queues_device_work(self) -> bool:
        return False  # the host runs every op before its call returns

    def device_spec(self) -> DeviceSpec:
        cpu = SKUS["cpu"]
        mem = self.facts.memory_bytes or cpu.memory_bytes
        return cpu.replace(arch=self.facts.arch or cpu.arch, memory_bytes=mem, host_memory_bytes=mem)
