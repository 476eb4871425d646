"""Fault-injection soak: SIGKILL a rank or torchrun at uniformly random instants; every recovery must
end with the uninterrupted run's weights, bit for bit, and never use an incomplete checkpoint.

    PYTHONPATH=. python benchmarks/soak.py --kills 30 [--seed 0] [--json out.json]

First an uninterrupted 2-rank job (periodic checkpoints and evaluations) gives the reference weights
hash and wall time T (from its workers' start to its end). Then each try launches the same job under
`torchrun --max-restarts`, waits for its workers, then a uniformly random instant in [0, T), and
SIGKILLs rank 0, rank 1 or torchrun itself (one of the three, at random). A killed rank is restarted
by torchrun; a killed torchrun is launched again (its workers must leave on their own within seconds).
Each try checks:
  - the final `weights_sha256` equals the reference's;
  - at the kill, every final-named `step_<n>` directory was complete (meta.json and every file it
    lists, with its size and SHA-256), and the checkpoint the recovery resumed from is one of them;
  - no process is left behind.
and records the phase the kill hit, from the rank 0 log's timestamps and the directory at the kill:
startup (no step yet), step, save (a `step_<n>.tmp-*` directory present), eval, after a resume
(before its first logged step), teardown. Timings on a shared host are noisy; the result is not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
try:  # python -m benchmarks.soak, or imported by a test
    from benchmarks.interrupt import alive, descendants
except ImportError:  # python benchmarks/soak.py: this folder is first on sys.path
    from interrupt import alive, descendants

TRAIN = ["-m", "anyrec.train", "model=dlrm_tiny", "data.batch_size=32", "trainer.progress=false",
         "trainer.tensorboard=false", "trainer.log_every=1", "trainer.fingerprint_weights=true",
         "trainer.eval_steps=2", "trainer.stop_check_every=5", "trainer.peer_timeout_s=20",
         "trainer.collective_timeout_s=60"]
TARGETS = ("rank0", "rank1", "torchrun")
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[[^\]]+\]\[\w+\] - (.*)$")


def job_args(steps: int, every: int, eval_every: int, ck: Path, run: Path) -> list[str]:
    return [*TRAIN, f"trainer.steps={steps}", f"trainer.checkpoint.every={every}",
            f"trainer.eval_every={eval_every}", f"trainer.checkpoint.dir={ck}", f"hydra.run.dir={run}"]


def start(args: list[str], workdir: Path, tag: str, restarts: int) -> subprocess.Popen:
    """torchrun in its own session (2 ranks, loopback), output in workdir/<tag>.out/.err."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={restarts}", *args]
    out, err = (workdir / f"{tag}.out").open("w"), (workdir / f"{tag}.err").open("w")
    return subprocess.Popen(cmd, cwd=workdir, env=env, start_new_session=True, stdout=out, stderr=err)


def finish(proc: subprocess.Popen, limit_s: float) -> None:
    """Wait for the job; past `limit_s` kill its whole session and raise."""
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"the job did not finish within {limit_s:.0f} s") from None


