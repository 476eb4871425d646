"""What-if at scale: DLRMv2's predicted step against the 2D sharding group size, 64 to 4,096 ranks.

For each SKU, job size and averaging interval, the co-design model plans the 26 DLRMv2 tables for every
group size that divides the job (8 GPUs per host, the SKU table's scale-up and scale-out bandwidths),
prices 2D's averaging and the world's dense all-reduce (anyrec.planner.twod), and prints the sizes
weighed with the choice, then a summary table: the chosen group size, its predicted step and 1D's.

    PYTHONPATH=. python benchmarks/twod_whatif.py                      # B200 and MI350X, 64..4096
    PYTHONPATH=. python benchmarks/twod_whatif.py --skus b200 --ranks 64 256 --sync-every 1

Predictions only (no GPU ran them). The tables come from configs/model/dlrmv2.yaml with
planner defaults (anyrec-plan also sets the dense model's per-sample memory and interaction terms, so
its figures differ slightly).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from anyrec.backends.specs import get_sku
from anyrec.planner.planner import CoDesignPlanner
from anyrec.planner.report import format_group_choice, write_json_atomic
from anyrec.planner.twod import choose_group_size
from anyrec.planner.types import Topology
from anyrec.planner.workloads import DLRMV2_DENSE_PARAMS, dlrmv2_tables


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skus", nargs="+", default=["b200", "mi350x"])
    p.add_argument("--ranks", nargs="+", type=int, default=[64, 256, 1024, 4096])
    p.add_argument("--sync-every", nargs="+", type=int, default=[1, 100])
    p.add_argument("--batch", type=int, default=256, help="per rank")
    p.add_argument("--per-host", type=int, default=8)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    tables = dlrmv2_tables()

    def plan_for(topology: Topology):
        return CoDesignPlanner().plan(tables, topology, args.batch, "adagrad", DLRMV2_DENSE_PARAMS)

    rows = []
    for sku in args.skus:
        spec = get_sku(sku)
        for world in args.ranks:
            for every in args.sync_every:
                t0 = time.perf_counter()
                choice = choose_group_size(world, args.per_host, spec, None, plan_for, sync_every=every)
                print(f"== {world} x {spec.name}, replicas averaged every {every} step(s) "
                      f"({time.perf_counter() - t0:.1f} s to weigh)")
                print(format_group_choice(choice) + "\n")
                one_d = next(c for c in choice.candidates if c.group_size == world)
                rows.append({"sku": spec.name, "ranks": world, "sync_every": every, "chosen": choice.chosen,
                             "layout": choice.best.layout, "step_ms": choice.plan.predicted_step_s * 1e3,
                             "step_1d_ms": one_d.step_s * 1e3 if one_d.step_s is not None else None,
                             "curve_ms": {c.label: (c.step_s * 1e3 if c.step_s is not None else None)
                                          for c in choice.candidates}})
    print(f"{'SKU':<8} {'ranks':>6} {'sync every':>10} {'chosen G':>8} {'step ms':>9} {'1D ms':>9} "
          f"{'1D / chosen':>11}")
    for r in rows:
        ratio = f"{r['step_1d_ms'] / r['step_ms']:.2f}" if r["step_1d_ms"] else "-"
        one_d = f"{r['step_1d_ms']:.3f}" if r["step_1d_ms"] else "no fit"
        print(f"{r['sku']:<8} {r['ranks']:>6} {r['sync_every']:>10} {r['chosen']:>8} {r['step_ms']:>9.3f} "
              f"{one_d:>9} {ratio:>11}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.json, {"rows": rows, "batch_per_rank": args.batch, "per_host": args.per_host})


if __name__ == "__main__":
    main()
