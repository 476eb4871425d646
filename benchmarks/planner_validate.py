"""Validate the planner's lookup-time model against the CPU embedding kernel the trainer runs.

Measures one training step (forward + backward with the fused optimizer update) of FBGEMM's TBE on
CPU, the kernel torchrec's sharded EmbeddingBagCollection uses there, for a few table shapes
(rows, dim, pooling, batch). Calibrates the CPU DeviceSpec on a fit set and reports the error on a
hold-out set. Two empirical constants are fitted, by least squares on relative error:

- the lookup bandwidth (bytes/s) the kernel reaches: the DeviceSpec's `memory_bw_bytes_per_s` with
  the kernel's `bw_efficiency` folded in;
- a fixed cost per looked-up row (`per_row_s`): each id is a dependent random DRAM access whose
  latency, not bandwidth, dominates for narrow rows.

Timings are medians over interleaved repeats (one step of every shape per round) after warm-up, on
one thread, so a shared machine's noise spreads over all shapes alike. Goal: within 15% on hold-out.

    PYTHONPATH=. python benchmarks/planner_validate.py [--quick] [--output FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from anyrec.backends.dispatch import FBGEMM_EMBEDDING, KernelProfile
from anyrec.backends.hardware import EmbeddingCost
from anyrec.backends.specs import get_sku
from anyrec.planner.estimators import lookup_time_s
from anyrec.planner.report import write_json_atomic
from anyrec.planner.types import Placement, TableSpec, Topology

OPTIMIZER = "adagrad"  # full Adagrad: TBE's EXACT_ADAGRAD, fp32 state as wide as the row
# (rows, dim, pooling factor, batch): every table is larger than the last-level cache, so lookups go
# to DRAM as the planner's bandwidth model assumes.
FIT = [
    (500_000, 128, 20, 1024),
    (2_000_000, 32, 20, 2048),
    (1_000_000, 64, 5, 4096),
]
HOLD_OUT = [
    (500_000, 128, 5, 2048),
    (2_000_000, 32, 40, 1024),
    (1_000_000, 64, 10, 2048),
]


def _tbe_step(rows: int, dim: int, pooling: int, batch: int):
    """A closure running one TBE training step (forward, backward, fused Adagrad) on fresh random ids."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ADAGRAD,
        learning_rate=0.01,
    )
    gen = torch.Generator().manual_seed(rows + dim + pooling)
    ids = [torch.randint(0, rows, (batch * pooling,), generator=gen) for _ in range(4)]
    offsets = torch.arange(0, batch * pooling + 1, pooling)
    grad = torch.ones(batch, dim)
    state = {"i": 0}

    def step() -> float:
        i = state["i"] = (state["i"] + 1) % len(ids)
        start = time.perf_counter()
        out = tbe(ids[i], offsets)
        out.backward(grad)
        return time.perf_counter() - start

    return step


def measure(shapes: list[tuple[int, int, int, int]], repeats: int, warmup: int = 3) -> list[float]:
    """Median seconds per training step for each shape, interleaving the shapes round by round."""
    steps = [_tbe_step(*s) for s in shapes]
    for step in steps:
        for _ in range(warmup):
            step()
    times: list[list[float]] = [[] for _ in shapes]
    for _ in range(repeats):
        for i, step in enumerate(steps):
            times[i].append(step())
    return [statistics.median(t) for t in times]


def model_terms(shape: tuple[int, int, int, int]) -> tuple[float, float]:
    """(bytes the planner's model moves, rows looked up) for one training step of `shape`: the
    model's seconds at 1 byte/s and no per-row cost, and the per-row multiplier."""
    rows, dim, pooling, batch = shape
    unit = get_sku("cpu").replace(memory_bw_bytes_per_s=1.0)
    topo = Topology(unit, 1, 1, "cpu")
    table = TableSpec("t", rows, dim, float(pooling), ["f"])
    fwd, bwd = lookup_time_s(
        batch * pooling, batch, dim, table, Placement.HBM, topo, OPTIMIZER,
        EmbeddingCost.builtin(FBGEMM_EMBEDDING),
        profile=KernelProfile(1.0, 64, source="ideal: full DRAM bandwidth, cache-line reads")
    )
    return fwd + bwd, 3.0 * batch * pooling  # the model charges the per-row cost once forward, twice backward


