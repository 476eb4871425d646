"""Plan the same inputs with anyrec's CoDesignPlanner and torchrec's EmbeddingShardingPlanner.

For each workload: planning time of each, and each plan's predicted step time under both cost
models (anyrec's analytical model and torchrec's shard estimators, rated as torchrec does: the
slowest rank's sum of shard perf). Both planners get the same topology numbers.

    PYTHONPATH=. python benchmarks/planner.py                 # DLRMv2 + 1,000 synthetic tables
    PYTHONPATH=. python benchmarks/planner.py --small         # DLRMv2 + 50 tables (for tests)

torchrec's default proposers take minutes at 500+ tables, so the synthetic workload runs torchrec
with its UniformProposer only unless --torchrec-proposers default is given.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from anyrec.backends.dispatch import FBGEMM_EMBEDDING
from anyrec.backends.specs import get_sku
from anyrec.planner.evaluate import evaluate_assignment
from anyrec.planner.planner import CoDesignPlanner, make_workload
from anyrec.planner.report import write_json_atomic
from anyrec.planner.torchrec_plan import from_sharding_plan, meta_ebc
from anyrec.planner.types import Placement, TableSpec, Topology
from anyrec.planner.workloads import DLRMV2_DENSE_PARAMS, dlrmv2_tables, synthetic_tables

TR_KERNEL = dict(FBGEMM_EMBEDDING.compute_kernels)  # placement -> torchrec compute kernel


def _torchrec_setup(tables: list[TableSpec], topo: Topology, batch: int, optimizer: str):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.planner.types import Topology as TrTopology

    dev = topo.device
    per_ms = 1e-3  # torchrec bandwidths are bytes per millisecond
    tr_topo = TrTopology(
        world_size=topo.world_size,
        local_world_size=topo.local_world_size,
        compute_device="cuda",
        hbm_cap=topo.hbm_bytes_per_rank,
        ddr_cap=topo.ddr_bytes_per_rank,
        hbm_mem_bw=dev.memory_bw_bytes_per_s * per_ms,
        ddr_mem_bw=(dev.host_memory_bw_bytes_per_s or dev.h2d_bw_bytes_per_s) * per_ms,
        hbm_to_ddr_mem_bw=dev.h2d_bw_bytes_per_s * per_ms,
        intra_host_bw=dev.scale_up_bw_bytes_per_s * per_ms,
        inter_host_bw=dev.scale_out_bw_bytes_per_s * per_ms,
    )
    constraints = {
        t.name: ParameterConstraints(pooling_factors=[t.pooling_factor / t.num_features] * t.num_features)
        for t in tables
    }
    module = meta_ebc(tables)
    opt_cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad}
    if optimizer == "rowwise_adagrad":
        from torchrec.optim import RowWiseAdagrad

        opt_cls["rowwise_adagrad"] = RowWiseAdagrad
    for p in module.parameters():
        p._optimizer_classes = [opt_cls[optimizer]]  # what torchrec's storage estimator reads
    return tr_topo, constraints, module, [EmbeddingBagCollectionSharder()]


def torchrec_options(assignment, tables: list[TableSpec], tr_topo, constraints, module, sharders, batch: int):
    """torchrec's enumerated and estimated options for costing `assignment`.

    torchrec enumerates one column-wise split per table, of `min_partition` columns (default 128, so
    none for dim-128 tables); a plan's k-way column-wise tables get `min_partition = dim / k` here, so
    torchrec's own estimators cost the shards the plan has instead of a whole table on one rank.
    """
    import dataclasses

    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator as TrEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator as TrPerf
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator as TrStorage

    dims = {t.name: t.embedding_dim for t in tables}
    cons = dict(constraints)
    for name, (st, _, ranks) in assignment.items():
        if st == "column_wise" and ranks:
            cons[name] = dataclasses.replace(cons[name], min_partition=dims[name] // len(ranks))
    enumerator = TrEnumerator(
        topology=tr_topo,
        batch_size=batch,
        constraints=cons,
        estimator=[TrPerf(tr_topo, cons), TrStorage(tr_topo, cons)],
    )
    return enumerator.enumerate(module, sharders)


def torchrec_cost(assignment, tr_options, world_size: int, local: int) -> float | None:
    """Step ms of a plan (table -> (sharding, placement, ranks)) under torchrec's estimators."""
    by_table: dict[str, list] = {}
    for o in tr_options:
        by_table.setdefault(o.name, []).append(o)
    perfs = [0.0] * world_size
    for name, (st, placement, ranks) in assignment.items():
        kernel = "dense" if st == "data_parallel" else TR_KERNEL[placement]
        cands = [o for o in by_table.get(name, []) if o.sharding_type == st and o.compute_kernel == kernel]
        if not cands:
            cands = [o for o in by_table.get(name, []) if o.sharding_type == st]
        if not cands:
            return None
        if st == "column_wise":
            cands.sort(key=lambda o: abs(len(o.shards) - len(ranks)))
        o = cands[0]
        if st in ("table_wise", "column_wise"):
            placed = [ranks[i % len(ranks)] for i in range(len(o.shards))]
        elif st == "table_row_wise":
            host = ranks[0] // local
            placed = [host * local + i for i in range(len(o.shards))]
        else:
            placed = list(range(len(o.shards)))
        for s, r in zip(o.shards, placed, strict=True):
            perfs[r] += s.perf.total
    return max(perfs)


