"""Ctrl-C on a torchrun job: how long until every process is gone, over N tries.

    PYTHONPATH=. python benchmarks/interrupt.py --tries 10 [--nproc 2] [--signal INT] [--json out.json]

Each try launches `torchrun --standalone -m anyrec.train model=dlrm_tiny ...` in a session of its own
(as an interactive shell does), waits until training is under way (a logged step), sends the signal
to the launcher's process group (what a terminal's Ctrl-C does), and times until torchrun and every
worker have exited. Prints a table and writes JSON. Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ["-m", "anyrec.train", "model=dlrm_tiny", "data.batch_size=32", "trainer.steps=1000000",
         "trainer.eval_steps=2", "trainer.progress=false", "trainer.log_every=5", "trainer.tensorboard=false"]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """The pids that still exist and are not zombies."""
    left = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.add(pid)
    return left


def launch(workdir: Path, extra: list[str], nproc: int = 2) -> subprocess.Popen:
    """torchrun in its own session, output in workdir/out.txt and workdir/err.txt."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *TRAIN, f"hydra.run.dir={workdir}/run", *extra]
    return subprocess.Popen(cmd, cwd=workdir, env=env, start_new_session=True,
                            stdout=(workdir / "out.txt").open("w"), stderr=(workdir / "err.txt").open("w"))


def output(workdir: Path) -> str:
    return (workdir / "out.txt").read_text() + (workdir / "err.txt").read_text()


def wait_for(proc: subprocess.Popen, workdir: Path, text: str, timeout: float) -> set[int]:
    """Wait until `text` is in the job's output; returns the job's processes seen meanwhile."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen |= descendants(proc.pid)
        if text in output(workdir):
            return seen | descendants(proc.pid)
        if proc.poll() is not None:
            raise RuntimeError(f"the job exited early ({proc.returncode}): {output(workdir)[-3000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"{text!r} not seen within {timeout} s: {output(workdir)[-3000:]}")


def wait_gone(proc: subprocess.Popen, pids: set[int], limit: float) -> float | None:
    """Seconds until torchrun and `pids` have all exited, or None past `limit` (then all are killed)."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if proc.poll() is not None and not alive(pids):
            return time.monotonic() - start
        time.sleep(0.05)
    for pid in alive(pids | {proc.pid}):
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return None


def interrupt_once(workdir: Path, nproc: int = 2, sig: int = signal.SIGINT, extra: list[str] = (),
                   limit: float = 60.0) -> dict:
    """Launch, wait for step 10, signal the launcher's process group; returns timings and output."""
    proc = launch(workdir, list(extra), nproc)
    try:
        pids = wait_for(proc, workdir, "step 10 loss", timeout=240)
        t0 = time.monotonic()
        os.killpg(proc.pid, sig)
        seconds = wait_gone(proc, pids, limit)
    except BaseException:
        for pid in alive(descendants(proc.pid) | {proc.pid}):
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
        raise
    return {"seconds": seconds, "signal_at": t0, "returncode": proc.returncode, "workers": len(pids),
            "output": output(workdir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--signal", default="INT", choices=["INT", "TERM"])
    parser.add_argument("--limit", type=float, default=60.0, help="seconds before a try counts as hung")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("extra", nargs="*", help="more anyrec.train overrides")
    args = parser.parse_args()
    sig = signal.Signals[f"SIG{args.signal}"]
    rows = []
    print(f"{'try':>4} {'seconds':>8} {'torchrun rc':>12} {'workers':>8}  checkpoint")
    for i in range(args.tries):
        with tempfile.TemporaryDirectory(prefix="anyrec-interrupt-") as tmp:
            r = interrupt_once(Path(tmp), args.nproc, sig, [f"trainer.checkpoint.dir={tmp}/ck", *args.extra],
                               args.limit)
            ckpts = sorted(p.name for p in (Path(tmp) / "ck").glob("step_*"))
        rows.append({k: v for k, v in r.items() if k != "output"} | {"checkpoints": ckpts})
        shown = f"{r['seconds']:.2f}" if r["seconds"] is not None else "HUNG"
        print(f"{i:>4} {shown:>8} {r['returncode']:>12} {r['workers']:>8}  {', '.join(ckpts) or '-'}",
              flush=True)
    done = [r["seconds"] for r in rows if r["seconds"] is not None]
    print(f"{len(done)}/{len(rows)} stopped within {args.limit:.0f} s; max {max(done, default=0):.2f} s; "
          f"under 10 s: {sum(s < 10 for s in done)}/{len(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"signal": args.signal, "nproc": args.nproc, "tries": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