def fit(bytes_: list[float], ids: list[float], measured: list[float]) -> tuple[float, float]:
    """(bandwidth bytes/s, seconds per row) minimising sum((bytes / bw + ids * c) / m - 1)^2."""
    xs = [(b / m, n / m) for b, n, m in zip(bytes_, ids, measured, strict=True)]
    s11 = sum(x * x for x, _ in xs)
    s12 = sum(x * y for x, y in xs)
    s22 = sum(y * y for _, y in xs)
    b1, b2 = sum(x for x, _ in xs), sum(y for _, y in xs)
    det = s11 * s22 - s12 * s12
    inv_bw, per_row = (b1 * s22 - b2 * s12) / det, (s11 * b2 - s12 * b1) / det
    if inv_bw <= 0 or per_row < 0:  # not identifiable on this fit set: bandwidth only
        inv_bw, per_row = b1 / s11, 0.0
    return 1.0 / inv_bw, per_row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, few repeats (tests)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output", default="planner_validation.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    fit_shapes, hold_shapes = FIT, HOLD_OUT
    repeats = args.repeats
    if args.quick:
        fit_shapes = [(r // 20, d, p, b // 4) for r, d, p, b in FIT]
        hold_shapes = [(r // 20, d, p, b // 4) for r, d, p, b in HOLD_OUT]
        repeats = 3
    shapes = fit_shapes + hold_shapes
    measured = measure(shapes, repeats)
    terms = [model_terms(s) for s in shapes]
    n_fit = len(fit_shapes)
    bw, per_row = fit([b for b, _ in terms[:n_fit]], [n for _, n in terms[:n_fit]], measured[:n_fit])
    results = []
    print(
        f"TBE CPU training step ({OPTIMIZER}), {args.threads} thread(s), median of {repeats}; "
        f"fitted (empirical): lookup bandwidth {bw / 1e9:.2f} GB/s, {per_row * 1e9:.1f} ns per row"
    )
    head = (
        f"{'set':<8} {'rows':>10} {'dim':>4} {'pool':>4} {'batch':>6} {'measured ms':>12} "
        f"{'predicted ms':>13} {'error':>7}"
    )
    print(head)
    print("-" * len(head))
    for i, (shape, m, (b, n)) in enumerate(zip(shapes, measured, terms, strict=True)):
        pred = b / bw + n * per_row
        err = pred / m - 1
        kind = "fit" if i < n_fit else "hold-out"
        rows, dim, pooling, batch = shape
        results.append(
            {
                "set": kind,
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
            f"{kind:<8} {rows:>10} {dim:>4} {pooling:>4} {batch:>6} {m * 1e3:>12.3f} {pred * 1e3:>13.3f} "
            f"{err:>+7.1%}"
        )
    worst_fit = max(abs(r["error"]) for r in results if r["set"] == "fit")
    worst_hold = max(abs(r["error"]) for r in results if r["set"] == "hold-out")
    print(f"worst |error|: fit {worst_fit:.1%}, hold-out {worst_hold:.1%} (goal 15%)")
    write_json_atomic(
        args.output,
        {
            "kernel": "fbgemm TBE CPU (SplitTableBatchedEmbeddingBagsCodegen, EXACT_ADAGRAD)",
            "optimizer": OPTIMIZER,
            "threads": args.threads,
            "repeats": repeats,
            "calibrated": {"lookup_bw_bytes_per_s": bw, "per_row_s": per_row, "kind": "empirical"},
            "shapes": results,
            "worst_error_fit": worst_fit,
            "worst_error_hold_out": worst_hold,
        },
    )
    print(f"wrote {args.output}")
    return results


if __name__ == "__main__":
    main()
