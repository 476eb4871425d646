"""The density claim, shown: two simulated devices identical except capacity (1.6 : 1, an MI350X's 288 GB
against a B200's 180 GB), and a workload whose tables fit whole only on the larger one. The co-design
planner plans both (the report side by side: which tables change sharding, the predicted steps), then
each plan trains on 2 simdev ranks holding exactly that capacity (`SIMDEV_MEMORY_BYTES`).

    python benchmarks/density.py [--small] [--steps N] [--output out.json]

The larger capacity is the smallest at which every table is planned whole (table-wise or replicated);
the smaller is 1 / 1.6 of it. Expected (docs/planning.md, "Memory density"): on the smaller device the
largest tables are split (row- or column-wise) or leave HBM, and the step is predicted slower by the
extra all-to-all and reduce-scatter traffic; both plans train without running out of memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

try:  # python -m benchmarks.density, or imported by a test
    from benchmarks.capacity_sweep import WORLD, install_simdev, run_job
except ImportError:  # python benchmarks/density.py: this folder is first on sys.path
    from capacity_sweep import WORLD, install_simdev, run_job

RATIO = 1.6
# One table far larger than the rest (fp32 weights and Adagrad state): whole, it needs a device of its
# own; split row- or column-wise over both ranks, half of it fits beside the rest on each.
WORKLOAD = ["model=dlrm_small", "model.embedding_dim=64", "model.table_rows=[3000000,100000,100000,100000]",
            "model.bottom_mlp=[128,64]", "data.batch_size=512"]
SMALL_WORKLOAD = ["model=dlrm_small", "model.embedding_dim=32",
                  "model.table_rows=[2000000,20000,20000,20000]", "model.bottom_mlp=[64,32]",
                  "data.batch_size=256"]


def plan_at(overrides: list[str], capacity: int):
    """anyrec's plan of the workload on WORLD simdev devices of `capacity` bytes (None: infeasible)."""
    from anyrec import _hydra, plan
    from anyrec.planner.types import InfeasiblePlanError

    cfg = _hydra.compose_job(["backend=simdev", *overrides, "trainer.eval_steps=0", "trainer.calibrate=never",
                              f"topology.world_size={WORLD}", f"+hardware.spec.memory_bytes={capacity}"])
    try:
        return plan.run(cfg, print_fn=lambda _: None)
    except InfeasiblePlanError:
        return None


def whole(result) -> bool:
    """Every table of the plan held whole by one rank (table-wise) or by all (data-parallel), in HBM."""
    return all(o.sharding.value in ("table_wise", "data_parallel") and o.placement.value == "hbm"
               for o in result.tables.values())


def smallest_whole_capacity(overrides: list[str], hi: int = 2**36) -> int:
    """The smallest capacity (to 0.5 %) at which the planner keeps every table whole."""
    lo = 1 << 20
    while hi - lo > max(lo // 200, 4096):
        mid = (lo + hi) // 2
        got = plan_at(overrides, mid)
        lo, hi = (lo, mid) if got is not None and whole(got) else (mid, hi)
    return hi


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a smaller workload, few steps (for tests)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per plan (default 8; 3 small)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per training job")
    ap.add_argument("--output", type=Path, help="write the result as JSON here")
    args = ap.parse_args(argv)
    overrides = SMALL_WORKLOAD if args.small else WORKLOAD
    steps = args.steps or (3 if args.small else 8)
    from anyrec.planner.report import format_compare, plan_json

    with tempfile.TemporaryDirectory(prefix="anyrec-density-") as tmp:
        simdev = install_simdev(Path(tmp) / "simdev")
        sys.path.insert(0, str(simdev))
        large = smallest_whole_capacity(overrides)
        small = int(large / RATIO)
        plans = {"large": plan_at(overrides, large), "small": plan_at(overrides, small)}
        if plans["small"] is None:
            raise SystemExit(f"density: no plan at {small} bytes per device; choose a larger workload")
        print(format_compare(plans["large"], plans["small"]))
        runs = {}
        for name, cap in (("large", large), ("small", small)):
            runs[name] = run_job("anyrec", overrides, cap, steps, simdev, Path(tmp), args.timeout)
            got = runs[name]
            print(f"{name}: {cap} bytes per device: {got['result']}"
                  f"{'' if got['result'] == 'ok' else ': ' + got.get('reason', '')}", flush=True)
    result = {"capacity_bytes": {"large": large, "small": small}, "ratio": large / small,
              "plans": {k: plan_json(p) for k, p in plans.items()},
              "whole": {k: whole(p) for k, p in plans.items()}, "runs": runs}
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