def summary(workdir: Path, tag: str) -> dict | None:
    lines = [ln for ln in (workdir / f"{tag}.out").read_text().splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def workers(proc: subprocess.Popen) -> dict[str, int]:
    """{'rank0': pid, 'rank1': pid} of the job's live workers."""
    found = {}
    for pid in descendants(proc.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"anyrec.train" in cmd and b"torch.distributed.run" not in cmd:
            for r in (0, 1):
                if f"RANK={r}".encode() in env:
                    found[f"rank{r}"] = pid
    return found


def wait_workers(proc: subprocess.Popen, limit_s: float) -> float:
    """Wait until both workers exist; returns that monotonic time (instants are drawn from there)."""
    deadline = time.monotonic() + limit_s
    while len(workers(proc)) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the job's workers did not start")
        time.sleep(0.01)
    return time.monotonic()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def incomplete(ck: Path) -> list[str]:
    """Final-named checkpoints that are not whole: meta.json and every file it lists, size and SHA-256."""
    bad = []
    for d in sorted(ck.glob("step_*")):
        if not d.name[5:].isdigit():
            continue
        try:
            meta = json.loads((d / "meta.json").read_text())
            ok = ".metadata" in meta["files"] and all(
                (d / n).stat().st_size == size and _sha256(d / n) == meta["sha256"][n]
                for n, size in meta["files"].items())
        except (OSError, ValueError, KeyError):
            ok = False
        if not ok:
            bad.append(d.name)
    return bad


def events(workdir: Path) -> list[tuple[float, str]]:
    """(unix time, message) of every timestamped log line of the job's rank 0, in order."""
    found = []
    for name in sorted(workdir.glob("*.err")) + sorted(workdir.glob("*.out")):
        for line in name.read_text(errors="replace").splitlines():
            m = _STAMP.match(line)
            if m:
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found.append((t, m.group(2)))
    return sorted(found, key=lambda e: e[0])


def phase(log: list[tuple[float, str]], at: float, saving: bool, steps: int, every: int,
          eval_every: int) -> str:
    """What the job was doing at unix time `at` (see the module doc)."""
    if saving:
        return "save"
    before = [m for t, m in log if t <= at]
    if not any(m.startswith("step ") for m in before) and not any(m.startswith("resumed") for m in before):
        return "startup"
    last = before[-1] if before else ""
    if last.startswith("resumed from"):
        return "after resume"
    m = re.match(r"step (\d+) loss", last)
    if m:
        step = int(m.group(1))
        if step == steps:
            return "save"  # the final checkpoint comes first
        if step % every == 0:  # logged just before the save starts (the tmp directory comes a moment later)
            return "save"
        return "eval" if step % eval_every == 0 else "step"
    if last.startswith("checkpoint:"):
        n = int(last.rsplit("step_", 1)[1])
        if n == steps:
            return "final eval and teardown"
        return "eval" if n % eval_every == 0 else "step"
    m = re.match(r"step (\d+) eval", last)
    if m:
        return "final eval and teardown" if int(m.group(1)) == steps else "step"
    if "summary" in last or "prediction" in last or "step breakdown" in last:
        return "teardown"
    return "startup" if not any(mm.startswith("step ") for mm in before) else "step"


def run_try(i: int, rng: random.Random, ref: dict, steps: int, every: int, eval_every: int,
            limit_s: float) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"anyrec-soak-{i}-"))
    ck, args = workdir / "ck", job_args(steps, every, eval_every, workdir / "ck", workdir / "run")
    target, delay = rng.choice(TARGETS), rng.uniform(0, ref["wall_s"])
    row = {"try": i, "target": target, "instant_s": round(delay, 3)}
    proc = start(args, workdir, "a", restarts=3)
    try:
        t0 = wait_workers(proc, limit_s)
        while time.monotonic() - t0 < delay and proc.poll() is None:
            time.sleep(0.005)
        pids = workers(proc)
        victim = proc.pid if target == "torchrun" else pids.get(target)
        if proc.poll() is not None or victim is None:
            row["phase"] = "not running (finished or between attempts)"
            row["killed"] = False
        else:
            os.kill(victim, signal.SIGKILL)
            at = time.time()
            row["killed"] = True
            tmps = [p.name for p in ck.glob("step_*.tmp-*")] if ck.is_dir() else []
            row["incomplete_at_kill"] = incomplete(ck) if ck.is_dir() else []
            row["kill_time"] = at
            row["tmp_at_kill"] = tmps
        if target == "torchrun" and row["killed"]:
            proc.wait(timeout=30)
            gone = time.monotonic()
            left = set(pids.values())
            while alive(left) and time.monotonic() - gone < 30:
                time.sleep(0.02)
            row["workers_exit_s"] = round(time.monotonic() - gone, 2)
            for pid in alive(left):
                os.kill(pid, signal.SIGKILL)
            proc = start(args, workdir, "b", restarts=3)  # launched again: resumes
        finish(proc, limit_s)
        s = summary(workdir, "b" if (target == "torchrun" and row["killed"]) else "a")
        if row.get("killed"):
            saving = bool(row["tmp_at_kill"])
            row["phase"] = phase(events(workdir), row["kill_time"], saving, steps, every, eval_every)
        row["resumed_from_step"] = s and s.get("resumed_from_step")
        row["identical"] = bool(s) and s.get("weights_sha256") == ref["weights_sha256"]
        row["incomplete_after"] = incomplete(ck)
        used = s and s.get("resumed_from_step")
        row["incomplete_used"] = int(bool(used) and f"step_{used}" in row.get("incomplete_at_kill", []))
        row["left_behind"] = len(alive(descendants(proc.pid)))
        if not row["identical"]:
            row["log_tail"] = ((workdir / "a.err").read_text()[-2000:])
    finally:
        for pid in alive(descendants(proc.pid) | {proc.pid}):
            os.kill(pid, signal.SIGKILL)
    if row["identical"] and not row["incomplete_after"]:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        row["workdir"] = str(workdir)
    return row


