"""anyrec against the MLPerf DLRM reference on torchrec (`torchrec_dlrm/dlrm_main.py` of
github.com/facebookresearch/dlrm), side by side on this machine.

    python benchmarks/vs_reference.py --reference /path/to/dlrm                # both shapes, 6 pairs
    python benchmarks/vs_reference.py --reference /path/to/dlrm --pairs 2 --steps 80 --warmup 30 \\
        --shapes dlrm_small --json out.json
    python benchmarks/vs_reference.py --reference /path/to/dlrm --background-job   # a loaded host
    python benchmarks/vs_reference.py --reference /path/to/dlrm --bind-variants    # + bound / free

The reference is not part of this repository: get it at the pinned commit
    git clone https://github.com/facebookresearch/dlrm
    git -C dlrm checkout 090956ee2319ddd349a42232958aefccfe3f7b0a
and pass the checkout (or its `torchrec_dlrm/dlrm_main.py`) as `--reference`. The benchmark checks
dlrm_main.py's git blob id against the pinned commit's and says so when they differ. It runs unmodified,
with its random-data path (torchrec's RandomRecDataset; `--multi_hot_sizes` for the DCN shape).

Shapes (anyrec's model configs, the reference given the same tables, MLPs and interaction):
  dlrm_small    26 tables (600-20,000 rows), dim 16, dot interaction, MLPs 64-32-16 / 64-32-1
  dlrmv2_small  the same 26 features multi-hot (DLRMv2's 214 ids per sample), tables capped at
                20,000 rows, dim 32, 3 low-rank (64) DCN layers, MLPs 64-32 / 128-64-1
Both train with Adagrad (fused, exact, for the tables; torch's for the dense part) at anyrec's
`optim=adagrad` rates, the same batch per rank, `--nproc` ranks over gloo, and are timed the same way at
the same call: `benchmarks/progress_runner.py` wraps torchrec's `TrainPipelineSparseDist.progress` in
both (anyrec's step loop is that pipeline) and records every training call; the first `--warmup` calls
of each rank are left out. A run's step time is the mean steady-state call of its slowest rank;
samples/s = ranks x batch / step time. "cpu ms" is the CPU time of the same calls, all of the rank's
threads together (gloo's and data workers' too), the slowest rank's mean: on a quiet host a step's time
beyond it is waiting; with other work on the host, the contender with less CPU per step gets further on
its share of the cores. Contenders run alternately, `--pairs` times per shape (the order flips every
pair); the table shows medians, the JSON every run, per-pair ratios, the host's load average around each
run and, for anyrec, what its core-binding rule chose (`backend.bind_cores=auto`). `--background-job`
keeps a second 2-rank anyrec training job running on the same host for the whole benchmark (the
shared-host case); `--bind-variants` adds anyrec with `backend.bind_cores=true` and `=false` to the
alternation, to check the rule's choice against both. `--baseline DIR` adds another checkout of anyrec
(say, the commit before a change: `git worktree add DIR HEAD~1`) as `anyrec-baseline`, so a change's
before and after are measured in the same alternation; the table then gives anyrec / baseline per pair
too."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

REFERENCE_REPO = "https://github.com/facebookresearch/dlrm"
REFERENCE_COMMIT = "090956ee2319ddd349a42232958aefccfe3f7b0a"  # 2025-10-02, "unused import [4/n] (#406)"
REFERENCE_BLOB = "6d32d6cb041e7e9d41c2fb11064b30e117cc8cf5"  # git blob id of torchrec_dlrm/dlrm_main.py there
SHAPES = ("dlrm_small", "dlrmv2_small")
RUNNER = Path(__file__).resolve().parent / "progress_runner.py"


class BenchmarkError(Exception):
    """A problem with the inputs or a contender's run, said in one line."""


def reference_script(path: Path) -> Path:
    """dlrm_main.py from a checkout of the dlrm repository, or the file itself."""
    for cand in (path, path / "torchrec_dlrm" / "dlrm_main.py", path / "dlrm_main.py"):
        if cand.is_file() and cand.name == "dlrm_main.py":
            return cand.resolve()
    raise BenchmarkError(
        f"no MLPerf DLRM reference at {path}: expected a checkout of {REFERENCE_REPO} (commit "
        f"{REFERENCE_COMMIT[:12]}) holding torchrec_dlrm/dlrm_main.py; nothing was run")


