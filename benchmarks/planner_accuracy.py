"""Does the planner predict the trainer's real step? Calibrate, then plan and train each workload on
2 ranks of this machine, uncalibrated (the SKU table) and calibrated, and compare the plan's
predicted step time with the measured one per rank.

    python benchmarks/planner_accuracy.py [--small] [--calibration cal.yaml] [--output out.json]

Each training run is `torchrun -m anyrec.train`; its JSON summary carries `predicted_step_ms`,
`measured_step_ms_per_rank` (after warm-up) and `prediction_error` (predicted / measured - 1).
Timing on a shared host is noisy: the workloads run in `--repeats` rounds, each training every workload
once per hardware file (alternating which goes first), and each row reports its median run (all runs'
measured times are in the JSON); a row whose runs differ by more than 30 % is flagged as measured on a
drifting host. Compare the two columns of one run, not runs on different days.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from anyrec.proc import run_session  # noqa: E402

# name -> Hydra overrides: table counts, dims 8-256, pooling 1-100, id skew, and one whose big table
# cannot fit one rank (a memory cap forces row- or column-wise sharding).
WORKLOADS: dict[str, list[str]] = {
    "tiny_26x8": ["model=dlrm_tiny"],
    "small_26x16": ["model=dlrm_small"],
    "small_uniform_ids": ["model=dlrm_small", "data.zipf_exponent=0.0"],
    "wide_8x128": ["model=dlrm_small", "model.embedding_dim=128", "model.table_rows=[50000]*8",
                   "model.bottom_mlp=[256,128]"],
    "multihot_8x32_p1-100": ["model=dlrm_small", "model.embedding_dim=32", "model.table_rows=[20000]*8",
                             "model.multi_hot=[100,40,20,10,5,3,2,1]", "model.bottom_mlp=[64,32]"],
    # Dim 256: torchrec splits a table column-wise in 128-wide pieces, so both planners can split it.
    "big_table_split": ["model=dlrm_small", "model.embedding_dim=256",
                        "model.table_rows=[100000,1000,1000,1000,1000,1000,1000,1000]",
                        "model.bottom_mlp=[64,256]",
                        # 2.4 GB less the planner's 10% and 2 GB reserve: ~160 MB per rank, under the
                        # big table's 205 MB of weights + Adagrad state.
                        "+hardware.spec.memory_bytes=2400000000"],
}
SMALL = ("tiny_26x8", "small_26x16")
# Runs of one plan that differ by more than this (slowest / fastest - 1) measured a host that changed
# speed meanwhile: the row's error says as much about the host as about the model. Quiet runs on the
# 2-core CPU host spread up to 25 % (2026-12-01: 24 workload x hardware rows of 3 runs); disturbed ones
# 40-55 %.
NOISY_SPREAD = 0.30
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:?")


def _expand(overrides: list[str]) -> list[str]:
    """`key=[v]*n` shorthand into a Hydra list."""
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if value.startswith("[") and "]*" in value:
            item, _, n = value[1:].partition("]*")
            value = "[" + ",".join([item] * int(n)) + "]"
        out.append(f"{key}={value}")
    return out


def error_line(stderr: str) -> str:
    """The line of a failed torchrun job's stderr that says why: the last exception line
    (`SomeError: ...`), else the last line that is not torchrun's failure footer."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    said = [ln for ln in lines if EXCEPTION_LINE.match(ln) and "ChildFailedError" not in ln]
    rest = [ln for ln in lines if not ln.startswith(("traceback :", "[", "=", "-")) and "elastic" not in ln]
    return ((said or rest or ["?"])[-1])[:300]


