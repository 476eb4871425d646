"""Batches made ahead of the step by background threads, in order, optionally in pinned memory.

`Prefetched(source, depth, workers, pin, idle)` wraps any source: `batch(step)` is the source's,
`iter_from(step, n)` yields the same batches in the same order while `workers` threads make up to `depth` of
them ahead (worker w makes steps step + w, step + w + workers, ...). Reading files, slicing memory maps,
hashing ids and torch ops release the GIL, so the work overlaps the step. With `pin` (the training backend's
`Backend.pin`, only where it can page-lock memory for its device) batches land in page-locked memory, so the
copy torchrec's TrainPipelineSparseDist issues on its own stream is asynchronous.

`idle` is for a step that computes on the same CPU cores (training on the CPU): each worker runs its torch ops
on one intra-op thread and, on Linux, at idle scheduling priority (SCHED_IDLE), so it only takes a core the
step leaves free; there are at most as many as the step's threads (`torch.get_num_threads()` when the
iterator starts: under `backend.threads=auto` the cores this rank gets). At normal priority a worker
preempts the step's OpenMP threads and the step's parallel regions wait for the slowest one: measured on
2 cores (DLRMv2-shaped batches, `benchmarks/train_step.py`), a normal-priority worker made the loop slower
than generating in the step, an idle one faster.

A worker's exception is raised in the consumer, unchanged (so the file and row it names reach the trainer),
when the consumer reaches the batch that failed. Threads are daemons that stop when the iterator is exhausted,
closed or garbage-collected; nothing outlives the process.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torchrec.datasets.utils import Batch

_POLL_S = 0.1  # how often a blocked thread looks for a stop request


def _yield_to_the_step() -> None:
    """This thread: one intra-op thread and idle scheduling priority where the OS has it (best
    effort: elsewhere it runs at normal priority)."""
    torch.set_num_threads(1)  # this thread's OpenMP/MKL threads; also ATen's default for new threads
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread


def _work(make: Callable[[int], Batch], steps: range, pin: Callable[[Batch], Batch] | None, out: queue.Queue,
          stop: threading.Event, idle_default: int | None = None) -> None:
    """Make the batches of `steps` into `out` until done, failed (the exception goes in their place) or
    asked to stop. An idle worker (`idle_default`: the consumer's thread count) yields to the step, and
    on its way out puts back ATen's default for new threads, which its set_num_threads(1) changed
    (setting it from the consumer instead, while the step runs, slowed the step: measured)."""
    if idle_default is not None:
        _yield_to_the_step()
    try:
        for step in steps:
            if stop.is_set():
                return
            try:
                item: Any = make(step)
                if pin is not None:
                    item = pin(item)
            except BaseException as e:  # noqa: BLE001 - every failure goes to the consumer
                item = e
            while not stop.is_set():
                try:
                    out.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
    finally:
        if idle_default is not None:
            torch.set_num_threads(idle_default)


def _stop(stop: threading.Event, threads: list[threading.Thread]) -> None:
    stop.set()
    for t in threads:
        if t is not threading.current_thread():
            t.join(timeout=10)


class PrefetchIterator(Iterator[Batch]):
    """Batches `first`, `first + 1`, ... (`count` of them, or forever when None) made ahead."""

    def __init__(self, make: Callable[[int], Batch], first: int, count: int | None, depth: int,
                 workers: int = 1, pin: Callable[[Batch], Batch] | None = None, idle: bool = False) -> None:
        if depth < 1 or workers < 1:
            raise ValueError(f"data.prefetch and data.prefetch_workers must be >= 1, got {depth}, {workers}")
        idle_default = torch.get_num_threads() if idle else None
        # idle workers: at most one per thread of the step (the CPU backend's count for the cores it gets)
        workers = min(workers, depth, idle_default or workers)
        end = first + count if count is not None else None
        self._first, self._next, self._end = first, first, end
        self._stop = threading.Event()
        per_worker = -(-depth // workers)
        self._queues = [queue.Queue(maxsize=per_worker) for _ in range(workers)]
        self._threads = []
        for w, q in enumerate(self._queues):
            steps = range(first + w, end if end is not None else 2**62, workers)
            t = threading.Thread(target=_work, args=(make, steps, pin, q, self._stop, idle_default),
                                 name=f"anyrec-prefetch-{w}", daemon=True)
            self._threads.append(t)
        self._finalizer = weakref.finalize(self, _stop, self._stop, self._threads)
        for t in self._threads:
            t.start()

    def __next__(self) -> Batch:
        if self._end is not None and self._next >= self._end or self._stop.is_set():
            self.close()
            raise StopIteration
        w = (self._next - self._first) % len(self._queues)
        q, t = self._queues[w], self._threads[w]
        while True:
            try:
                item = q.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not t.is_alive() and q.empty():
                    self.close()
                    raise RuntimeError(f"prefetch worker {w} stopped before batch {self._next}") from None
        if isinstance(item, BaseException):
            self.close()
            raise item
        self._next += 1
        return item

    def close(self) -> None:
        """Stop the workers and wait for them (each finishes the batch it is making)."""
        self._finalizer()


class Prefetched:
    """A source whose `iter_from` makes batches ahead in background threads (see the module doc)."""

    def __init__(self, source: Any, depth: int, workers: int = 1, pin: Callable[[Batch], Batch] | None = None,
                 idle: bool = False) -> None:
        self.source, self.depth, self.workers, self.pin = source, depth, workers, pin
        self.idle = idle
        # Work on each made batch that belongs with it, done in the worker (the trainer's input value
        # checks: O(ids) tensor ops off the step's thread). Set by the consumer; None = nothing.
        self.prepare: Callable[[Batch], None] | None = None

    def _make_prepared(self, step: int) -> Batch:
        batch = self.source.batch(step)
        self.prepare(batch)
        return batch

    def __getattr__(self, name: str) -> Any:
        # batch (made here, no thread), batch_size, malformed_rows, ...: the wrapped source's.
        return getattr(self.__dict__["source"], name)

    def iter_from(self, step: int = 0, num_steps: int | None = None) -> PrefetchIterator:
        """Batches `step`, `step + 1`, ... made ahead by the workers."""
        make = self.source.batch if self.prepare is None else self._make_prepared
        return PrefetchIterator(make, step, num_steps, self.depth, self.workers, self.pin, self.idle)