def git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def model_config(name: str):
    from anyrec._hydra import compose_job
    from anyrec.config import config_dir

    if not (config_dir() / "model" / f"{name}.yaml").is_file():
        raise BenchmarkError(f"no model config {name} (choose from {', '.join(SHAPES)})")
    return compose_job([f"model={name}"])


def reference_args(name: str, batch: int, steps: int) -> list[str]:
    """dlrm_main.py's arguments for anyrec's `model=name` at `batch` per rank, trained `steps` steps."""
    cfg = model_config(name)
    m, o = cfg.model, cfg.optim
    if m.num_dense_features != 13 or len(m.table_rows) != 26:
        raise BenchmarkError(f"{name}: the reference has Criteo's 13 dense and 26 sparse features, "
                             f"the model {m.num_dense_features} and {len(m.table_rows)}")
    if o.name != "adagrad" or o.embedding_lr != o.dense_lr:
        raise BenchmarkError("the reference takes one Adagrad learning rate for tables and MLPs")
    csv = lambda xs: ",".join(map(str, xs))
    args = ["--batch_size", str(batch), "--epochs", "1", "--limit_train_batches", str(steps),
            "--limit_val_batches", "1", "--limit_test_batches", "1",
            "--num_embeddings_per_feature", csv(m.table_rows), "--embedding_dim", str(m.embedding_dim),
            "--dense_arch_layer_sizes", csv(m.bottom_mlp), "--over_arch_layer_sizes", csv(m.top_mlp),
            "--adagrad", "--learning_rate", str(o.dense_lr), "--eps", str(o.eps)]
    if m.interaction == "dcn":
        args += ["--interaction_type", "dcn", "--dcn_num_layers", str(m.dcn_num_layers),
                 "--dcn_low_rank_dim", str(m.dcn_low_rank)]
    elif m.interaction != "dot":
        raise BenchmarkError(f"{name}: interaction {m.interaction!r} has no counterpart in the reference")
    if m.multi_hot:
        args += ["--multi_hot_sizes", csv(m.multi_hot), "--multi_hot_distribution_type", "uniform"]
    return args


def anyrec_args(name: str, batch: int, steps: int, run_dir: Path, bind: str | None) -> list[str]:
    args = [f"model={name}", "optim=adagrad", f"data.batch_size={batch}", f"trainer.steps={steps}",
            "trainer.eval_steps=0", "trainer.progress=false", "trainer.tensorboard=false",
            f"hydra.run.dir={run_dir}"]
    return args + ([f"backend.bind_cores={bind}"] if bind else [])