def _torchrun(args: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=2 ARGS` in its own session (anyrec.proc.run_session: a
    timeout kills torchrun and its workers, then raises TimeoutExpired)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return run_session(cmd, timeout_s, env=env, cwd=cwd)


def calibrate(out: Path, small: bool, timeout_s: float) -> Path:
    """A 2-rank calibration file (collectives included)."""
    budget = "0.02" if small else "0.3"
    proc = _torchrun(["-m", "anyrec.calibrate", f"output={out}", f"budget_s={budget}"], out.parent, timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"calibration failed: {proc.stderr[-2000:]}")
    return out


def train(name: str, hardware: str, steps: int, batch: int, workdir: Path, timeout_s: float) -> dict:
    """One 2-rank training run of workload `name` planned for `hardware`; its summary."""
    run_dir = workdir / f"{name}_{Path(hardware).stem}"
    args = ["-m", "anyrec.train", *_expand(WORKLOADS[name]), f"hardware.sku={hardware}",
            f"trainer.steps={steps}", f"data.batch_size={batch}", "trainer.eval_steps=0",
            "trainer.progress=false", f"hydra.run.dir={run_dir}"]
    try:
        proc = _torchrun(args, workdir, timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0:
        return {"error": error_line(proc.stderr)}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1])


def median_run(runs: list[dict], key: str = "measured_step_ms") -> dict:
    """The run whose `key` is the median of the runs that have one (the lower middle of an even count),
    else the first run: one run's summary, so its fields stay consistent."""
    ok = sorted((r for r in runs if r.get(key) is not None), key=lambda r: r[key])
    return ok[(len(ok) - 1) // 2] if ok else runs[0]


def spread(times: list[float | None]) -> float | None:
    """Slowest / fastest - 1 over the runs that measured a time (None with fewer than two)."""
    ok = [t for t in times if t is not None]
    return max(ok) / min(ok) - 1 if len(ok) >= 2 else None


def run_workloads(names, cal: Path, steps: int, batch: int, workdir: Path, timeout_s: float,
                  repeats: int = 1) -> list[dict]:
    """`repeats` rounds, each training every workload once per hardware file (the order of the two
    alternating): a workload's runs spread over the whole benchmark, so a few minutes of a slower
    host reach one of its runs, not all of them; each row reports its median run."""
    hardware = {"uncal": "cpu", "cal": str(cal)}
    runs: dict[str, dict[str, list[dict]]] = {name: {"uncal": [], "cal": []} for name in names}
    for k in range(repeats):
        for name in names:
            for label in ("uncal", "cal") if k % 2 == 0 else ("cal", "uncal"):
                runs[name][label].append(train(name, hardware[label], steps, batch, workdir, timeout_s))
    rows = []
    for name in names:
        row: dict = {"workload": name}
        for label, got in runs[name].items():
            s = median_run(got)
            row[f"{label}_error_msg"] = s.get("error")
            row[f"{label}_predicted_ms"] = s.get("predicted_step_ms")
            row[f"{label}_measured_ms"] = s.get("measured_step_ms")
            row[f"{label}_measured_ms_per_rank"] = s.get("measured_step_ms_per_rank")
            row[f"{label}_error"] = s.get("prediction_error")
            row[f"{label}_measured_ms_runs"] = [r.get("measured_step_ms") for r in got]
            row[f"{label}_spread"] = spread(row[f"{label}_measured_ms_runs"])
        rows.append(row)
    return rows


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    head = (f"{'workload':<20} {'uncal pred':>10} {'uncal meas':>10} {'uncal err':>9} "
            f"{'cal pred':>9} {'cal meas':>9} {'cal err':>8} {'cal spread':>10}  per-rank measured (cal, ms)")
    lines = [head]
    noisy = []
    for r in rows:
        ranks = r.get("cal_measured_ms_per_rank") or []
        lines.append(f"{r['workload']:<20} {_fmt(r['uncal_predicted_ms']):>10} "
                     f"{_fmt(r['uncal_measured_ms']):>10} {_fmt(r['uncal_error'], '+.0%'):>9} "
                     f"{_fmt(r['cal_predicted_ms']):>9} "
                     f"{_fmt(r['cal_measured_ms']):>9} {_fmt(r['cal_error'], '+.0%'):>8} "
                     f"{_fmt(r.get('cal_spread'), '.0%'):>10}  " + " ".join(_fmt(v) for v in ranks))
        for label in ("uncal", "cal"):
            if (r.get(f"{label}_spread") or 0.0) > NOISY_SPREAD:
                runs = [t for t in r[f"{label}_measured_ms_runs"] if t is not None]
                noisy.append(f"{r['workload']} ({label} runs {min(runs):.2f}-{max(runs):.2f} ms)")
    for label in ("uncal", "cal"):
        errs = [abs(r[f"{label}_error"]) for r in rows if r[f"{label}_error"] is not None]
        if errs:
            lines.append(f"{label}: median |error| {statistics.median(errs):.0%}, worst {max(errs):.0%} "
                         f"over {len(errs)} workloads")
    if noisy:
        lines.append(f"noisy host: runs of one plan differ by more than {NOISY_SPREAD:.0%} in "
                     + ", ".join(noisy) + "; their errors measure the host's drift too: rerun quietly")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="two workloads, a few steps (for tests)")
    ap.add_argument("--calibration", type=Path, help="use this file instead of calibrating")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--only", nargs="+", choices=tuple(WORKLOADS), help="run only these workloads")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs per workload and hardware, alternating; the median run is reported")
    ap.add_argument("--output", type=Path, default=Path("planner_accuracy.json"))
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.small else 3)
    steps = args.steps or (8 if args.small else 60)
    batch = 64 if args.small else 256
    timeout_s = 300.0 if args.small else 900.0
    names = args.only or (SMALL if args.small else tuple(WORKLOADS))
    with tempfile.TemporaryDirectory(prefix="anyrec_acc_") as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        cal = args.calibration or calibrate(work / "cal.yaml", args.small, timeout_s)
        rows = run_workloads(names, cal.resolve(), steps, batch, work, timeout_s, repeats)
        calibration = cal.read_text()
    print(table(rows))
    args.output.write_text(json.dumps({"rows": rows, "steps": steps, "batch_size_per_rank": batch,
                                       "repeats": repeats,
                                       "seconds": time.perf_counter() - start,
                                       "calibration": calibration}, indent=1))
    print(f"wrote {args.output}")
    return rows


if __name__ == "__main__":
    main()
