"""The closed loop of first contact: calibrate, train, train again, and how far each run's predicted
step was from its measured one, on a host that a second job shares.

    python benchmarks/closed_loop.py                          # 2 loops of 3 runs, with a second job
    python benchmarks/closed_loop.py --loops 1 --runs 2 --no-background --json out.json

Each loop starts from an empty calibration cache (`ANYREC_CACHE_DIR`, its own folder) and trains `--model`
(dlrm_small) `--runs` times for `--steps` (200) at `--batch-size` (256) per rank on 2 ranks with the
default settings (`hardware=auto`, `trainer.calibrate=auto`): the first run calibrates on first contact
(a cache miss) and plans with the figures, every later one is a cache hit and predicts with the step
correction the earlier runs of the loop wrote back (`anyrec.history.steplearn`). Each run's figures
are its summary's: `predicted_step_ms`, `measured_step_ms`, `prediction_error`, `step_correction`,
`step_correction_runs`. With `--background` (the default) a second 2-rank anyrec training job
(dlrm_small, default settings, its own cache) runs on the same host for the whole benchmark, stopped with
everything it started at the end. Launching and stopping are `vs_reference.py`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.threads import _summary  # noqa: E402
from benchmarks.vs_reference import BenchmarkError, _env, _launch, _stop, anyrec_args  # noqa: E402

NPROC = 2


def run_once(loop: int, run: int, cache: Path, args: argparse.Namespace, work: Path) -> dict:
    """One default training run against the loop's cache; its summary's prediction figures."""
    out = work / f"loop{loop}_run{run}"
    out.mkdir(parents=True)
    runner = ["--out", str(out), "--", "anyrec", *anyrec_args(args.model, args.batch_size, args.steps,
                                                                out / "run", None)]
    env = {**_env(True), "ANYREC_CACHE_DIR": str(cache), "ANYREC_CALIBRATE": "auto"}
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        proc = _launch(NPROC, runner, env, log)
        try:
            code = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise BenchmarkError(f"loop {loop} run {run} ran past {args.timeout_s} s") from None
    text = (out / "log.txt").read_text(errors="replace")
    if code != 0:
        raise BenchmarkError(f"loop {loop} run {run} exited {code}: "
                             + " | ".join(text.strip().splitlines()[-3:]))
    s = _summary(text)
    cache_line = next((ln.split("] - ", 1)[-1] for ln in text.splitlines() if "calibration: " in ln
                       and ("cache hit" in ln or "cache miss" in ln)), None)
    return {"loop": loop, "run": run, "wall_s": time.perf_counter() - start, "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "calibration": cache_line,
            **{k: s.get(k) for k in ("predicted_step_ms", "measured_step_ms", "prediction_error",
                                     "model_step_ms", "step_correction", "step_correction_runs",
                                     "final_loss")}}


def table(runs: list[dict]) -> str:
    lines = ["| loop | run | cache | predicted ms | measured ms | error | correction (runs) | load |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        cache = "miss" if r["calibration"] and "miss" in r["calibration"] else "hit"
        lines.append(f"| {r['loop']} | {r['run']} | {cache} | {r['predicted_step_ms']:.1f} | "
                     f"{r['measured_step_ms']:.1f} | {r['prediction_error'] * 100:+.1f} % | "
                     f"{r['step_correction']:.2f} ({r['step_correction_runs']}) | "
                     f"{r['loadavg_before'][0]:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dlrm_small")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--loops", type=int, default=2, help="loops, each from an empty calibration cache")
    p.add_argument("--runs", type=int, default=3, help="training runs per loop (the first calibrates)")
    p.add_argument("--background", action=argparse.BooleanOptionalAction, default=True,
                   help="a second 2-rank training job on the host throughout (default: on)")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--json", type=Path, help="write every run's figures here")
    args = p.parse_args(argv)
    if args.loops < 1 or args.runs < 2 or args.steps < 1:
        p.error("--loops >= 1, --runs >= 2 (a loop is a calibrating run and at least one more), --steps >= 1")
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "loadavg_start": os.getloadavg(),
                    "runs": []}
    with tempfile.TemporaryDirectory(prefix="anyrec_closed_loop_") as tmp:
        work, job = Path(tmp), None
        with open(work / "background.log", "w") as job_log:
            try:
                if args.background:
                    bg = work / "background"
                    job = _launch(2, ["--out", str(bg), "--", "anyrec",
                                      *anyrec_args(args.model, args.batch_size, 10**8, bg / "run", None)],
                                  {**_env(True), "ANYREC_CACHE_DIR": str(work / "background_cache")},
                                  job_log)
                    time.sleep(20)  # past its start-up, into its steps
                    if job.poll() is not None:
                        raise BenchmarkError(f"the background job exited {job.returncode}")
                for loop in range(1, args.loops + 1):
                    cache = work / f"cache{loop}"
                    for run in range(1, args.runs + 1):
                        r = run_once(loop, run, cache, args, work)
                        result["runs"].append(r)
                        print(f"loop {loop} run {run}: predicted {r['predicted_step_ms']:.1f} ms, measured "
                              f"{r['measured_step_ms']:.1f} ms ({r['prediction_error'] * 100:+.1f} %)",
                              flush=True)
            except BenchmarkError as e:
                print(f"closed_loop: error: {e}", file=sys.stderr)
                return 1
            finally:
                if job is not None:
                    _stop(job)
    result["loadavg_end"] = os.getloadavg()
    print(table(result["runs"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