def run_workload(name, tables, sku, world_size, batch, optimizer, dense_params, proposers, repeats=5):
    """Plan one workload with both planners and cost each plan under both models."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.proposers import UniformProposer

    topo = Topology(get_sku(sku), world_size)
    planner = CoDesignPlanner()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ours = planner.plan(tables, topo, batch, optimizer, dense_params)
        times.append(time.perf_counter() - start)
    ours_assign = {n: (o.sharding.value, o.placement.value, o.ranks) for n, o in ours.tables.items()}

    tr_topo, constraints, module, sharders = _torchrec_setup(tables, topo, batch, optimizer)
    kwargs = {"proposer": UniformProposer()} if proposers == "uniform" else {}
    tr_planner = EmbeddingShardingPlanner(
        topology=tr_topo, batch_size=batch, constraints=constraints, debug=False, **kwargs
    )
    start = time.perf_counter()
    try:
        tr_plan = tr_planner.plan(module, sharders)
        tr_error = None
    except Exception as e:  # torchrec raises PlannerError subclasses when nothing fits
        tr_plan, tr_error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    tr_time = time.perf_counter() - start

    wl = make_workload(tables, batch, optimizer, dense_params)
    local = topo.local_world_size

    def tr_cost(assign):
        opts = torchrec_options(assign, tables, tr_topo, constraints, module, sharders, batch)
        return torchrec_cost(assign, opts, world_size, local)

    row = {
        "workload": name,
        "tables": len(tables),
        "hardware": f"{world_size} x {topo.device.name}",
        "batch_size_per_rank": batch,
        "optimizer": optimizer,
        "torchrec_proposers": proposers,
        "anyrec_plan_s": statistics.median(times),
        "anyrec_plan_s_max": max(times),
        "anyrec_step_ms_anyrec_model": ours.predicted_step_s * 1e3,
        "anyrec_step_ms_torchrec_model": tr_cost(ours_assign),
        "anyrec_tables_off_hbm": sum(o.placement != Placement.HBM for o in ours.tables.values()),
        "torchrec_plan_s": tr_time,
        "torchrec_error": tr_error,
        "torchrec_step_ms_anyrec_model": None,
        "torchrec_step_ms_torchrec_model": None,
    }
    if tr_plan is not None:
        tr_assign = from_sharding_plan(tr_plan)
        row["torchrec_step_ms_anyrec_model"] = evaluate_assignment(tr_assign, topo, wl).predicted_step_s * 1e3
        row["torchrec_step_ms_torchrec_model"] = tr_cost(tr_assign)
        # Tables the two plans shard or place differently (rank choices aside), first 20.
        differ = [n for n in ours_assign if ours_assign[n][:2] != tuple(tr_assign[n][:2])]
        row["tables_sharded_differently"] = {
            n: {"anyrec": "/".join(ours_assign[n][:2]), "torchrec": "/".join(tr_assign[n][:2])}
            for n in differ[:20]
        }
        row["tables_sharded_differently_count"] = len(differ)
    _judge(row)
    return row


# Where the two cost models disagree, and which is physically right (see the notes in the JSON).
MODEL_NOTES = [
    "backward: torchrec charges 2x forward for every optimizer (the row-wise Adagrad convention); anyrec "
    "reads and writes each touched row and its optimizer state, 4x the forward row bytes for full Adagrad "
    "(fp32 state as wide as the row), so anyrec weighs lookup-heavy tables about twice as much",
    "kernel bandwidth: torchrec assumes the fused kernel reaches 100% of HBM bandwidth, anyrec an "
    "empirical 55% (FBGEMM TBE), so anyrec's compute:comms ratio is about 2x torchrec's",
    "row-wise input dist: torchrec charges every rank the table's global ids; each rank only sends its "
    "local batch's ids (anyrec)",
    "data-parallel: both charge the dense kernel and a dense optimizer pass over the whole table",
    "column-wise: torchrec's enumerator only splits into >= 128 columns; plans with narrower pieces are "
    "costed with torchrec's estimator at min_partition = dim / pieces",
    "narrow shards: torchrec multiplies compute by an empirical block-usage penalty (1.15x under 128 "
    "columns, 1.75x under 64); anyrec charges reads in 32-byte sectors and no further penalty (FBGEMM's "
    "forward packs several narrow rows per warp). On DLRMv2 this alone decides t_cat_20 (40 M rows, 100 "
    "ids per sample): anyrec splits it column-wise into 4 pieces of dim 32, torchrec row-wise over all 8 "
    "ranks. Without the penalty torchrec's own model rates the 4 pieces cheaper (about 2.4 vs 3.6 ms "
    "summed over ranks); anyrec rates row-wise 12% more total work (8.13 vs 7.26 ms: every rank writes "
    "and reduce-scatters partial sums for the whole global batch). Kept as is: the penalty is unmeasured "
    "for current TBE; timing benchmarks/tbe.py at dims 32/64/128 on the GPU would settle it",
    "column-wise input dist: every column piece receives all of the table's ids (anyrec charges the "
    "all-to-all); torchrec charges only the output all-to-all",
    "secondary objective: among plans within 0.5% of its best predicted step time anyrec takes the least "
    "total work (then comms) over all ranks; on DLRMv2 it replicates the tiny tables (as torchrec's plan "
    "does), which lowers total work in both models but adds a little to the slowest rank in torchrec's",
]


def _judge(row: dict) -> None:
    """Ratios of anyrec's plan to torchrec's under each model (<= 1: at least as good) and a verdict."""
    for model in ("anyrec", "torchrec"):
        a, t = row[f"anyrec_step_ms_{model}_model"], row[f"torchrec_step_ms_{model}_model"]
        row[f"ratio_{model}_model"] = a / t if a and t else None
    ra, rt = row["ratio_anyrec_model"], row["ratio_torchrec_model"]
    row["at_least_as_good_under_both"] = ra is not None and rt is not None and ra <= 1.0 and rt <= 1.0
    if row["at_least_as_good_under_both"]:
        row["notes"] = "anyrec's plan is at least as good under both cost models"
    elif ra is None or rt is None:
        row["notes"] = "torchrec produced no plan to compare: " + str(row["torchrec_error"])
    else:
        worse = [m for m, r in (("anyrec", ra), ("torchrec", rt)) if r > 1.0]
        row["notes"] = (
            f"anyrec's plan is {max(ra, rt) - 1:.1%} slower under {' and '.join(worse)}'s model: the models "
            "disagree on the terms in model_notes; anyrec optimises its own (physically derived) model"
        )


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="DLRMv2 and 50 synthetic tables (quick)")
    ap.add_argument("--tables", type=int, default=1000, help="synthetic table count")
    ap.add_argument("--sku", default="h200")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8192, help="batch size per rank")
    ap.add_argument("--optimizer", default="adagrad")
    ap.add_argument(
        "--torchrec-proposers",
        choices=("default", "uniform"),
        default=None,
        help="for the synthetic workload (default: uniform; DLRMv2 always uses torchrec's defaults)",
    )
    ap.add_argument("--output", default="planner_benchmark.json")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    n = 50 if args.small else args.tables
    synth_prop = args.torchrec_proposers or "uniform"
    rows = [
        run_workload(
            "dlrmv2",
            dlrmv2_tables(),
            args.sku,
            args.world_size,
            args.batch,
            args.optimizer,
            DLRMV2_DENSE_PARAMS,
            "default",
        ),
        run_workload(
            f"synthetic_{n}",
            synthetic_tables(n, seed=0),
            args.sku,
            args.world_size,
            args.batch,
            args.optimizer,
            0,
            synth_prop,
        ),
    ]
    head = (
        f"{'workload':<15} {'hardware':<10} {'planner':<8} {'plan s':>8} {'step ms (anyrec model)':>23} "
        f"{'step ms (torchrec model)':>25}  note"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['workload']:<15} {r['hardware']:<10} {'anyrec':<8} {r['anyrec_plan_s']:>8.3f} "
            f"{_fmt(r['anyrec_step_ms_anyrec_model']):>23} {_fmt(r['anyrec_step_ms_torchrec_model']):>25}  "
            f"{r['anyrec_tables_off_hbm']} tables off HBM"
        )
        print(
            f"{'':<15} {'':<10} {'torchrec':<8} {r['torchrec_plan_s']:>8.3f} "
            f"{_fmt(r['torchrec_step_ms_anyrec_model']):>23} "
            f"{_fmt(r['torchrec_step_ms_torchrec_model']):>25}  "
            f"proposers: {r['torchrec_proposers']}{'; ' + r['torchrec_error'] if r['torchrec_error'] else ''}"
        )
    for r in rows:
        print(
            f"{r['workload']}: anyrec/torchrec step ratio {_fmt(r['ratio_anyrec_model'])} (anyrec model), "
            f"{_fmt(r['ratio_torchrec_model'])} (torchrec model); {r['notes']}"
        )
    write_json_atomic(args.output, {"rows": rows, "model_notes": MODEL_NOTES})
    print(f"wrote {args.output}")
    return rows


if __name__ == "__main__":
    main()
