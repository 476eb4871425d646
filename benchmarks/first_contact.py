"""First contact on a busy host: how far the default jobs' predicted step is from the measured one on their
first run (an empty calibration cache: the quick calibration measures the host as it is) and on the second
(the cached entry, untrusted while the host stays busy, and the step learnt from the first run).

    python benchmarks/first_contact.py --json benchmarks/results/<date>_cpu-2core/first_contact.json
    python benchmarks/first_contact.py --nproc 1,2 --background busy,off

For each `--nproc` (1,2) and `--background` (busy: one core kept busy by a spinning process the benchmark
starts before the half and stops after it; off: nothing started), the default job
(`torchrun --standalone --nproc_per_node=N -m anyrec.train`, `hardware=auto`) runs twice on a cache folder of
its own, emptied first. Each run's `prediction_error` (predicted / measured - 1) comes from its summary;
the targets with one core busy: first contact within 30 %, the second run within 15 %. The table shows
both runs per case, the JSON every run with the load average around it and the calibration's verdict.
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

if __package__ in (None, ""):  # run as a script: benchmarks/ importable as a package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.threads import _busy_loop, _summary  # noqa: E402
from benchmarks.vs_reference import BenchmarkError, _env, _stop  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent  # this checkout: the anyrec every run imports
TARGETS = {"first": 0.30, "second": 0.15}  # |prediction_error| with one core busy


def run_job(nproc: int, cache: Path, out: Path, timeout_s: float) -> dict:
    """The default job on `nproc` ranks with `cache` as its calibration cache: its summary's figures."""
    out.mkdir(parents=True)
    env = {**_env(ROOT), "ANYREC_CACHE_DIR": str(cache), "ANYREC_CALIBRATE": "auto"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "anyrec.train", "trainer.progress=false", "trainer.tensorboard=false",
           f"hydra.run.dir={out / 'run'}"]
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise BenchmarkError(f"{nproc} rank(s): no summary within {timeout_s:.0f} s") from None
    text = (out / "log.txt").read_text(errors="replace")
    if code != 0:
        raise BenchmarkError(f"{nproc} rank(s) exited {code}: " + " | ".join(text.strip().splitlines()[-3:]))
    s = _summary(text)
    verdict = [ln.split("] - ", 1)[-1] for ln in text.splitlines() if "calibration: " in ln]
    return {"nproc": nproc, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "wall_s": time.perf_counter() - start, "calibration": verdict,
            **{k: s.get(k) for k in ("predicted_step_ms", "measured_step_ms", "prediction_error",
                                     "model_step_ms", "step_correction", "step_correction_runs",
                                     "intra_op_threads")}}


def run_half(background: str, nprocs: list[int], work: Path, timeout_s: float) -> list[dict]:
    runs = []
    with open(work / f"background_{background}.log", "w") as log:
        job = _busy_loop(log) if background == "busy" else None
        try:
            time.sleep(2 if job else 0)
            for nproc in nprocs:
                cache = work / f"cache_{background}_{nproc}"
                for which in ("first", "second"):
                    r = run_job(nproc, cache, work / f"{background}_{nproc}_{which}", timeout_s)
                    runs.append({"background": background, "run": which, **r})
                    print(f"background {background} {nproc} rank(s) {which}: predicted "
                          f"{r['predicted_step_ms']:.2f} ms, measured {r['measured_step_ms']:.2f} ms "
                          f"({r['prediction_error'] * 100:+.1f} %)", flush=True)
        finally:
            if job is not None:
                _stop(job)
    return runs


def table(runs: list[dict]) -> str:
    rows = [f"{'background':<11}{'ranks':>6}{'run':>8}{'predicted ms':>14}{'measured ms':>13}{'error':>9}"
            f"{'  target':>9}"]
    for r in runs:
        target = f"{TARGETS[r['run']] * 100:.0f} %" if r["background"] == "busy" else "-"
        rows.append(f"{r['background']:<11}{r['nproc']:>6}{r['run']:>8}{r['predicted_step_ms']:>14.2f}"
                    f"{r['measured_step_ms']:>13.2f}{r['prediction_error'] * 100:>+8.1f}%{target:>9}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", default="1,2", help="comma-separated rank counts (one host, gloo)")
    ap.add_argument("--background", default="busy", help="comma-separated: busy (one core kept busy) | off")
    ap.add_argument("--timeout-s", type=float, default=900, help="per run")
    ap.add_argument("--json", type=Path, help="write every run here")
    args = ap.parse_args(argv)
    try:
        nprocs = [int(n) for n in args.nproc.split(",")]
        backgrounds = args.background.split(",")
        if any(n < 1 for n in nprocs) or not set(backgrounds) <= {"busy", "off"}:
            raise ValueError
    except ValueError:
        print(f"first_contact.py: error: --nproc takes rank counts >= 1, --background busy and/or off; got "
              f"{args.nproc!r}, {args.background!r}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="anyrec-first-contact-") as tmp:
        try:
            runs = [r for bg in backgrounds for r in run_half(bg, nprocs, Path(tmp), args.timeout_s)]
        except BenchmarkError as e:
            print(f"first_contact.py: error: {e}", file=sys.stderr)
            return 1
    print(table(runs))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "runs": runs}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
