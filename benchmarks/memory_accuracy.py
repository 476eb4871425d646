"""Does the planner predict each rank's peak device memory? Train a sweep of short jobs on the simulated
device (examples/simdev: its allocator counts every device byte) and compare, per rank, the plan's
predicted peak (`predicted_peak_memory_bytes_per_rank` of the run's summary) with the measured one
(`measured_peak_memory_bytes_per_rank`: the backend's max_memory_allocated over the training steps), and
the predicted reserved peak with the least capacity each rank fits in: the peak of simdev's
`pages_in_use_bytes` (expandable segments' pages holding an allocated byte, which no out-of-memory retry
can unmap) as well as `max_memory_reserved` (which also counts free pages kept mapped while there is room).

    python benchmarks/memory_accuracy.py [--small] [--jobs NAME ...] [--output out.json]

The sweep covers four models (dlrm_tiny, dlrm_small, dlrmv2_small multi-hot, dlrmv4_small: sequence
tables and HSTU layers at three sequence lengths), every sharding type the device runs (table-, row-,
column-wise, data-parallel), four optimizers, batches 32-4096 and 1, 2 and 4 ranks. simdev is installed
with pip into a temporary folder unless it is importable already.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from anyrec.proc import run_session  # noqa: E402

# dlrmv4_small's synthetic stream at `history` events per pool (16 by default): its longest sample (3
# pools, 8 contextual tokens, the candidate) and the lengths the planner costs, measured from the stream's
# training windows (seed 0) as tests/test_planner_saved_tensors.py measures the default's. At 32 a pool,
# users' histories fill every pool only from the second day (window 0's samples hold at most 99 tokens);
# 5 days simulated before window 0 (3 by default) put the longest sample in a job's first batches, so a
# short job's measured peak meets the peak the plan holds for the whole stream.
V4_LENGTHS = {8: (31.9, 32.0), 16: (51.7, 52.0), 32: (89.5, 90.0)}
V4_HISTORY_DAYS = {32: 5}


def _v4_lengths(history: int) -> list[str]:
    longest = 3 * history + 9
    mean, rms = V4_LENGTHS[history]
    days = [f"+data.sequence.history_days={V4_HISTORY_DAYS[history]}"] if history in V4_HISTORY_DAYS else []
    return [f"data.sequence.history_per_pool={history}", f"data.sequence.max_seq_len={longest}",
            f"model.hstu.max_seq_len={longest}", f"model.hstu.mean_seq_len={mean}",
            f"model.hstu.rms_seq_len={rms}", f"model.hstu.longest_seq_len={longest}", *days]


# name -> (ranks, Hydra overrides)
JOBS: dict[str, tuple[int, list[str]]] = {
    "tiny_1r_adagrad": (1, ["model=dlrm_tiny"]),
    "tiny_2r_sgd_b64": (2, ["model=dlrm_tiny", "optim=sgd", "data.batch_size=64"]),
    "tiny_4r_tw": (4, ["model=dlrm_tiny", "planner.sharding=table_wise"]),
    "tiny_2r_dp_adam": (2, ["model=dlrm_tiny", "planner.sharding=data_parallel", "optim=adam"]),
    "small_1r_adam": (1, ["model=dlrm_small", "optim=adam"]),
    "small_2r_auto": (2, ["model=dlrm_small"]),
    "small_2r_tw_sgd": (2, ["model=dlrm_small", "planner.sharding=table_wise", "optim=sgd"]),
    "small_2r_rw_rowwise": (2, ["model=dlrm_small", "planner.sharding=row_wise", "optim=rowwise_adagrad"]),
    "small_2r_cw_adam": (2, ["model=dlrm_small", "model.embedding_dim=32", "model.bottom_mlp=[64,32]",
                             "planner.sharding=column_wise", "optim=adam"]),
    "small_2r_dp_sgd": (2, ["model=dlrm_small", "planner.sharding=data_parallel", "optim=sgd"]),
    "small_2r_b4096": (2, ["model=dlrm_small", "data.batch_size=4096"]),
    "small_2r_rw_b1024": (2, ["model=dlrm_small", "planner.sharding=row_wise", "data.batch_size=1024"]),
    "small_4r_auto_rowwise": (4, ["model=dlrm_small", "optim=rowwise_adagrad"]),
    "v2_1r_rowwise_b512": (1, ["model=dlrmv2_small", "optim=rowwise_adagrad", "data.batch_size=512"]),
    "v2_2r_auto_adam": (2, ["model=dlrmv2_small", "optim=adam"]),
    "v2_2r_rw_adagrad_b128": (2, ["model=dlrmv2_small", "planner.sharding=row_wise", "data.batch_size=128"]),
    "v2_2r_tw_sgd_b64": (2, ["model=dlrmv2_small", "planner.sharding=table_wise", "optim=sgd",
                             "data.batch_size=64"]),
    "v2_4r_cw_adam_b256": (4, ["model=dlrmv2_small", "planner.sharding=column_wise", "optim=adam"]),
    # DLRMv4: sequence tables (EmbeddingCollection) on anyrec's torch TBE, the HSTU dense part with the
    # torch attention; sequences of at most 33, 57 (the default) and 105 tokens
    "v4_1r_b64": (1, ["model=dlrmv4_small", "data.batch_size=64"]),
    "v4_1r_adam_s33_b256": (1, ["model=dlrmv4_small", "optim=adam", "data.batch_size=256", *_v4_lengths(8)]),
    "v4_2r_auto": (2, ["model=dlrmv4_small"]),
    "v4_2r_tw_b256": (2, ["model=dlrmv4_small", "planner.sharding=table_wise", "data.batch_size=256"]),
    "v4_2r_rw_s33": (2, ["model=dlrmv4_small", "planner.sharding=row_wise", *_v4_lengths(8)]),
    "v4_2r_cw_adagrad_s105_b64": (2, ["model=dlrmv4_small", "planner.sharding=column_wise", "optim=adagrad",
                                      "data.batch_size=64", *_v4_lengths(32)]),
    "v4_2r_tw_sgd_b32": (2, ["model=dlrmv4_small", "planner.sharding=table_wise", "optim=sgd",
                             "data.batch_size=32"]),
    "v4_4r_auto_b64": (4, ["model=dlrmv4_small", "data.batch_size=64"]),
    "v4_4r_rw_s105_b32": (4, ["model=dlrmv4_small", "planner.sharding=row_wise", "data.batch_size=32",
                              *_v4_lengths(32)]),
}
SMALL = ("tiny_1r_adagrad", "tiny_2r_dp_adam")
COMMON = ["backend=simdev", "trainer.calibrate=never", "trainer.steps=6", "trainer.eval_steps=0",
          "trainer.progress=false", "trainer.tensorboard=false", "trainer.log_every=1000"]


def simdev_path(tmp: Path) -> str | None:
    """A folder to put on PYTHONPATH that holds the simdev plugin (None: importable already)."""
    probe = subprocess.run([sys.executable, "-c", "import anyrec_simdev"], capture_output=True)
    if probe.returncode == 0:
        return None
    target = tmp / "simdev"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--no-index", "--target", str(target),
                    str(ROOT / "examples" / "simdev")], check=True, capture_output=True, timeout=300)
    return str(target)


PAGES_FILE_ENV = "ANYREC_MEMACC_PAGES"  # where each rank's worker writes its pages-in-use peak


def worker(overrides: list[str]) -> None:
    """One rank: anyrec-train on `overrides`, then simdev's pages-in-use peak (over the training steps:
    the trainer resets the peaks before them) written to $ANYREC_MEMACC_PAGES.<rank>."""
    def write_pages() -> None:
        import torch

        stats = torch.get_device_module("simdev").memory_stats()
        Path(f"{os.environ[PAGES_FILE_ENV]}.{os.environ.get('RANK', '0')}").write_text(
            str(stats["pages_in_use_bytes.all.peak"]))

    atexit.register(write_pages)
    sys.argv = ["anyrec.train", *overrides]
    runpy.run_module("anyrec.train", run_name="__main__")


def run_job(name: str, ranks: int, overrides: list[str], cwd: Path, extra_path: str | None,
            timeout_s: float) -> dict:
    """One job's row: per-rank predicted and measured peaks and errors, or its error."""
    paths = [str(ROOT), *([extra_path] if extra_path else []), os.environ.get("PYTHONPATH", "")]
    pages = cwd / f"pages_{name}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1",
           PAGES_FILE_ENV: str(pages)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(Path(__file__).resolve()), "--worker", "--", *COMMON, *overrides]
    start = time.perf_counter()
    proc = run_session(cmd, timeout_s, env=env, cwd=cwd)
    row: dict = {"job": name, "ranks": ranks, "overrides": overrides,
                 "wall_s": round(time.perf_counter() - start, 1)}
    summary = next((json.loads(line) for line in reversed(proc.stdout.splitlines()) if line.startswith("{")),
                   None)
    if proc.returncode != 0 or summary is None:
        row["error"] = (proc.stderr or proc.stdout)[-1500:]
        return row
    keys = ("predicted_peak_memory_bytes_per_rank", "measured_peak_memory_bytes_per_rank",
            "memory_prediction_error_per_rank", "memory_prediction_error",
            "predicted_reserved_memory_bytes_per_rank", "measured_reserved_memory_bytes_per_rank",
            "predicted_memory_terms", "batch_size_per_rank")
    row.update({k: summary[k] for k in keys})
    files = [Path(f"{pages}.{r}") for r in range(ranks)]
    row["least_capacity_bytes_per_rank"] = [int(f.read_text()) if f.exists() else None for f in files]
    return row


