"""Measured, not modelled: train each accuracy workload on 2 ranks under anyrec's plan and under the
plan of torchrec's EmbeddingShardingPlanner (its default proposers and estimators, same world size,
same per-rank memory, same sharders), and compare the measured seconds per step.

    python benchmarks/plan_vs_torchrec.py [--small] [--hardware cal.yaml] [--output out.json]

Each workload is one job, `torchrun benchmarks/plan_vs_torchrec.py --worker ...`: every rank builds
two anyrec Trainers (the same seed, data and initial weights), one sharded by each planner's plan, and
trains them in alternating segments of `--segment-steps` steps (a b, b a, a b, ...); each segment's
`measured_step_ms` is the trainer's own (slowest rank, after the segment's warm-up steps). A shared
host's load drifts by +-10-15 % between runs of the same plan, so two plans timed in separate runs
differ by that much whatever they are; segments run back to back see the same host. The ratio is the
median over rounds of anyrec's segment / torchrec's segment of the same round, with its quartiles and
a distribution-free 95 % interval; the verdict is "faster" or "slower" only where that interval
excludes 1, else "equal" (two runs of one plan measure "equal").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

try:  # python -m benchmarks.plan_vs_torchrec, or imported by a test
    from benchmarks.planner_accuracy import SMALL, WORKLOADS, _expand, _torchrun, error_line
except ImportError:  # python benchmarks/plan_vs_torchrec.py: this folder is first on sys.path
    from planner_accuracy import SMALL, WORKLOADS, _expand, _torchrun, error_line


def torchrec_plan(cfg):
    """torchrec's EmbeddingShardingPlanner plan for the trainer's model (module paths as the trainer's)."""
    import torch
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
    from torchrec.distributed.planner.types import Topology as TrTopology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from anyrec.backends import get_backend, resolve_hardware
    from anyrec.models.dlrm import build_model
    from anyrec.planner.estimators import usable_caps
    from anyrec.planner.types import PlanOptions, Topology, Workload
    from anyrec.trainer.optim import embedding_optimizer
    from anyrec.trainer.planning import sharders
    from anyrec.trainer.trainer import DLRMTrain

    backend = get_backend(cfg.backend.name)
    kernel = backend.select_kernels(cfg.backend)["embedding"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    hw = cfg.hardware
    device = resolve_hardware(hw.sku, hw.spec, backend, hw.measurements).spec
    meta = torch.device("meta")
    model = build_model(cfg.model, meta, ebc_device=meta)
    opt_cls, opt_kwargs = embedding_optimizer(cfg.optim)
    apply_optimizer_in_backward(opt_cls, model.sparse_arch.parameters(), opt_kwargs)
    compute = "cpu" if backend.device_type == "cpu" else "cuda"
    # The same per-rank memory as anyrec's planner: the device's memory less anyrec's reserve (its
    # fraction and fixed bytes), with torchrec's own percentage reservation off (it still subtracts its
    # dense-model and input estimates, as anyrec subtracts the dense model and buffers). torchrec counts
    # a CPU job's tables against `ddr_cap` (the device memory is host memory there), so on a CPU both
    # caps are that budget. Given the whole device (or all of the host's DDR on a CPU) and its default
    # 15 %, torchrec may place tables that anyrec's budget keeps off a rank.
    options = PlanOptions(reserve_fraction=cfg.planner.memory_reserve_fraction)
    usable = usable_caps(Topology(device, world), Workload([], cfg.data.batch_size, cfg.optim.name,
                                                           options=options)).hbm_bytes
    topo = TrTopology(world_size=world, local_world_size=world, compute_device=compute,
                      hbm_cap=usable,
                      ddr_cap=usable if compute == "cpu" else device.host_memory_bytes or device.memory_bytes)
    planner = EmbeddingShardingPlanner(topology=topo, batch_size=cfg.data.batch_size,
                                       storage_reservation=HeuristicalStorageReservation(percentage=0.0))
    # Deterministic on every rank from the same inputs: no collective needed.
    return planner.plan(DLRMTrain(model), sharders(kernel))


def worker(overrides: list[str], segments: int, segment_steps: int) -> None:
    """One rank: compose the config, build one Trainer per planner's plan (the same seed, data and
    initial weights), then train them in alternating segments and print both series."""
    import copy

    from anyrec import _hydra
    from anyrec.planner.planned import ParallelLayout, PlannedJob
    from anyrec.trainer.trainer import Trainer

    cfg = _hydra.compose_job(overrides)
    plans = {"anyrec": None, "torchrec": torchrec_plan(cfg)}
    trainers: dict[str, Trainer] = {}
    series: dict[str, list[float | None]] = {name: [] for name in plans}
    summaries: dict[str, dict] = {}
    failed = True
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        for name, plan in plans.items():  # torchrec's plan as the job, 1D over the world
            planned = PlannedJob(plan, ParallelLayout.one_d(world, local)) if plan is not None else None
            trainers[name] = Trainer(copy.deepcopy(cfg), planned)
        for labels in segment_order(tuple(trainers), segments):
            for name in labels:
                t = trainers[name]
                t.steps = t.step + segment_steps  # train() runs on to the new end
                summaries[name] = t.train()
                series[name].append(summaries[name]["measured_step_ms"])
        for name, t in trainers.items():
            summaries[name]["plan"] = describe_plan(t.planned.plan)
        is_main = trainers["anyrec"].dist.is_main
        failed = False
    finally:
        # Both sharded models go before the process group does: the last close tears it down.
        built = list(trainers.values())
        for i, t in enumerate(built):
            t.close(failed=failed, keep_group=i < len(built) - 1)
    if is_main:
        print(json.dumps({"segments_ms": series, "summaries": summaries}), flush=True)


def segment_order(labels: tuple[str, str], segments: int) -> list[tuple[str, str]]:
    """Per round, the order the two trainers run their segment: a b, b a, a b, ... An even count of
    rounds gives each order to each trainer equally often (the second runner of a round follows the
    other trainer's segment, the first follows its own: a measurable effect on this host)."""
    if segments % 2:
        raise ValueError(f"--segments must be even (each order equally often), got {segments}")
    return [labels if k % 2 == 0 else labels[::-1] for k in range(segments)]


def median_interval(sorted_values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of `sorted_values` (order statistics,
    binomial coverage >= `level`); None when there are too few values for that coverage (n < 6 at 95 %)."""
    n = len(sorted_values)
    tail, j = 0.0, 0
    while j < n and tail + math.comb(n, j) / 2**n <= (1.0 - level) / 2:
        tail += math.comb(n, j) / 2**n
        j += 1
    if j == 0:
        return None
    return sorted_values[j - 1], sorted_values[n - j]


def verdict(interval: tuple[float, float] | None) -> str:
    """anyrec's plan "faster" / "slower" than torchrec's when the ratio's interval excludes 1, else
    "equal" (within the measurement's resolution); "-" without an interval."""
    if interval is None:
        return "-"
    low, high = interval
    return "faster" if high < 1.0 else "slower" if low > 1.0 else "equal"


def paired_ratio(a_ms: list[float | None], t_ms: list[float | None]) -> dict[str, object]:
    """anyrec / torchrec per round (segments run back to back), their median with quartiles and a 95 %
    interval, the verdict, and each side's median segment over the same rounds: a shared host's drift
    moves both sides of a round alike. Rounds where either side has no time are left out."""
    paired = [(a, t) for a, t in zip(a_ms, t_ms, strict=True) if a and t]
    pairs = sorted(a / t for a, t in paired)
    if not pairs:
        return {"ratio": None, "ratio_q1": None, "ratio_q3": None, "ratio_ci95": None, "verdict": "-",
                "anyrec_ms": None, "torchrec_ms": None}
    q = statistics.quantiles(pairs, n=4, method="inclusive") if len(pairs) > 1 else [pairs[0]] * 3
    ci = median_interval(pairs)
    return {"ratio": statistics.median(pairs), "ratio_q1": q[0], "ratio_q3": q[2],
            "ratio_ci95": list(ci) if ci else None, "verdict": verdict(ci),
            "anyrec_ms": statistics.median(a for a, _ in paired),
            "torchrec_ms": statistics.median(t for _, t in paired)}


def describe_plan(plan) -> str:
    """`table: sharding_type [ranks]` per table of a torchrec ShardingPlan, sorted by table ("" without
    a sharded model)."""
    if plan is None:
        return ""
    out = []
    for module_plan in plan.plan.values():
        for table, ps in sorted(module_plan.items()):
            out.append(f"{table}: {ps.sharding_type} {ps.ranks}")
    return "; ".join(out)


def train(name: str, hardware: str, segments: int, segment_steps: int, batch: int, cwd: Path,
          timeout_s: float) -> dict:
    """One 2-rank job of workload `name`: both plans, `segments` alternating segments each; the
    worker's output or {"error": ...}."""
    overrides = [*_expand(WORKLOADS[name]), f"hardware.sku={hardware}", f"trainer.steps={segment_steps}",
                 f"data.batch_size={batch}", "trainer.eval_steps=0", "trainer.progress=false"]
    args = [str(Path(__file__).resolve()), "--worker", f"--segments={segments}",
            f"--segment-steps={segment_steps}", "--", *overrides]
    try:
        proc = _torchrun(args, cwd, timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": error_line(proc.stderr)}
    return json.loads(lines[-1])


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def row_of(name: str, got: dict) -> dict:
    """The table row of workload `name` from its job's output."""
    row: dict = {"workload": name, "error_msg": got.get("error")}
    if "error" in got:
        return {**row, "ratio": None, "anyrec_ms": None, "torchrec_ms": None, "verdict": "-"}
    seg = got["segments_ms"]
    row.update(paired_ratio(seg["anyrec"], seg["torchrec"]))
    row["anyrec_segments_ms"], row["torchrec_segments_ms"] = seg["anyrec"], seg["torchrec"]
    summaries = got["summaries"]
    row["same_plan"] = summaries["anyrec"]["plan"] == summaries["torchrec"]["plan"]
    row["anyrec_predicted_ms"] = summaries["anyrec"]["predicted_step_ms"]
    for planner, s in summaries.items():
        row[f"{planner}_plan"] = s["plan"]
        row[f"{planner}_final_loss"] = s["final_loss"]
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="one workload, a few steps (for tests)")
    ap.add_argument("--hardware", default="cpu", help="what anyrec plans for: a SKU or a calibration file")
    ap.add_argument("--only", nargs="+", choices=tuple(WORKLOADS), help="run only these workloads")
    ap.add_argument("--segments", type=int, default=None, help="segments per plan, alternating (even)")
    ap.add_argument("--segment-steps", type=int, default=None,
                    help="steps per segment (its first fifth, 1 to 10, is warm-up and not timed)")
    ap.add_argument("--output", type=Path, default=Path("plan_vs_torchrec.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    segments = args.segments if args.segments is not None else (2 if args.small else 12)
    segment_steps = args.segment_steps if args.segment_steps is not None else (5 if args.small else 25)
    if segments < 2 or segments % 2 or segment_steps < 2:
        ap.error("--segments must be even and >= 2 (each order equally often), --segment-steps >= 2 "
                 "(one warm-up step, one timed)")
    if args.worker:
        worker(args.overrides, segments, segment_steps)
        return []
    batch = 64 if args.small else 256
    # The jobs run in a scratch directory: a calibration file named relative to here must still be found.
    hardware = str(Path(args.hardware).resolve()) if Path(args.hardware).is_file() else args.hardware
    # Two trainers' set-up, then every segment of both at up to ~0.2 s a step on this class of host.
    timeout_s = 300.0 + 2 * segments * segment_steps * 0.2
    rows = []
    with tempfile.TemporaryDirectory(prefix="anyrec_pvt_") as tmp:
        for name in args.only or (SMALL if args.small else WORKLOADS):
            rows.append(row_of(name, train(name, hardware, segments, segment_steps, batch, Path(tmp),
                                           timeout_s)))
    print(f"{'workload':<20} {'anyrec ms':>10} {'torchrec ms':>12} {'anyrec/torchrec':>16} "
          f"{'quartiles':>13} {'95% interval':>13} {'verdict':>8}  plans")
    for r in rows:
        quart = "-" if r["ratio"] is None else f"{r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}"
        ci = "-" if not r.get("ratio_ci95") else "{:.3f}-{:.3f}".format(*r["ratio_ci95"])
        said = r["error_msg"] or ("same" if r.get("same_plan") else "different")
        print(f"{r['workload']:<20} {_fmt(r['anyrec_ms']):>10} {_fmt(r['torchrec_ms']):>12} "
              f"{_fmt(r['ratio'], '.3f'):>16} {quart:>13} {ci:>13} {r['verdict']:>8}  {said}")
    args.output.write_text(json.dumps({"rows": rows, "segments": segments, "segment_steps": segment_steps,
                                       "batch_size_per_rank": batch, "hardware": args.hardware}, indent=1))
    print(f"wrote {args.output}")
    return rows


if __name__ == "__main__":
    main()
