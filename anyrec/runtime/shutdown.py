"""Clean shutdown and bounded waits: every rank stops at the same step on SIGINT/SIGTERM/SIGHUP, a lost
or stuck peer is named, an orphaned worker leaves, and nothing waits forever.

Ranks agree through the process group's store every `trainer.stop_check_every` steps: each rank posts
whether it saw a signal and reads the others' posts, host-side only (no device sync, no collective on
the accelerator). A watcher thread notices a signal through `signal.set_wakeup_fd`, so even a main
thread blocked in a collective with a stopped peer cannot delay it: if the ranks have not agreed to
stop within `trainer.stop_grace_s`, the process exits anyway (128 + signal number).

A `Heartbeat` thread per rank names a stopped or stuck peer, and ends a worker whose launcher is gone,
within seconds and in one line.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from anyrec.runtime.agreement import AGREE_TIMEOUT_S, Agreement
from anyrec.runtime.errors import NonFiniteLossError, PeerLostError, exit_now

logger = logging.getLogger(__name__)

# SIGHUP: a closed terminal or SSH session; treated as SIGTERM (stop at a step boundary, save first).
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
BEAT_S = 1.0  # seconds between a rank's heartbeats (and its checks of its neighbour's and the launcher)
DONE = b"done"  # the beat of a rank that left on purpose
PEER_LOST_EXIT = 4  # the entry point's exit status for a lost peer (train.EXIT_CODES)
ROLL_CALL_S = 3.0  # how long a failed rank waits for its peers to report before naming the silent ones
CLOSE_WAIT_S = 5.0  # after an error, how long close() waits for the other ranks before leaving alone


def _store(world_size: int) -> Any | None:
    """The default process group's store, prefixed for anyrec's keys; None without a group."""
    if world_size == 1 or not dist.is_initialized():
        return None
    return dist.PrefixStore("anyrec/", dist.distributed_c10d._get_default_store())


def _alive(conn: socket.socket) -> bool:
    """Whether a connection that reads as ready is still open (end-of-file or an error: closed)."""
    try:
        return conn.recv(1, socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _launcher_gone(parent: int) -> bool:
    """Under torchrun, a worker whose agent died (e.g. SIGKILL) is orphaned: its parent changed."""
    return "TORCHELASTIC_RUN_ID" in os.environ and os.getppid() != parent


class StopRequest:
    """SIGINT/SIGTERM/SIGHUP turned into a stop at a step boundary that every rank agrees on."""

    def __init__(self, rank: int, world_size: int, check_every: int, grace_s: float,
                 timeout_s: float, boundary: str | None = None, lost: str = "without a checkpoint") -> None:
        self.rank, self.world_size, self.check_every = rank, world_size, check_every
        # what the rank stops at and what an exit at the grace's end loses, as the log lines say them
        # (a calibration stops at its current measurement, and loses it)
        self.boundary = boundary or f"the next step boundary (within {check_every} steps)"
        self.lost = lost
        self.grace_s, self.timeout_s = grace_s, timeout_s
        self.signum: int | None = None  # the first signal seen on this rank
        self.stopped_by: str | None = None  # the signal the ranks agreed to stop for
        self._count = 0
        self._agreed = threading.Event()
        self._lock = threading.Lock()
        self._store = _store(world_size)
        # the stop checks of this request: numbered decisions of the ranks, waited for at most a minute
        self._agreement = Agreement.begin(rank, world_size, "stop checks", min(timeout_s, AGREE_TIMEOUT_S))
        self._installed: dict[int, Any] = {}
        self._old_wakeup = -1
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._parent = os.getppid()

    # ---- signals --------------------------------------------------------------------------------

    def install(self) -> None:
        """Catch SIGINT/SIGTERM/SIGHUP (main thread only; a no-op elsewhere, e.g. in a test runner thread)."""
        if threading.current_thread() is not threading.main_thread() or self._installed:
            return
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._pair = (reader, writer)
        self._old_wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for sig in SIGNALS:
            # The watcher thread acts on the signal; this handler only keeps Python's default
            # (KeyboardInterrupt, or death) from interrupting the step.
            self._installed[sig] = signal.signal(sig, lambda signum, frame: None)
        threading.Thread(target=self._watch, args=(reader,), name="anyrec-signals", daemon=True).start()

    def restore(self) -> None:
        """Put the previous handlers back and stop the watcher."""
        if not self._installed:
            return
        for sig, old in self._installed.items():
            signal.signal(sig, old)
        self._installed = {}
        signal.set_wakeup_fd(self._old_wakeup)
        assert self._pair is not None
        self._pair[1].close()
        self._pair[0].shutdown(socket.SHUT_RDWR)
        self._pair = None

    def _watch(self, reader: socket.socket) -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in SIGNALS:
                    self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        with self._lock:
            self._count += 1
            first = self._count == 1
            if first:
                self.signum = signum
        name = signal.Signals(signum).name
        if not first:
            logger.error("rank %d: second signal (%s): exiting now, without a checkpoint", self.rank, name)
            os._exit(128 + signum)
        logger.warning("rank %d: %s: stopping at %s", self.rank, name, self.boundary)
        timer = threading.Timer(self.grace_s, self._expire, args=(signum,))
        timer.daemon = True
        timer.start()

    def _expire(self, signum: int) -> None:
        if not self._agreed.is_set():
            logger.error("rank %d: not stopped within %.0f s of %s: exiting now, %s", self.rank, self.grace_s,
                         signal.Signals(signum).name, self.lost)
            os._exit(128 + signum)

    # ---- agreement ------------------------------------------------------------------------------

    def should_stop(self, step: int) -> bool:
        """At step boundaries: True on every rank at the same step once any rank got a signal (checked
        with the other ranks every `check_every` steps: three store round trips)."""
        if step % self.check_every:
            return False
        if self.signum is None and _launcher_gone(self._parent):
            logger.error("rank %d: the launcher (pid %d) is gone: stopping", self.rank, self._parent)
            self.signum = signal.SIGTERM
        local = self.signum or 0
        signums = [local] if self._store is None else self._exchange(step, local)
        stop = next((s for s in signums if s), 0)
        if stop:
            self.stopped_by = signal.Signals(stop).name
            self._agreed.set()
            logger.warning("rank %d: stopping after step %d (%s)", self.rank, step, self.stopped_by)
        return bool(stop)

    def _exchange(self, step: int, local: int) -> list[int]:
        """The largest signal number any rank saw, agreed as one decision of the ranks (a rank that does
        not come within the agreement's minute is named: PeerLostError)."""
        return [self._agreement.decide(f"stop after step {step}", lambda: local, "max")]


class Heartbeat:
    """A daemon thread that beats for this rank every BEAT_S seconds and watches the next rank's beat.

    Its own connection to the store at MASTER_ADDR:MASTER_PORT means a main thread blocked in a store
    wait or a collective cannot delay it. A beat is `pid:count`; the neighbour is stuck (stopped, or
    holding the GIL) when its beat has not changed for `timeout_s` (trainer.peer_timeout_s) since this
    rank started watching (a key left by an earlier attempt changes as soon as the new one beats): the
    watcher names it and exits (4), without shortening the timeout of healthy long collectives (their
    threads keep beating). It also leaves, without a stack dump, when the launcher is gone (the worker
    is orphaned, the store stops answering).
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.peer = (rank + 1) % world_size
        self._stop = threading.Event()
        self._parent = os.getppid()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        """Connect and start beating; a no-op for one rank or without a store address."""
        if self.world_size == 1 or "MASTER_ADDR" not in os.environ:
            return self
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.PrefixStore("anyrec/heartbeat/", dist.TCPStore(
            addr, port, is_master=False, timeout=timedelta(seconds=max(BEAT_S, 2.0))))
        # A bare connection to the store that never sends: it reads end-of-file the instant the store's
        # process dies, before a store call fails (for which c10d logs a C++ stack dump).
        probe = socket.create_connection((addr, port), timeout=10)
        self._thread = threading.Thread(target=self._run, args=(store, probe), name="anyrec-heartbeat",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and tell the watcher this rank left on purpose (it is not stuck)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * BEAT_S)

    def _run(self, store: dist.Store, probe: socket.socket) -> None:
        pid, count = os.getpid(), 0
        seen, since = None, time.monotonic()
        gone = f"rank {self.rank}: the launcher (pid {self._parent}) is gone: exiting"
        while not self._stop.is_set():
            self._check_launcher(probe, BEAT_S if count else 0, gone)
            count += 1
            try:
                self._call(probe, gone, store.set, str(self.rank), f"{pid}:{count}")
                has = self._call(probe, gone, store.check, [str(self.peer)])
                beat = self._call(probe, gone, store.get, str(self.peer)) if has else None
            except Exception:  # noqa: BLE001 - the store is unreachable
                self._leave(f"rank {self.rank}: the job's store (MASTER_ADDR:MASTER_PORT) stopped "
                            "answering: the launcher is gone; exiting")
                return
            if beat == DONE:
                since = time.monotonic()  # the peer left on purpose: nothing to wait for
            elif beat != seen:
                seen, since = beat, time.monotonic()
            elif time.monotonic() - since > self.timeout_s:
                self._leave(f"rank {self.rank}: rank(s) {self.peer} stopped responding (no heartbeat for "
                            f"{self.timeout_s:.0f} s; trainer.peer_timeout_s={self.timeout_s:.0f})")
        try:
            store.set(str(self.rank), DONE)
        except Exception:  # noqa: BLE001 - the store may be gone already
            pass
        probe.close()

    def _call(self, probe: socket.socket, gone: str, op: Callable[..., Any], *args: Any) -> Any:
        """`op(*args)` on the store, made only while the probe says the store's process is up (the launcher
        is gone otherwise): a call to a store whose process died fails with c10d's C++ stack dump on stderr
        before Python sees the error. Asked before each call, not once a beat: under a busy training thread
        this one waits for the GIL between its calls, long enough for the launcher to die in between."""
        self._check_launcher(probe, 0, gone)
        return op(*args)

    def _check_launcher(self, probe: socket.socket, wait_s: float, gone: str) -> None:
        """Leave with `gone` if, within `wait_s` (0: asked without waiting), the store's process closed the
        probe's connection, or the launcher is no longer this process's parent."""
        if (select.select([probe], [], [], wait_s)[0] and not _alive(probe)) or _launcher_gone(self._parent):
            self._leave(gone)

    def _leave(self, line: str) -> None:
        if not self._stop.is_set():
            exit_now(line, PEER_LOST_EXIT)


# gloo's words for a peer that is gone or silent (it raises plain RuntimeErrors), and the libraries'.
_PEER_MARKERS = ("Timed out waiting", "Application timeout caused pair closure", "Connection closed by peer",
                 "Connection reset by peer", "watchdog", "NCCL", "RCCL", "gloo")


def peer_failure(e: BaseException, rank: int, world_size: int, timeout_s: float) -> str | None:
    """One line for a collective that failed because of another rank, naming the silent rank(s), or
    None. The ranks that hit the failure check in through the store for a few seconds; the ones that
    do not are the likely culprits."""
    if isinstance(e, PeerLostError):
        return str(e)
    if isinstance(e, ValueError | NonFiniteLossError):  # raised by every rank alike, not a peer's fault
        return None
    text = str(e)
    if world_size <= 1 or not (isinstance(e, getattr(dist, "DistError", ())) or
                               any(m in text for m in _PEER_MARKERS)):
        return None
    cause = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    cause = cause.split("] ", 1)[-1][:200]  # drop the C++ source location
    silent = _roll_call(rank, world_size, "failed", ROLL_CALL_S)
    who = f"rank(s) {', '.join(map(str, silent))} stopped responding" if silent else "a peer rank failed"
    return (f"rank {rank}: {who} (collective failed: {cause}; trainer.collective_timeout_s="
            f"{timeout_s:.0f})")


def _roll_call(rank: int, world_size: int, name: str, timeout_s: float,
               binding: bool = False) -> list[int] | None:
    """Post this rank's `name` key and wait up to `timeout_s` for every rank's: the ranks that did not
    post ([] without a group), or None when the store itself is gone (with the launcher).

    `binding`: the ranks that answer go on to meet (a barrier), so a rank that gives up says so, and
    a rank that sees that gets None even when every key is there: the one that gave up has left and
    would never reach the barrier (a rank stopped for longer than `timeout_s`, then resumed)."""
    try:
        store = _store(world_size)
        if store is None:
            return []
        keys = [f"{name}/{r}" for r in range(world_size)]
        gave_up = f"{name}/gave-up"
        store.set(keys[rank], "1")
        deadline = time.monotonic() + timeout_s
        while True:
            if binding and store.check([gave_up]):
                return None
            silent = [r for r, k in enumerate(keys) if not store.check([k])]
            if not silent:
                return []
            if time.monotonic() > deadline:
                if binding:
                    store.set(gave_up, "1")
                return silent
            time.sleep(0.1)
    except Exception:  # noqa: BLE001
        return None


def peers_met(rank: int, world_size: int) -> bool:
    """Whether every rank reaches this point within CLOSE_WAIT_S and none gave up waiting before
    (a barrier that gives up, for every rank alike)."""
    return _roll_call(rank, world_size, "meet/close", CLOSE_WAIT_S, binding=True) == []