def table(rows: list[dict]) -> str:
    """Predicted, measured and error of every rank of every job; the median and worst |error| last."""
    lines = [f"{'job':<24} {'rank':>4} {'predicted MiB':>14} {'measured MiB':>13} {'error':>8}  "
             f"{'reserved: predicted':>19} {'measured':>9} {'error':>7} {'least cap.':>10} {'error':>7}"]
    errors, reserved_errors, capacity_errors = [], [], []
    for row in rows:
        if "error" in row:
            lines.append(f"{row['job']:<24} failed: {row['error'].strip().splitlines()[-1][:80]}")
            continue
        columns = ("predicted_peak_memory_bytes_per_rank", "measured_peak_memory_bytes_per_rank",
                   "memory_prediction_error_per_rank", "predicted_reserved_memory_bytes_per_rank",
                   "measured_reserved_memory_bytes_per_rank")
        least = row.get("least_capacity_bytes_per_rank") or [None] * row["ranks"]
        for r, (p, m, e, pr, mr) in enumerate(zip(*(row[c] for c in columns), strict=True)):
            errors.append(abs(e))
            reserved_errors.append(pr / mr - 1)
            cap = (f"{least[r] / 2**20:>10.2f} {pr / least[r] - 1:>+7.1%}" if least[r]
                   else f"{'-':>10} {'-':>7}")
            if least[r]:
                capacity_errors.append(pr / least[r] - 1)
            lines.append(f"{row['job']:<24} {r:>4} {p / 2**20:>14.2f} {m / 2**20:>13.2f} {e:>+8.1%}  "
                         f"{pr / 2**20:>19.2f} {mr / 2**20:>9.2f} {pr / mr - 1:>+7.1%} {cap}")
    if errors:
        lines.append(f"{len(errors)} ranks of {sum('error' not in r for r in rows)} jobs: median |error| "
                     f"{statistics.median(errors):.1%}, worst {max(errors):.1%}; reserved (what the capacity "
                     f"bounds): from {min(reserved_errors):+.1%} to {max(reserved_errors):+.1%} of "
                     f"max_memory_reserved, median {statistics.median(reserved_errors):+.1%}")
    if capacity_errors:
        lines.append(f"reserved against the least capacity each rank fits in: from "
                     f"{min(capacity_errors):+.1%} "
                     f"to {max(capacity_errors):+.1%}, median {statistics.median(capacity_errors):+.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help=f"two quick jobs only ({', '.join(SMALL)})")
    ap.add_argument("--jobs", nargs="+", choices=sorted(JOBS), help="run these jobs only")
    ap.add_argument("--output", type=Path, help="write the rows and the summary as JSON here")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.overrides)
        return 0
    names = args.jobs or (list(SMALL) if args.small else list(JOBS))
    rows = []
    with tempfile.TemporaryDirectory(prefix="anyrec-memacc-") as tmp:
        extra = simdev_path(Path(tmp))
        for name in names:
            ranks, overrides = JOBS[name]
            rows.append(run_job(name, ranks, overrides, Path(tmp), extra, args.timeout))
            print(table(rows[-1:]).split("\n", 1)[1] if "error" not in rows[-1] else rows[-1]["error"][-400:],
                  file=sys.stderr, flush=True)
    print(table(rows))
    errors = [abs(e) for r in rows if "error" not in r for e in r["memory_prediction_error_per_rank"]]
    ok = [r for r in rows if "error" not in r]
    predicted = [p for r in ok for p in r["predicted_reserved_memory_bytes_per_rank"]]
    measured = [m for r in ok for m in r["measured_reserved_memory_bytes_per_rank"]]
    reserved = [p / m - 1 for p, m in zip(predicted, measured, strict=True)]
    least = [p / c - 1 for p, c in zip(predicted, [c for r in ok for c in r["least_capacity_bytes_per_rank"]],
                                       strict=True) if c]
    result = {"jobs": rows, "ranks_measured": len(errors),
              "reserved_error_range": [min(reserved), max(reserved)] if reserved else None,
              "reserved_vs_least_capacity_error_range": [min(least), max(least)] if least else None,
              "median_abs_error": statistics.median(errors) if errors else None,
              "worst_abs_error": max(errors) if errors else None}
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
