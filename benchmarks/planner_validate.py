"""Validate the planner's lookup-time model against measured CPU embedding lookups.

Calibrates a CPU DeviceSpec from a copy bandwidth measured in the same run, fits the kernel's one
empirical constant (bandwidth efficiency) by least squares over the shapes, then reports predicted
vs measured forward time of nn.EmbeddingBag per table shape. Goal: within 15% after calibration.

    PYTHONPATH=. python benchmarks/planner_validate.py [--quick] [--output FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from anyrec.backends.specs import get_sku  # noqa: E402
from anyrec.planner.cli import write_json_atomic  # noqa: E402
from anyrec.planner.estimators import KernelProfile, lookup_time_s  # noqa: E402
from anyrec.planner.types import Placement, TableSpec, Topology  # noqa: E402

# (rows, dim, pooling factor, batch): cache-resident and DRAM-resident tables, narrow and wide rows.
SHAPES = [
    (1_000_000, 128, 20, 2048),
    (1_000_000, 64, 20, 2048),
    (1_000_000, 32, 30, 2048),
    (2_000_000, 128, 5, 4096),
    (200_000, 256, 10, 2048),
    (4_000_000, 16, 40, 2048),
]
QUICK_SHAPES = SHAPES[:4]


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_copy_bw(n_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy, read + write counted (as the planner's bandwidths are)."""
    src = torch.empty(n_bytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    return 2 * n_bytes / _best_time(lambda: dst.copy_(src), repeats)


def measure_lookup(rows: int, dim: int, pooling: int, batch: int, repeats: int) -> float:
    """Seconds for one nn.EmbeddingBag(sum) forward over uniform random ids."""
    emb = torch.nn.EmbeddingBag(rows, dim, mode="sum")
    ids = torch.randint(0, rows, (batch * pooling,))
    offsets = torch.arange(0, batch * pooling, pooling)
    with torch.no_grad():
        return _best_time(lambda: emb(ids, offsets), repeats)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats (tests)")
    ap.add_argument("--output", default="planner_validation.json")
    args = ap.parse_args(argv)
    repeats = 3 if args.quick else 7
    shapes = QUICK_SHAPES if args.quick else SHAPES
    copy_bw = measure_copy_bw(repeats=repeats)
    device = get_sku("cpu").replace(memory_bw_bytes_per_s=copy_bw, source="calibrated: measured copy")
    topo = Topology(device, 1, 1, "cpu")
    unit = KernelProfile("torch-cpu", 1.0, 64)
    measured, raw, n_ids = [], [], []
    for rows, dim, pooling, batch in shapes:
        t = TableSpec("t", rows, dim, float(pooling), ["f"])
        fwd, _ = lookup_time_s(batch * pooling, batch, dim, t, Placement.HBM, topo, "sgd", unit)
        raw.append(fwd)  # predicted seconds at 100% of copy bandwidth, no per-row latency
        n_ids.append(batch * pooling)
        measured.append(measure_lookup(rows, dim, pooling, batch, repeats))
    # Two empirical constants (1/efficiency, per-row latency) by least squares on relative error:
    # minimise sum((a * raw + c * ids) / m - 1)^2, a 2x2 linear system.
    xs = [(r / m, n / m) for r, n, m in zip(raw, n_ids, measured, strict=True)]
    s11 = sum(x * x for x, _ in xs)
    s12 = sum(x * y for x, y in xs)
    s22 = sum(y * y for _, y in xs)
    b1, b2 = sum(x for x, _ in xs), sum(y for _, y in xs)
    det = s11 * s22 - s12 * s12
    inv_eff, per_row = (b1 * s22 - b2 * s12) / det, (s11 * b2 - s12 * b1) / det
    if inv_eff <= 0 or per_row < 0:  # fall back to bandwidth only
        inv_eff, per_row = b1 / s11, 0.0
    results = []
    print(
        f"copy bandwidth {copy_bw / 1e9:.1f} GB/s; fitted lookup efficiency {1 / inv_eff:.3f} of copy, "
        f"{per_row * 1e9:.1f} ns per row"
    )
    print(
        f"{'rows':>10} {'dim':>4} {'pool':>4} {'batch':>6} {'measured ms':>12} "
        f"{'predicted ms':>13} {'error':>7}"
    )
    for (rows, dim, pooling, batch), m, r in zip(shapes, measured, raw, strict=True):  # noqa: B007
        pred = r * inv_eff + per_row * batch * pooling
        err = pred / m - 1
        results.append(
            {
                "rows": rows,
                "dim": dim,
                "pooling": pooling,
                "batch": batch,
                "measured_ms": m * 1e3,
                "predicted_ms": pred * 1e3,
                "error": err,
            }
        )
        print(
            f"{rows:>10} {dim:>4} {pooling:>4} {batch:>6} {m * 1e3:>12.3f} {pred * 1e3:>13.3f} {err:>+7.1%}"
        )
    worst = max(abs(r["error"]) for r in results)
    print(f"worst |error| {worst:.1%} (goal 15%)")
    write_json_atomic(
        args.output,
        {
            "copy_bw_bytes_per_s": copy_bw,
            "bw_efficiency": 1 / inv_eff,
            "per_row_s": per_row,
            "threads": torch.get_num_threads(),
            "shapes": results,
            "worst_error": worst,
        },
    )
    print(f"wrote {args.output}")
    return results


if __name__ == "__main__":
    main()
