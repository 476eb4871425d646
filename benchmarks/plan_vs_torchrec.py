"""Measured, not modelled: train each accuracy workload on 2 ranks under anyrec's plan and under the
plan of torchrec's EmbeddingShardingPlanner (its default proposers and estimators, same world size,
same per-rank memory, same sharders), and compare the measured seconds per step.

    python benchmarks/plan_vs_torchrec.py [--small] [--hardware cal.yaml] [--output out.json]

Each run is `torchrun benchmarks/plan_vs_torchrec.py --worker ...`, which trains through anyrec's
Trainer with the given plan and prints the trainer's JSON summary (`measured_step_ms`: slowest rank,
after warm-up). Timing on a shared host is noisy: the two plans of one workload run back to back,
`--repeats` times in alternating order (a t t a a t), and the median run of each is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from planner_accuracy import SMALL, WORKLOADS, _expand, alternating, median_run  # noqa: E402


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
    device = resolve_hardware(cfg.hardware.sku, cfg.hardware.spec, backend)
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


def worker(planner: str, overrides: list[str]) -> None:
    """One rank: compose the config, take the chosen planner's plan, train, print the summary."""
    from anyrec import _hydra
    from anyrec.trainer.trainer import Trainer

    cfg = _hydra.compose_job(overrides)
    plan = torchrec_plan(cfg) if planner == "torchrec" else None
    trainer = Trainer(cfg, plan=plan)
    try:
        summary = trainer.train()
        summary["plan"] = describe_plan(trainer.sharding_plan)
        is_main = trainer.dist.is_main
    finally:
        trainer.close()
    if is_main:
        print(json.dumps(summary), flush=True)


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


def train(name: str, planner: str, hardware: str, steps: int, batch: int, cwd: Path,
          timeout_s: float) -> dict:
    """One 2-rank run of workload `name` under `planner`'s plan; its summary or {"error": ...}."""
    overrides = [*_expand(WORKLOADS[name]), f"hardware.sku={hardware}", f"trainer.steps={steps}",
                 f"data.batch_size={batch}", "trainer.eval_steps=0", "trainer.progress=false"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).resolve()), "--worker", planner, "--", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(lines[-1])


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="two workloads, a few steps (for tests)")
    ap.add_argument("--hardware", default="cpu", help="what anyrec plans for: a SKU or a calibration file")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--only", nargs="+", choices=tuple(WORKLOADS), help="run only these workloads")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs per workload and planner, alternating; the median run is reported")
    ap.add_argument("--output", type=Path, default=Path("plan_vs_torchrec.json"))
    ap.add_argument("--worker", choices=("anyrec", "torchrec"), help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.overrides)
        return []
    steps = args.steps or (8 if args.small else 60)
    repeats = args.repeats or (1 if args.small else 3)
    batch = 64 if args.small else 256
    timeout_s = 300.0 if args.small else 900.0
    rows = []
    with tempfile.TemporaryDirectory(prefix="anyrec_pvt_") as tmp:
        for name in args.only or (SMALL if args.small else WORKLOADS):
            row: dict = {"workload": name}
            runs: dict[str, list[dict]] = {"anyrec": [], "torchrec": []}
            for planner in alternating(("anyrec", "torchrec"), repeats):
                runs[planner].append(train(name, planner, args.hardware, steps, batch, Path(tmp), timeout_s))
            for planner, got in runs.items():
                s = median_run(got)
                row[f"{planner}_measured_ms"] = s.get("measured_step_ms")
                row[f"{planner}_error_msg"] = s.get("error")
                row[f"{planner}_measured_ms_runs"] = [r.get("measured_step_ms") for r in got]
                row[f"{planner}_summary"] = s
            a, t = row["anyrec_measured_ms"], row["torchrec_measured_ms"]
            row["ratio"] = a / t if a and t else None
            rows.append(row)
    print(f"{'workload':<20} {'anyrec ms':>10} {'torchrec ms':>12} {'anyrec/torchrec':>16}")
    for r in rows:
        print(f"{r['workload']:<20} {_fmt(r['anyrec_measured_ms']):>10} "
              f"{_fmt(r['torchrec_measured_ms']):>12} "
              f"{_fmt(r['ratio'], '.3f'):>16}  {r['anyrec_error_msg'] or r['torchrec_error_msg'] or ''}")
    args.output.write_text(json.dumps({"rows": rows, "steps": steps, "batch_size_per_rank": batch,
                                       "repeats": repeats, "hardware": args.hardware}, indent=1))
    print(f"wrote {args.output}")
    return rows


if __name__ == "__main__":
    main()
