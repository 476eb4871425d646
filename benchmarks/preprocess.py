"""Criteo TSV -> npy conversion: rows/s and peak memory of `anyrec.data.preprocess` beside torchrec's
`BinaryCriteoUtils.tsv_to_npys`, on the same synthetic day file, plain and gzipped.

    python benchmarks/preprocess.py                                  # 2 M rows, both tools, plain and gzip
    python benchmarks/preprocess.py --rows 2000000 5000000 --no-torchrec --json out.json

The TSV is Criteo-shaped (label, 13 decimal dense values with ~20% missing, 26 8-digit hex ids with ~5%
missing) and made of rows drawn from a pool of 65,536 random rows (the parsers' cost does not depend on
repeats). Each conversion runs in its own process, started by a helper process that reports the worker's
peak RSS with getrusage(RUSAGE_CHILDREN) (the worker is its only child): the RSS includes the imports
(torch and torchrec: ~400 MiB). rows/s counts the conversion alone (imports excluded). torchrec's output
is checked byte-equal to anyrec's; torchrec reads plain files only (no gzip row for it).
Prints a table; `--json` writes it.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
POOL_ROWS = 1 << 16
# (import, conversion) of each tool; only the conversion is timed
WORKER = {
    "anyrec": ("from anyrec.data.preprocess import convert", "convert(SRC, OUT)"),
    "torchrec": ("from torchrec.datasets.criteo import BinaryCriteoUtils as U",
                 "U.tsv_to_npys(SRC, *(f'{OUT}/day_0_{p}.npy' for p in ('dense', 'sparse', 'labels')))"),
}


def write_tsv(path: Path, rows: int, compress: bool) -> None:
    """`rows` Criteo-shaped rows drawn from a random pool, plain or gzipped (level 1)."""
    rng = np.random.default_rng(0)
    pool = []
    for _ in range(POOL_ROWS):
        dense = [str(int(x)) if rng.random() > 0.2 else "" for x in rng.integers(0, 5000, 13)]
        sparse = [format(int(x), "08x") if rng.random() > 0.05 else "" for x in rng.integers(0, 2**32, 26)]
        pool.append(("\t".join([str(int(rng.integers(0, 2))), *dense, *sparse]) + "\n").encode())
    f = gzip.open(path, "wb", compresslevel=1) if compress else path.open("wb")
    with f:
        for lo in range(0, rows, 100_000):
            f.write(b"".join(pool[i] for i in rng.integers(0, POOL_ROWS, min(100_000, rows - lo))))


def measure(tool: str, src: Path, out: Path) -> dict:
    """Run one conversion in a worker process; its wall time and peak RSS (this helper's only child)."""
    out.mkdir(parents=True, exist_ok=True)
    imports, run = WORKER[tool]
    code = (f"import time, json; {imports}; SRC, OUT = {str(src)!r}, {str(out)!r}; t = time.perf_counter(); "
            f"{run}; print(json.dumps(time.perf_counter() - t))")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return {"seconds": json.loads(proc.stdout.strip().splitlines()[-1]), "peak_rss_bytes": rss}


def digest(out: Path) -> str:
    return hashlib.sha256(b"".join((out / f"day_0_{p}.npy").read_bytes()
                                   for p in ("dense", "sparse", "labels"))).hexdigest()[:16]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[2_000_000], help="rows of each day file")
    parser.add_argument("--formats", nargs="+", choices=("plain", "gzip"), default=["plain", "gzip"])
    parser.add_argument("--no-torchrec", action="store_true", help="anyrec only (torchrec holds every row "
                        "as Python objects: ~2 GB per million rows)")
    parser.add_argument("--work-dir", default=None,
                        help="where the TSVs and outputs go (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--measure", nargs=3, metavar=("TOOL", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:  # the helper process: one worker, then its figures
        print(json.dumps(measure(args.measure[0], Path(args.measure[1]), Path(args.measure[2]))))
        return {}
    tools = ["anyrec"] + ([] if args.no_torchrec else ["torchrec"])
    results = []
    with tempfile.TemporaryDirectory(prefix="anyrec-bench-preprocess-", dir=args.work_dir) as work:
        for rows in args.rows:
            for fmt in args.formats:
                src = Path(work) / f"day_0{'.gz' if fmt == 'gzip' else '.tsv'}"
                t = time.perf_counter()
                write_tsv(src, rows, fmt == "gzip")
                print(f"wrote {rows:,} rows ({fmt}, {src.stat().st_size / 2**20:,.0f} MiB) in "
                      f"{time.perf_counter() - t:.0f} s", flush=True)
                digests = {}
                # torchrec reads plain text only (a gzipped day is an error there)
                for tool in [t for t in tools if fmt == "plain" or t == "anyrec"]:
                    out = Path(work) / f"out_{tool}"
                    helper = subprocess.run([sys.executable, __file__, "--measure", tool, str(src), str(out)],
                                            capture_output=True, text=True, check=True)
                    r = {"rows": rows, "format": fmt, "tool": tool,
                         **json.loads(helper.stdout.strip().splitlines()[-1])}
                    if "seconds" in r:
                        r["rows_per_s"] = rows / r["seconds"]
                        digests[tool] = digest(out)
                    results.append(r)
                    print(json.dumps(r), flush=True)
                    for p in out.glob("*"):
                        p.unlink()
                if len(set(digests.values())) > 1:
                    raise SystemExit(f"outputs differ: {digests}")
                src.unlink()
    load = os.getloadavg()[0]
    print(f"\nCriteo TSV -> npy, {os.cpu_count()} cores, load average {load:.1f}")
    print(f"{'rows':>12} {'format':<7}{'tool':<10}{'rows/s':>12}{'seconds':>10}{'peak RSS MiB':>14}")
    for r in results:
        if "seconds" in r:
            print(f"{r['rows']:>12,} {r['format']:<7}{r['tool']:<10}{r['rows_per_s']:>12,.0f}"
                  f"{r['seconds']:>10.1f}{r['peak_rss_bytes'] / 2**20:>14,.0f}")
        else:
            print(f"{r['rows']:>12,} {r['format']:<7}{r['tool']:<10}  failed: {r['error']}")
    out = {"load_average": load, "cpu_count": os.cpu_count(), "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