def reference(steps: int, every: int, eval_every: int, limit_s: float) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="anyrec-soak-ref-"))
    args = job_args(steps, every, eval_every, workdir / "ck", workdir / "run")
    proc = start(args, workdir, "a", restarts=0)
    spawned = wait_workers(proc, limit_s)
    finish(proc, limit_s)
    s = summary(workdir, "a")
    if proc.returncode != 0 or not s:
        raise RuntimeError(f"the reference run failed: {(workdir / 'a.err').read_text()[-3000:]}")
    shutil.rmtree(workdir, ignore_errors=True)
    return {"weights_sha256": s["weights_sha256"], "wall_s": time.monotonic() - spawned}


def soak(kills: int, seed: int, steps: int, every: int, eval_every: int, limit_s: float,
         log=print, json_path: str | None = None) -> dict:
    """Run the soak; returns the reference, every try and the tallies (also written to `json_path`
    after every try, so a soak cut short still leaves its results)."""
    ref = reference(steps, every, eval_every, limit_s)
    log(f"reference: {steps} steps in {ref['wall_s']:.1f} s, weights {ref['weights_sha256'][:16]}")
    rng, rows, i = random.Random(seed), [], 0
    while sum(r.get("killed", False) for r in rows) < kills:
        r = run_try(i, rng, ref, steps, every, eval_every, limit_s)
        rows.append(r)
        i += 1
        log(f"try {r['try']:>3} kill {r['target']:>8} at {r['instant_s']:6.2f} s: {r.get('phase', '?'):>12} "
            f"resumed from {r['resumed_from_step']} identical={r['identical']} "
            f"incomplete used={r.get('incomplete_used', 0)}"
            + (f" workers gone in {r['workers_exit_s']} s" if "workers_exit_s" in r else ""))
        result = tally(ref, seed, steps, every, eval_every, rows)
        if json_path:
            Path(json_path).write_text(json.dumps(result, indent=1))
    return result


def tally(ref: dict, seed: int, steps: int, every: int, eval_every: int, rows: list[dict]) -> dict:
    killed = [r for r in rows if r.get("killed")]
    return {
        "reference": ref, "seed": seed, "steps": steps, "checkpoint_every": every, "eval_every": eval_every,
        "kills": len(killed), "identical": sum(r["identical"] for r in killed),
        "incomplete_used": sum(r["incomplete_used"] for r in killed),
        "incomplete_left": sum(bool(r["incomplete_after"]) for r in rows),
        "phases": dict(Counter(r["phase"] for r in killed)),
        "targets": dict(Counter(r["target"] for r in killed)),
        "launcher_workers_exit_s": [r["workers_exit_s"] for r in killed if "workers_exit_s" in r],
        "left_behind": sum(r["left_behind"] for r in rows), "tries": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=3, help="steps between checkpoints")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--limit", type=float, default=600.0, help="seconds before a job counts as hung")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = soak(args.kills, args.seed, args.steps, args.every, args.eval_every, args.limit,
                  json_path=args.json)
    print(f"{result['identical']}/{result['kills']} recoveries bit-identical; incomplete checkpoints used: "
          f"{result['incomplete_used']}; phases: {result['phases']}; targets: {result['targets']}; "
          f"workers of a killed torchrun gone in {result['launcher_workers_exit_s']} s; "
          f"processes left: {result['left_behind']}")
    sys.exit(0 if result["identical"] == result["kills"] and not result["incomplete_used"] else 1)


if __name__ == "__main__":
    main()
