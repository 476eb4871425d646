"""Clean shutdown under torchrun: a signal stops every rank at one step boundary (with a checkpoint),
a stopped rank fails the job naming it, an orphaned worker stops, and errors reach torchrun's report.

Every job is 2 ranks on loopback, bounded in time, and the test checks that no process is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.distributed as dist

from anyrec.runtime import shutdown
from benchmarks.interrupt import alive, descendants, launch, output, wait_for, wait_gone

from .conftest import ROOT, torchrun

FAST = ["trainer.stop_check_every=5"]


@pytest.mark.integration
def test_a_signal_on_one_rank_stops_all_at_one_step(tmp_path):
    # tests/dist/stop_check.py: one all-reduce per step, a signal on one rank after step 7, checks every
    # 3 steps: every rank stops after step 9, and says why; each signal anyrec catches, on either rank,
    # one stop request after the other in one job.
    rounds = ["SIGINT:0", "SIGINT:1", "SIGTERM:1", "SIGHUP:0"]
    proc = torchrun([str(ROOT / "tests" / "dist" / "stop_check.py"), str(tmp_path), *rounds],
                    cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = [{"step": 9, "stopped_by": r.split(":")[0]} for r in rounds]
    assert results == [expected] * 2


def _worker(pids: set[int], rank: int) -> int:
    """The pid of the anyrec worker with RANK=rank among `pids`."""
    for pid in pids:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"anyrec.train" in cmd:
            return pid
    raise AssertionError(f"no worker with RANK={rank} among {sorted(pids)}")


def _stopped_steps(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"stopping after step (\d+)", text)]


def _summary(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    assert lines, text[-3000:]
    return json.loads(lines[-1])


@pytest.mark.integration
def test_ctrl_c_stops_every_rank_at_one_step_and_saves(tmp_path):
    # A terminal's Ctrl-C (SIGINT) or its closing (SIGHUP) reach the launcher's whole process group; the
    # workers handle every such signal alike (test_a_signal_on_one_rank_stops_all_at_one_step).
    ck = tmp_path / "ck"
    proc = launch(tmp_path, [*FAST, f"trainer.checkpoint.dir={ck}", "trainer.checkpoint.every=3"])
    pids = wait_for(proc, tmp_path, "step 10 loss", timeout=240)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    seconds = wait_gone(proc, pids, limit=60)
    text = output(tmp_path)
    assert seconds is not None and "forcefully exiting via" not in text, text[-3000:]
    assert seconds < 25, seconds  # torchrun would SIGKILL at 30 s: the workers left on their own
    steps = _stopped_steps(text)
    assert len(steps) == 2 and steps[0] == steps[1] and steps[0] % 5 == 0, text[-3000:]
    summary = _summary((tmp_path / "out.txt").read_text())
    assert summary["stopped_by"] == "SIGINT" and summary["steps"] == steps[0]
    assert (ck / f"step_{steps[0]}" / "meta.json").is_file()
    assert not list(ck.glob("*.tmp-*")), sorted(p.name for p in ck.iterdir())  # nothing half-written
    assert proc.returncode == 1 and "SignalException" in text  # torchrun's own status on a signal


@pytest.mark.integration
def test_sigterm_to_one_rank_stops_both(tmp_path):
    ck = tmp_path / "ck"
    proc = launch(tmp_path, [*FAST, f"trainer.checkpoint.dir={ck}"])
    pids = wait_for(proc, tmp_path, "step 10 loss", timeout=240)
    os.kill(_worker(pids, 1), signal.SIGTERM)  # e.g. a scheduler's preemption of one host
    seconds = wait_gone(proc, pids, limit=60)
    text = output(tmp_path)
    assert seconds is not None and "forcefully exiting via" not in text, text[-3000:]
    steps = _stopped_steps(text)
    assert len(steps) == 2 and steps[0] == steps[1], text[-3000:]
    assert (ck / f"step_{steps[0]}" / "meta.json").is_file()
    assert proc.returncode == 1 and re.search(r"exitcode\s*: 143", text), text[-3000:]


@pytest.mark.deadline
@pytest.mark.integration
def test_a_stopped_rank_fails_the_job_naming_it(tmp_path):
    # eager: with no compile record rank 0 times compiled and eager steps while its peer waits, which on a
    # loaded host can near the 5 s timeout; the compile decision is not what this test checks
    proc = launch(tmp_path, ["trainer.collective_timeout_s=5", "trainer.stop_check_every=1000",
                             "trainer.compile=false"])
    pids = wait_for(proc, tmp_path, "step 10 loss", timeout=240)
    stuck = _worker(pids, 1)
    os.kill(stuck, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while "anyrec-train: error:" not in output(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        text = output(tmp_path)
        assert "anyrec-train: error: rank 0: rank(s) 1 stopped responding" in text, text[-3000:]
        # The stopped rank never resumes on its own: rank 0 leaves first (on a busy host its exit can
        # take seconds after its line, and a rank resumed meanwhile would fail first and get it killed).
        left = _worker(pids, 0)
        while alive({left}) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if alive({stuck}):
            os.kill(stuck, signal.SIGCONT)
    assert wait_gone(proc, pids, limit=60) is not None
    text = output(tmp_path)
    assert "traceback : anyrec-train: error: rank 0: rank(s) 1 stopped responding" in text
    assert "trainer.collective_timeout_s=5)" in text and re.search(r"exitcode\s*: 4", text), text[-3000:]


@pytest.mark.deadline
@pytest.mark.integration
def test_workers_of_a_killed_launcher_leave_at_once_in_one_line(tmp_path):
    ck = tmp_path / "ck"
    proc = launch(tmp_path, [*FAST, f"trainer.checkpoint.dir={ck}"])
    pids = wait_for(proc, tmp_path, "step 10 loss", timeout=240)
    os.kill(proc.pid, signal.SIGKILL)
    start = time.monotonic()
    proc.wait(timeout=10)
    while alive(pids) and time.monotonic() - start < 60:
        time.sleep(0.05)
    seconds = time.monotonic() - start
    left = alive(pids)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    text = output(tmp_path)
    after = text[text.index("step 10 loss"):]
    assert not left and seconds < 5, (seconds, after[-3000:])
    # Each worker says it in one line; no C++ stack frames, no traceback.
    lines = [ln for ln in after.splitlines() if ln.startswith("anyrec-train: error:")]
    assert len(lines) == 2, after[-3000:]
    # the launcher watch (its pid) or the heartbeat (its store) may notice first: either names the launcher
    assert all("the launcher" in ln and "gone" in ln for ln in lines), after[-3000:]
    assert "frame #" not in after and "Traceback" not in after, after[-3000:]
    assert not list(ck.glob("step_*")) or all((p / "meta.json").is_file() for p in ck.glob("step_[0-9]*")
                                               if ".tmp-" not in p.name)


@pytest.mark.deadline
@pytest.mark.integration
def test_workers_of_a_launcher_killed_while_they_start_leave_at_once(tmp_path):
    proc = launch(tmp_path, FAST)
    deadline = time.monotonic() + 120
    while len(pids := {p for p in descendants(proc.pid) if b"anyrec.train" in _cmdline(p)}) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, output(tmp_path)[-3000:]
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)  # the workers are still importing torch
    start = time.monotonic()
    proc.wait(timeout=10)
    while alive(pids) and time.monotonic() - start < 60:
        time.sleep(0.05)
    seconds = time.monotonic() - start
    for pid in alive(pids):
        os.kill(pid, signal.SIGKILL)
    text = output(tmp_path)
    lines = [ln for ln in text.splitlines() if ln.startswith("anyrec-train: error:")]
    assert seconds < 5 and len(lines) == 2 and all("is gone: exiting" in ln for ln in lines), (seconds, text)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


@pytest.mark.deadline
@pytest.mark.integration
def test_a_stopped_rank_is_named_by_the_heartbeat_before_the_collective_timeout(tmp_path):
    # The collective timeout stays long (healthy long collectives keep it); the heartbeat names the
    # stopped rank after trainer.peer_timeout_s.
    proc = launch(tmp_path, ["trainer.peer_timeout_s=5", "trainer.stop_check_every=1000"])
    try:
        pids = wait_for(proc, tmp_path, "step 10 loss", timeout=240)
        stuck = _worker(pids, 1)
        os.kill(stuck, signal.SIGSTOP)
        start = time.monotonic()
        while "anyrec-train: error:" not in output(tmp_path) and time.monotonic() - start < 60:
            time.sleep(0.1)
        seconds = time.monotonic() - start
        text = output(tmp_path)
        assert ("anyrec-train: error: rank 0: rank(s) 1 stopped responding (no heartbeat for 5 s; "
                "trainer.peer_timeout_s=5)") in text, text[-3000:]
        assert seconds < 30, seconds  # 5 s and a beat, on a loaded host; the collective waits 600 s
        os.kill(stuck, signal.SIGCONT)
        assert wait_gone(proc, pids, limit=60) is not None
    finally:  # the job is gone whatever failed (a stopped rank never leaves on its own)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in alive(descendants(proc.pid)):
            os.kill(pid, signal.SIGKILL)
    text = output(tmp_path)
    assert re.search(r"exitcode\s*: 4", text) and "frame #" not in text, text[-3000:]


@pytest.mark.integration
@pytest.mark.parametrize("what", ["file", "bogus"])
def test_errors_reach_torchruns_report_in_one_line(tmp_path, what):
    f = tmp_path / "a_file"
    f.write_text("x")
    bad = f"trainer.checkpoint.dir={f}" if what == "file" else "+trainer.checkpoint.dirr=D"
    before = alive(descendants(os.getpid()))  # e.g. multiprocessing's resource tracker, from other tests
    proc = torchrun(["-m", "anyrec.train", "model=dlrm_tiny", bad, f"hydra.run.dir={tmp_path}/run"],
                    cwd=tmp_path, timeout=180)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("anyrec-train: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    reported = [ln.split("traceback : ", 1)[1] for ln in proc.stderr.splitlines() if "traceback : " in ln]
    # A rank still checking when the first one exits is stopped by torchrun: its entry names the signal.
    failures = [r for r in reported if not r.startswith("Signal 15 (SIGTERM) received")]
    assert failures and all(r == lines[0] for r in failures), proc.stderr[-3000:]
    assert alive(descendants(os.getpid())) <= before  # torchrun and its workers are all gone


def test_ranks_saying_their_error_line_at_once_never_splice_them(tmp_path):
    """The ranks of a job share their launcher's stderr: two processes saying lines at the same time
    (as every worker of a killed launcher does) leave each line whole, newline included, also where
    stderr is unbuffered (PYTHONUNBUFFERED, as the launches here and in many job scripts set)."""
    say = ("import sys; from anyrec.runtime.errors import say_line\n"
           "for i in range(2000):\n"
           "    say_line(f'anyrec-train: error: rank {sys.argv[1]}: ' + 'x' * 150 + f' {i}')")
    with open(tmp_path / "stderr.txt", "w") as shared:  # one open file, as torchrun's workers inherit it
        procs = [subprocess.Popen([sys.executable, "-c", say, str(r)], stderr=shared, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
                 for r in range(2)]
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    lines = (tmp_path / "stderr.txt").read_text().splitlines()
    whole = re.compile(r"anyrec-train: error: rank [01]: x{150} \d+")
    assert len(lines) == 4000 and all(whole.fullmatch(ln) for ln in lines), \
        [ln for ln in lines if not whole.fullmatch(ln)][:3]


def _close_roll_call(monkeypatch, wait_s: float):
    """peers_met on an in-process store shared by the 'ranks' (threads or calls here)."""
    store = dist.HashStore()
    monkeypatch.setattr(shutdown, "_store", lambda world_size: dist.PrefixStore("anyrec/", store))
    monkeypatch.setattr(shutdown, "CLOSE_WAIT_S", wait_s)


def test_ranks_closing_after_an_error_meet_when_all_arrive(monkeypatch):
    _close_roll_call(monkeypatch, 10.0)
    with ThreadPoolExecutor(2) as pool:
        met = list(pool.map(lambda rank: shutdown.peers_met(rank, 2), [0, 1]))
    assert met == [True, True]


def test_a_rank_arriving_after_its_peer_gave_up_waiting_does_not_meet_it(monkeypatch):
    # Rank 1 was stopped: rank 0 waits CLOSE_WAIT_S, gives up and leaves without a barrier. Rank 1,
    # resumed later, finds rank 0's key posted: it must not wait for rank 0 at a barrier either.
    _close_roll_call(monkeypatch, 1.0)
    assert not shutdown.peers_met(0, 2)
    start = time.monotonic()
    assert not shutdown.peers_met(1, 2)
    assert time.monotonic() - start < 0.5  # it knew at once, without waiting out its own timeout


class _Left(BaseException):
    """The heartbeat's exit, here raised with its line (a BaseException: no store error handler takes it)."""


def test_the_heartbeat_asks_the_probe_before_each_store_call(monkeypatch):
    """The store's process dies between two calls of one beat (the heartbeat thread, waiting for the GIL
    behind a training thread, is slow between them): the next call is not made (a call to a dead store
    dumps C++ frames on stderr); the rank leaves naming the launcher, from the probe."""
    import socket

    def leave(line, code):
        raise _Left(line)

    monkeypatch.setattr(shutdown, "exit_now", leave)
    probe, store_end = socket.socketpair()
    probe.settimeout(10)  # as the heartbeat's probe is made: its reads wait unless asked when ready
    calls = []

    class Store:
        def set(self, key, value):
            calls.append("set")
            store_end.close()  # the launcher, and its store, die right after this call

        def check(self, keys):
            calls.append("check")
            raise RuntimeError("Connection reset by peer")

        def get(self, key):
            calls.append("get")
            return b""

    beat = shutdown.Heartbeat(0, 2, timeout_s=60)
    with pytest.raises(_Left) as left:
        beat._run(Store(), probe)
    probe.close()
    assert calls == ["set"]
    assert "the launcher" in str(left.value) and "is gone: exiting" in str(left.value), left.value