def _launch(nproc: int, runner_args: list[str], env: dict, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(RUNNER), *runner_args]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """End a launched job and every process it started (its own session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass


def _env(anyrec_root: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                           "MASTER_ADDR", "MASTER_PORT")}
    # anyrec (this checkout, or the baseline's) importable for its own runs only; the reference sees
    # nothing of this repository
    env["PYTHONPATH"] = str(anyrec_root) if anyrec_root is not None else ""
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_once(contender: str, shape: str, args: argparse.Namespace, script: Path, work: Path) -> dict:
    """One training run of `contender` (reference | anyrec | anyrec-bound | anyrec-free |
    anyrec-baseline), timed."""
    out = work / f"{shape}_{contender}_{time.monotonic_ns()}"
    out.mkdir(parents=True)
    if contender == "reference":
        runner = ["--out", str(out), "--", "script", str(script),
                  *reference_args(shape, args.batch_size, args.steps)]
    else:
        bind = {"anyrec-bound": "true", "anyrec-free": "false"}.get(contender)
        runner = ["--out", str(out), "--", "anyrec",
                  *anyrec_args(shape, args.batch_size, args.steps, out / "run", bind)]
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        root = None if contender == "reference" else args.baseline if contender == "anyrec-baseline" else ROOT
        proc = _launch(args.nproc, runner, _env(root), log)
        try:
            code = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise BenchmarkError(f"{contender} on {shape} ran past {args.timeout_s} s "
                                 f"(log: {out / 'log.txt'})") from None
    wall_s = time.perf_counter() - start
    if code != 0:
        tail = (out / "log.txt").read_text(errors="replace").strip().splitlines()[-3:]
        raise BenchmarkError(f"{contender} on {shape} exited {code}: {' | '.join(tail)}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    steady = [[e - s for s, e in r["calls"][args.warmup:]] for r in ranks]
    if any(len(c) < 3 for c in steady):
        raise BenchmarkError(f"{contender} on {shape}: fewer than 3 steady-state steps after "
                             f"{args.warmup} of warm-up (raise --steps)")
    step_s = max(statistics.fmean(c) for c in steady)
    cpu_ms = [statistics.fmean(e - s for s, e in r["cpu"][args.warmup:]) * 1e3 for r in ranks]
    return {"contender": contender, "shape": shape, "step_ms": step_s * 1e3,
            "cpu_ms": max(cpu_ms), "cpu_ms_per_rank": cpu_ms,
            "median_call_ms": max(statistics.median(c) for c in steady) * 1e3,
            "samples_per_s": args.nproc * args.batch_size / step_s,
            "steady_steps": min(len(c) for c in steady), "timed_calls": [len(r["calls"]) for r in ranks],
            "bind": ranks[0]["bind"], "bind_per_rank": [r["bind"] for r in ranks],
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "wall_s": wall_s}


def summarize(runs: list[dict], contenders: list[str]) -> dict:
    """Per contender the median samples/s and CPU ms per step; per pair anyrec / reference; how often
    anyrec was faster."""
    by = {c: [r for r in runs if r["contender"] == c] for c in contenders}
    out = {"median_samples_per_s": {c: statistics.median(r["samples_per_s"] for r in rs)
                                    for c, rs in by.items() if rs},
           "median_cpu_ms": {c: statistics.median(r["cpu_ms"] for r in rs) for c, rs in by.items() if rs}}
    ratios = {}
    for c in contenders:
        if c != "reference":
            ratios[c] = [a["samples_per_s"] / b["samples_per_s"]
                         for a, b in zip(by[c], by["reference"], strict=False)]
    out["ratio_to_reference"] = {c: _ratio_stats(v) for c, v in ratios.items() if v}
    if by.get("anyrec-baseline"):
        out["anyrec_to_baseline"] = _ratio_stats([a["samples_per_s"] / b["samples_per_s"] for a, b in
                                                  zip(by["anyrec"], by["anyrec-baseline"], strict=False)])
    return out


def _ratio_stats(v: list[float]) -> dict:
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "faster_in": sum(x > 1 for x in v),
            "pairs": len(v), "every": v}


def table(results: dict) -> str:
    lines = [f"{'shape':<14} {'contender':<14} {'samples/s':>11} {'step ms':>8} {'cpu ms':>7} {'vs ref':>7} "
             f"{'range':>13} {'faster':>7}"]
    for shape, res in results["shapes"].items():
        s = res["summary"]
        for c, sps in s["median_samples_per_s"].items():
            step = statistics.median(r["step_ms"] for r in res["runs"] if r["contender"] == c)
            r = s["ratio_to_reference"].get(c)
            ratio = (f"{r['median']:>6.2f}x {r['min']:>5.2f}-{r['max']:<5.2f} "
                     f"{r['faster_in']:>3}/{r['pairs']:<3}" if r else f"{'1.00x':>7} {'':>13} {'':>7}")
            cpu = s["median_cpu_ms"][c]
            lines.append(f"{shape:<14} {c:<14} {sps:>11.0f} {step:>8.2f} {cpu:>7.2f} {ratio}")
        if b := s.get("anyrec_to_baseline"):
            lines.append(f"{'':<14} anyrec / baseline {b['median']:.3f}x (pairs {b['min']:.3f}-"
                         f"{b['max']:.3f}, faster in {b['faster_in']}/{b['pairs']})")
        choices = sorted({r["bind"] for r in res["runs"] if r["contender"] == "anyrec" and r["bind"]})
        for ch in choices:
            lines.append(f"{'':<14} anyrec binding: {ch}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", type=Path, default=os.environ.get("DLRM_REFERENCE"),
                    help=f"checkout of {REFERENCE_REPO} at {REFERENCE_COMMIT[:12]} (or its "
                         "torchrec_dlrm/dlrm_main.py); default $DLRM_REFERENCE")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated anyrec model configs")
    ap.add_argument("--pairs", type=int, default=6, help="alternating runs of each contender per shape")
    ap.add_argument("--steps", type=int, default=300, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=50, help="first steps of each run left out")
    ap.add_argument("--batch-size", type=int, default=256, help="per rank")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (one host, gloo)")
    ap.add_argument("--bind-variants", action="store_true",
                    help="also run anyrec with backend.bind_cores=true and =false")
    ap.add_argument("--baseline", type=Path,
                    help="another anyrec checkout (the code before a change) run as anyrec-baseline")
    ap.add_argument("--background-job", action="store_true",
                    help="keep a second 2-rank anyrec training job running throughout (a shared host)")
    ap.add_argument("--timeout-s", type=int, default=900, help="per run")
    ap.add_argument("--json", type=Path, help="write every run and the summary here")
    args = ap.parse_args(argv)
    try:
        if args.reference is None:
            raise BenchmarkError(f"no MLPerf DLRM reference given: pass --reference PATH (a checkout of "
                                 f"{REFERENCE_REPO} at {REFERENCE_COMMIT[:12]}) or set DLRM_REFERENCE")
        if args.pairs < 1 or args.warmup < 0 or args.steps < args.warmup + 3 or args.nproc < 1:
            raise BenchmarkError("need --pairs >= 1, --warmup >= 0, --steps >= --warmup + 3, --nproc >= 1")
        script = reference_script(args.reference)
        if args.baseline is not None and not (args.baseline / "anyrec" / "__init__.py").is_file():
            raise BenchmarkError(f"--baseline {args.baseline}: not an anyrec checkout "
                                 "(no anyrec/__init__.py)")
        shapes = [s for s in args.shapes.split(",") if s]
        for s in shapes:
            reference_args(s, args.batch_size, args.steps)  # every shape checked before anything runs
        results = run_all(args, script, shapes)
    except BenchmarkError as e:
        print(f"vs_reference.py: error: {e}", file=sys.stderr)
        return 2
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    return 0


def run_all(args: argparse.Namespace, script: Path, shapes: list[str]) -> dict:
    blob = git_blob_id(script)
    if blob != REFERENCE_BLOB:
        print(f"vs_reference.py: warning: {script} is not dlrm_main.py of commit {REFERENCE_COMMIT[:12]} "
              f"(blob {blob[:12]}, pinned {REFERENCE_BLOB[:12]})", file=sys.stderr)
    contenders = (["anyrec", "reference"] + (["anyrec-bound", "anyrec-free"] if args.bind_variants else [])
                  + (["anyrec-baseline"] if args.baseline is not None else []))
    results = {"reference": {"repo": REFERENCE_REPO, "commit": REFERENCE_COMMIT, "script": str(script),
                             "blob_matches_commit": blob == REFERENCE_BLOB},
               "host": {"cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                        else os.cpu_count(), "loadavg_start": os.getloadavg()},
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "shapes": {}}
    background = None
    with tempfile.TemporaryDirectory(prefix="vs_reference_") as tmp, \
            open(Path(tmp) / "background.log", "w") as background_log:
        work = Path(tmp)
        try:
            if args.background_job:
                background = _launch(2, ["--out", str(work / "background"), "--", "anyrec",
                                         *anyrec_args("dlrm_small", args.batch_size, 10**8,
                                                      work / "background" / "run", None)],
                                     _env(ROOT), background_log)
                time.sleep(20)  # past its start-up, into its steps
                if background.poll() is not None:
                    raise BenchmarkError(f"the background job exited {background.returncode}")
            for shape in shapes:
                runs = []
                for i in range(args.pairs):
                    k = i % len(contenders)
                    for c in contenders[k:] + contenders[:k]:  # a different contender first each pair
                        try:
                            r = run_once(c, shape, args, script, work)
                        except BenchmarkError as e:  # a crash (seen once: the reference's SIGABRT) is
                            print(f"{shape} pair {i + 1}/{args.pairs} {c}: {e}; running it again",
                                  flush=True)  # retried once, and the JSON says so
                            r = run_once(c, shape, args, script, work)
                            r["retried_after"] = str(e)
                        print(f"{shape} pair {i + 1}/{args.pairs} {c:<13} {r['samples_per_s']:>9.0f} "
                              f"samples/s, step {r['step_ms']:.2f} ms (load {r['loadavg_before'][0]:.1f})"
                              + (f" [{r['bind']}]" if r["bind"] else ""), flush=True)
                        runs.append(r)
                results["shapes"][shape] = {"runs": runs, "summary": summarize(runs, contenders)}
        finally:
            if background is not None:
                _stop(background)
        results["host"]["background_job"] = args.background_job
        results["host"]["loadavg_end"] = os.getloadavg()
    return results


if __name__ == "__main__":
    sys.exit(main())
