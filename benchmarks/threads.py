"""Threads per CPU rank: `backend.threads=auto` (the default) against every fixed count, quiet and shared.

    python benchmarks/threads.py --json benchmarks/results/<date>_cpu-2core/threads.json  # 1 rank
    python benchmarks/threads.py --nproc 1,2 --background off,busy,job --rounds 3

Each case trains `--model` (dlrm_small, the default job's) at `--batch-size` (256) per rank with `--nproc`
ranks (1) and `backend.threads` set to auto or to each fixed count from 1 to the host's cores, plus
`omp1`: the default job (auto) started with `OMP_NUM_THREADS=1` in its environment, the comparison users
make. A fixed count N also runs with `OMP_NUM_THREADS=N`. `--background` names the halves: `off` (quiet),
`busy` (one core kept busy by a spinning process the benchmark starts before the half and stops after it)
and `job` (a second 2-rank anyrec training job, dlrm_small, default settings, stopped with everything it
started at the end). A case's step time is the trainer's own figure (`measured_step_ms`: the slowest rank
after warm-up, from the run's summary); samples/s = ranks x batch / step. Cases run alternately,
`--rounds` times (the order rotates each round); the table shows medians and auto over the best other
case (the target: within 1.2x), the JSON every run with the load average around it, the count auto kept
(`intra_op_threads`), its timings (`thread_trial_ms`) and the thread lines the runs logged. A run past
`--timeout-s` is stopped and reported as such. Launching the jobs and stopping them are `vs_reference.py`'s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: benchmarks/ importable as a package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.vs_reference import BenchmarkError, _env, _launch, _stop, anyrec_args  # noqa: E402


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _summary(log: str) -> dict:
    """The trainer's summary: the last line of its output that is a JSON object."""
    for line in reversed(log.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise BenchmarkError("no summary line in the run's output")


OMP_CASE = "omp1"  # auto, started with OMP_NUM_THREADS=1
ROOT = Path(__file__).resolve().parent.parent  # this checkout: the anyrec every run imports


def case_env(threads: str) -> dict:
    """The environment of a case: a fixed count N with OMP_NUM_THREADS=N, `omp1` with 1, auto as is."""
    env = _env(ROOT)
    env.pop("OMP_NUM_THREADS", None)
    if threads != "auto":
        env["OMP_NUM_THREADS"] = "1" if threads == OMP_CASE else threads
    return env


def run_case(nproc: int, threads: str, args: argparse.Namespace, work: Path) -> dict:
    """One training run with `backend.threads=threads` (`omp1`: auto under OMP_NUM_THREADS=1), timed by
    the trainer."""
    out = work / f"{nproc}r_{threads}_{time.monotonic_ns()}"
    out.mkdir(parents=True)
    setting = "auto" if threads == OMP_CASE else threads
    runner = ["--out", str(out), "--", "anyrec",
              *anyrec_args(args.model, args.batch_size, args.steps, out / "run", None),
              f"backend.threads={setting}", "trainer.calibrate=never"]
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        proc = _launch(nproc, runner, case_env(threads), log)
        try:
            code = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            code = None
    text = (out / "log.txt").read_text(errors="replace")
    rec = {"nproc": nproc, "threads": threads, "loadavg_before": load_before,
           "loadavg_after": os.getloadavg(), "wall_s": time.perf_counter() - start,
           "choices": [ln.split("] - ", 1)[-1] for ln in text.splitlines()
                       if "intra-op" in ln or "timing them again" in ln or "threads " in ln and " -> " in ln]}
    if code is None:
        return {**rec, "step_ms": None, "samples_per_s": None, "timed_out": True}
    if code != 0:
        raise BenchmarkError(f"{nproc} rank(s), threads={threads} exited {code}: "
                             + " | ".join(text.strip().splitlines()[-3:]))
    s = _summary(text)
    step_ms = s["measured_step_ms"]
    return {**rec, "step_ms": step_ms, "samples_per_s": nproc * args.batch_size / step_ms * 1e3,
            "final_loss": s["final_loss"], "intra_op_threads": s["intra_op_threads"],
            "thread_trial_ms": s["thread_trial_ms"], "timed_out": False}


def summarize(runs: list[dict]) -> dict:
    """Per (ranks, threads): the median step; per ranks: auto against the best other case (a fixed count or
    `omp1`)."""
    out: dict = {}
    for nproc in sorted({r["nproc"] for r in runs}):
        cases = {}
        for threads in dict.fromkeys(r["threads"] for r in runs if r["nproc"] == nproc):
            ms = [r["step_ms"] if r["step_ms"] is not None else math.inf  # timed out: slower than any
                  for r in runs if r["nproc"] == nproc and r["threads"] == threads]
            cases[threads] = {"median_step_ms": statistics.median(ms), "runs": len(ms),
                              "min_step_ms": min(ms), "max_step_ms": max(ms)}
        fixed = {t: c["median_step_ms"] for t, c in cases.items() if t != "auto"}
        best = min(fixed, key=fixed.get)
        out[str(nproc)] = {"cases": cases, "best_fixed": best,
                           "auto_over_best_fixed": cases["auto"]["median_step_ms"] / fixed[best]}
    return out


def _json_safe(x):
    """inf (a timed-out case) as null: JSON has no infinity."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return None if isinstance(x, float) and math.isinf(x) else x


def table(results: dict, batch: int) -> str:
    rows = [f"{'background':<11}{'ranks':>6}{'threads':>9}{'ms/step':>10}{'samples/s':>11}{'runs':>6}"
            f"{'  range ms':>18}"]
    for bg, half in results["halves"].items():
        for nproc, s in half["summary"].items():
            for threads, c in s["cases"].items():
                ms = c["median_step_ms"]
                sps = f"{int(nproc) * batch / ms * 1e3:.0f}" if math.isfinite(ms) else "timed out"
                rows.append(f"{bg:<11}{nproc:>6}{threads:>9}{ms:>10.2f}{sps:>11}{c['runs']:>6}"
                            f"{c['min_step_ms']:>9.1f}-{c['max_step_ms']:.1f}")
            rows.append(f"{'':<11}{nproc:>6}  auto / best other ({s['best_fixed']}): "
                        f"{s['auto_over_best_fixed']:.2f}x (target <= 1.2x)")
    return "\n".join(rows)


def _busy_loop(log) -> subprocess.Popen:
    """A process that keeps one core busy until stopped (its own session, so `_stop` ends it)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def run_half(background: str, args: argparse.Namespace, work: Path) -> dict:
    cases = [(n, t) for n in args.nproc for t in ["auto", *map(str, range(1, _cores() + 1)), OMP_CASE]]
    half: dict = {"loadavg_start": os.getloadavg(), "runs": []}
    job = None
    with open(work / f"background_{background}.log", "w") as job_log:
        try:
            if background == "busy":
                job = _busy_loop(job_log)
                time.sleep(2)
            elif background == "job":
                bg = work / "background"
                job = _launch(2, ["--out", str(bg), "--", "anyrec",
                                  *anyrec_args(args.model, args.batch_size, 10**8, bg / "run", None)],
                              _env(ROOT), job_log)
                time.sleep(20)  # past its start-up, into its steps
            if job is not None and job.poll() is not None:
                raise BenchmarkError(f"the background ({background}) exited {job.returncode}")
            for i in range(args.rounds):
                k = i % len(cases)
                for nproc, threads in cases[k:] + cases[:k]:
                    r = run_case(nproc, threads, args, work)
                    half["runs"].append(r)
                    step = "timed out" if r["timed_out"] else f"{r['step_ms']:.2f} ms"
                    print(f"background {background} round {i + 1}/{args.rounds} "
                          f"{nproc} rank(s) threads={threads:<5} step {step} "
                          f"(load {r['loadavg_before'][0]:.1f})", flush=True)
        finally:
            if job is not None:
                _stop(job)
    half["loadavg_end"] = os.getloadavg()
    half["summary"] = summarize(half["runs"])
    return half


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dlrm_small", help="anyrec model config")
    ap.add_argument("--batch-size", type=int, default=256, help="per rank")
    ap.add_argument("--nproc", default="1", help="comma-separated rank counts (one host, gloo)")
    ap.add_argument("--steps", type=int, default=100, help="training steps per run (a fifth, at most 10, "
                    "left out as warm-up by the trainer)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each case, alternating")
    ap.add_argument("--background", default="off,busy", help="comma-separated: off (quiet) | busy (one core "
                    "kept busy by a spinning process) | job (a second 2-rank job throughout)")
    ap.add_argument("--timeout-s", type=int, default=300, help="per run")
    ap.add_argument("--json", type=Path, help="write every run and the summary here")
    args = ap.parse_args(argv)
    try:
        args.nproc = [int(n) for n in args.nproc.split(",") if n]
        halves = [b for b in args.background.split(",") if b]
        if (args.rounds < 1 or args.steps < 10 or not args.nproc or min(args.nproc) < 1
                or not set(halves) <= {"off", "busy", "job"}):
            raise BenchmarkError("need --rounds >= 1, --steps >= 10, --nproc >= 1 each, "
                                 "--background off|busy|job")
    except ValueError as e:
        ap.error(f"--nproc: {e}")
    except BenchmarkError as e:
        ap.error(str(e))
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "host": {"cpus": _cores(), "loadavg_start": os.getloadavg()},
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "halves": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="threads_bench_") as tmp:
            for bg in halves:
                results["halves"][bg] = run_half(bg, args, Path(tmp))
    except BenchmarkError as e:
        print(f"threads.py: error: {e}", file=sys.stderr)
        return 2
    results["host"]["loadavg_end"] = os.getloadavg()
    print(table(results, args.batch_size))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_json_safe(results), indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
