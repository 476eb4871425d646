"""A plan's presentation, as free functions of a PlanResult: the readable report, the side-by-side
SKU comparison, the `plan.output` JSON (written atomically) and the plan picture."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

from anyrec.io_checks import atomic_write
from anyrec.planner.advice import GB, alternatives_s, co_design_advice, size_text
from anyrec.planner.estimators import DENSE_EFFICIENCY, shard_data_bytes
from anyrec.planner.memory import predict_memory
from anyrec.planner.sequence import (
    REFERENCE_SAMPLES,
    activation_bytes,
    attention_efficiency,
    dense_bytes_per_sample,
    hstu_time_s,
    job_activation_dtypes,
    job_hstu_rates,
    lengths_text,
    stu_flops,
)
from anyrec.planner.twod import GroupChoice
from anyrec.planner.types import Placement, PlanResult, ShardingType

TWRW = ShardingType.TABLE_ROW_WISE


def _ranks(ranks: list[int]) -> str:
    rs = sorted(set(ranks))
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


def table_row_wise_count(plan: PlanResult) -> str:
    """'k of n': the plan's tables that are table-row-wise."""
    return f"{sum(o.sharding == TWRW for o in plan.tables.values())} of {len(plan.tables)}"


def host_summary(plan: PlanResult) -> str:
    """One paragraph: the hosts, the links between them, and the table-row-wise count with its reason.

    Table-row-wise keeps a table's rows on one host: the lookups split over its ranks, the pooled outputs
    are reduced over scale-up, and only that host's share of the output crosses hosts over scale-out
    (row-wise spreads the rows over every rank and reduces across hosts).
    """
    topo = plan.topology
    dev = topo.device
    head = (f"hosts: {topo.num_hosts} x {topo.local_world_size} ranks; scale-up "
            f"{dev.scale_up_bw_bytes_per_s / GB:.0f} GB/s, scale-out "
            f"{dev.scale_out_bw_bytes_per_s / GB:.0f} GB/s per device (one way)")
    twrw = [n for n, o in plan.tables.items() if o.sharding == TWRW]
    n = len(plan.tables)
    if topo.num_hosts == 1:
        return f"{head}; table_row_wise: 0 of {n} tables (it needs more than one host)"
    if plan.workload.options.allowed_shardings == (TWRW,):
        return f"{head}; table_row_wise: {len(twrw)} of {n} tables, forced (planner.sharding=table_row_wise)"
    if not twrw:
        return f"{head}; table_row_wise: 0 of {n} tables (another sharding is cheaper for every table)"
    per_host = Counter(plan.tables[name].host for name in twrw)
    balanced = plan.lower_bound_s - plan.base.perf.total_s  # the mean rank load the search aims at
    work = rw_work = 0.0
    beats_rw = too_big = too_slow = 0
    for name in twrw:
        own = plan.tables[name].total_perf_s
        alts = alternatives_s(plan, name)
        rw, tw = alts.get(ShardingType.ROW_WISE), alts.get(ShardingType.TABLE_WISE)
        if rw is not None and own < rw:
            beats_rw += 1
            work, rw_work = work + own, rw_work + rw
        if tw is None:
            too_big += 1
        elif tw > balanced:
            too_slow += 1
    why = []
    if beats_rw:
        why.append(f"{beats_rw} do less work than row_wise over all {topo.world_size} ranks "
                   f"({work * 1e3:.3f} vs {rw_work * 1e3:.3f} ms: the reduce stays on scale-up, only "
                   f"1/{topo.local_world_size} of the pooled output crosses hosts)")
    if too_slow or too_big:
        why.append(f"as a whole copy on one rank {too_slow} would exceed the balanced rank load "
                   f"({balanced * 1e3:.3f} ms) and {too_big} would not fit")
    hosts = "/".join(str(per_host[h]) for h in range(topo.num_hosts))
    return (f"{head}; table_row_wise: {len(twrw)} of {n} tables (per host {hosts}): "
            + ("; ".join(why) or "the least predicted step time"))


def hstu_lines(plan: PlanResult) -> list[str]:
    """For an HSTU model: the predicted samples/s and time to REFERENCE_SAMPLES, and the STU layers' step
    time by kind and their activations (anyrec.planner.sequence); nothing for other models."""
    topo, wl = plan.topology, plan.workload
    opts = wl.options
    if opts.hstu is None:
        return []
    rate = samples_per_s(plan)
    dev = topo.device
    half = activation_bytes(topo, opts.dense_dtype) == 2
    other = max(0.0, opts.dense_flops_per_sample - stu_flops(opts.hstu).total)
    ab = job_activation_dtypes(topo, opts.dense_dtype)
    measured = job_hstu_rates(opts, topo)
    t = hstu_time_s(opts.hstu, other, wl.batch_size_per_rank, dev, ab,
                    dev.dense_efficiency or DENSE_EFFICIENCY, opts.attention_impl, opts.activation_recompute,
                    measured)
    peak = dev.peak_bf16_flops if half else dev.peak_fp32_flops
    if measured is not None:  # the job's kernels measured at its shapes
        gemm = f" (measured {measured.gemm_flops_per_s / 1e9:,.1f} GFLOP/s)"
        attn = (f"measured {measured.flops_per_s / 1e9:,.1f} GFLOP/s, {measured.flops_per_s / peak:.0%} "
                f"of peak")
        elementwise = f" (measured {measured.elementwise_bw_bytes_per_s / 1e9:,.1f} GB/s)"
    else:
        gemm, elementwise = "", ""
        attn = f"{attention_efficiency(opts.attention_impl):.0%} of peak, assumed"
    act = wl.batch_size_per_rank * dense_bytes_per_sample(opts, topo, wl.batch_size_per_rank)[1]
    recompute = f", recompute {t.recompute_s * 1e3:.1f} ms" if opts.activation_recompute else ""
    if t.selective_recompute_s > 0:
        recompute += f", selective recompute {t.selective_recompute_s * 1e3:.1f} ms"
    return [
        f"predicted {rate:,.0f} samples/s ({topo.world_size} x {wl.batch_size_per_rank} per step); "
        f"{REFERENCE_SAMPLES / 1e6:.1f} M samples (the DLRMv4 reference's 8-GPU run) in "
        f"{duration_text(REFERENCE_SAMPLES / rate)}",
        f"HSTU ({opts.hstu.num_layers} layers, {lengths_text(opts.hstu)}, "
        f"{'bf16' if half else 'fp32'}): GEMMs {t.gemm_s * 1e3:.1f} ms{gemm}, "
        f"attention {t.attention_s * 1e3:.1f} ms ({opts.attention_impl}, {attn}), "
        f"elementwise {t.elementwise_s * 1e3:.1f} ms{elementwise}{recompute}; activations {size_text(act)} "
        f"per rank"
        + (" with activation recompute (not implemented in the trainer)"
           if opts.activation_recompute else ""),
    ]


def samples_per_s(plan: PlanResult) -> float:
    """Global samples per second the plan's predicted step gives."""
    return plan.topology.world_size * plan.workload.batch_size_per_rank / plan.predicted_step_s


def duration_text(seconds: float) -> str:
    """`2h39m` style."""
    minutes = round(seconds / 60)
    return f"{minutes // 60}h{minutes % 60:02d}m"


def format_report(plan: PlanResult, advice: bool = True, max_tables: int = 60) -> str:
    """Per rank: memory used/cap, predicted compute and comms; per table: sharding, placement, ranks, why."""
    topo, wl = plan.topology, plan.workload
    lb, step = plan.lower_bound_s, plan.predicted_step_s
    gap = (step / lb - 1) if lb > 0 else 0.0
    lines = [
        f"anyrec plan: {len(wl.tables)} tables on {topo.world_size} x {topo.device.name} "
        f"({topo.num_hosts} host(s) x {topo.local_world_size}), batch {wl.batch_size_per_rank}/rank, "
        f"{wl.optimizer}, kernel {wl.options.embedding.name}, compute device {topo.compute_device}",
        f"predicted step {step * 1e3:.3f} ms (slowest rank); lower bound {lb * 1e3:.3f} ms, gap {gap:.1%}; "
        f"solver {plan.solver}, planned in {plan.plan_time_s:.3f} s",
        host_summary(plan),
        *hstu_lines(plan),
        "",
        f"{'rank':>4}  {'HBM used / cap':>21}  {'peak':>9}  {'DDR':>9}  {'compute ms':>10}  "
        f"{'comms ms':>9}  {'total ms':>9}",
    ]
    peaks = predict_memory(plan)
    lines += [f"{r:>4}  {size_text(st.hbm_bytes):>9} / {size_text(topo.hbm_bytes_per_rank):>9}  "
              f"{size_text(peak.allocated_bytes):>9}  {size_text(st.ddr_bytes):>9}  "
              f"{pf.compute_s * 1e3:>10.3f}  {pf.comms_s * 1e3:>9.3f}  {pf.total_s * 1e3:>9.3f}"
              for r, (st, peak, pf) in enumerate(zip(plan.rank_storage, peaks, plan.rank_perf, strict=False))]
    lines += [
        f"(peak: predicted peak device memory allocated in a step, data source not included; HBM cap less "
        f"reserve: {size_text(plan.caps.hbm_bytes)} usable; dense model and local buffers "
        f"{size_text(plan.base.storage.hbm_bytes)} and {plan.base.perf.total_s * 1e3:.3f} ms per rank)",
        "",
        f"{'table':<14} {'rows':>10} {'dim':>4} {'pool':>5} {'sharding':<16} {'placement':<11} "
        f"{'kernel':<17} {'ranks':<9} why",
    ]
    items = list(plan.tables.items())
    if len(items) > max_tables:
        items = sorted(items, key=lambda kv: -kv[1].total_perf_s)[:max_tables]
    for name, opt in items:
        sh = opt.sharding.value + (f"x{opt.num_shards}" if opt.sharding == ShardingType.COLUMN_WISE else "")
        t = opt.table
        lines.append(f"{name:<14} {t.num_rows:>10} {t.embedding_dim:>4} {t.pooling_factor:>5.0f} "
                     f"{sh:<16} {opt.placement.value:<11} {opt.compute_kernel:<17} {_ranks(opt.ranks):<9} "
                     f"{plan.reasons.get(name, '')}")
    if len(plan.tables) > max_tables:
        lines.append(f"... {len(plan.tables) - max_tables} cheaper tables not shown")
    lines += [f"note: {note}" for note in plan.notes]
    if advice:
        lines += ["", "co-design advice:", *(f"  - {a}" for a in co_design_advice(plan))]
    return "\n".join(lines)


def plan_json(plan: PlanResult) -> dict:
    """The plan as the JSON schema of `plan.output`: per rank memory and time, per table sharding,
    placement, torchrec compute kernel and ranks."""
    ranks = [
        {"rank": r, "hbm_bytes": int(st.hbm_bytes), "hbm_cap_bytes": int(plan.topology.hbm_bytes_per_rank),
         "ddr_bytes": int(st.ddr_bytes), "predicted_ms": pf.total_s * 1e3}
        for r, (st, pf) in enumerate(zip(plan.rank_storage, plan.rank_perf, strict=True))
    ]
    tables = [
        {"name": name, "sharding": opt.sharding.value, "placement": opt.placement.value,
         "kernel": opt.compute_kernel, "ranks": sorted(set(opt.ranks))}
        for name, opt in plan.tables.items()
    ]
    return {"hardware": plan.topology.device.name, "world_size": plan.topology.world_size,
            "predicted_step_ms": plan.predicted_step_s * 1e3, "ranks": ranks, "tables": tables}


def write_json_atomic(path: str, data: dict) -> None:
    """Write JSON whole or not at all (never a half-written file)."""
    with atomic_write(path) as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _capacity_text(nbytes: float) -> str:
    """A device's capacity: whole GB from 1 GB up, else as size_text writes it."""
    return f"{nbytes / GB:.0f} GB" if nbytes >= GB else size_text(nbytes)


def _compare_summary(p: PlanResult) -> dict[str, str]:
    slowest = max(p.rank_perf, key=lambda x: x.total_s)
    placed = Counter(o.placement for o in p.tables.values())
    return {
        "hardware": f"{p.topology.world_size} x {p.topology.device.name}",
        "HBM per device": _capacity_text(p.topology.hbm_bytes_per_rank),
        "HBM bandwidth": f"{p.topology.device.memory_bw_bytes_per_s / 1e12:.2f} TB/s",
        "max HBM used": size_text(max(s.hbm_bytes for s in p.rank_storage)),
        "tables in HBM / UVM / DDR": " / ".join(str(placed[k]) for k in Placement),
        "table_row_wise tables": table_row_wise_count(p),
        "predicted step": f"{p.predicted_step_s * 1e3:.3f} ms",
        "slowest rank compute": f"{slowest.compute_s * 1e3:.3f} ms",
        "slowest rank comms": f"{slowest.comms_s * 1e3:.3f} ms",
    }


def format_compare(a: PlanResult, b: PlanResult) -> str:
    """Two plans of the same workload on two SKUs side by side, and what memory density changes."""
    sa, sb = _compare_summary(a), _compare_summary(b)
    w = max(len(k) for k in sa) + 2
    rows = [f"{k:<{w}} {sa[k]:>22} {sb[k]:>22}" for k in sa]
    da, db = a.topology.device, b.topology.device
    rows += [
        "",
        f"memory density: {da.name} {_capacity_text(da.memory_bytes)} vs {db.name} "
        f"{_capacity_text(db.memory_bytes)} "
        f"= {da.memory_bytes / db.memory_bytes:.2f}x; predicted step ratio "
        f"{a.predicted_step_s / b.predicted_step_s:.2f}x",
    ]
    changed = [n for n, o in a.tables.items() if (o.sharding, o.placement) != (b.tables[n].sharding,
                                                                                b.tables[n].placement)]
    rows += [f"  {n}: {a.tables[n].label()} on {da.name} -> {b.tables[n].label()} on {db.name}"
             for n in changed[:20]]
    if len(changed) > 20:
        rows.append(f"  ... {len(changed) - 20} more tables change")
    if not changed:
        rows.append("  every table gets the same sharding and placement on both")
    return "\n".join(rows)


def memory_breakdown(plan: PlanResult) -> dict[str, list[float]]:
    """Per-rank HBM bytes by kind: weights, optimizer state, caches, buffers, dense + local buffers."""
    w = plan.topology.world_size
    names = ("dense + local buffers", "weights", "optimizer state", "uvm cache", "sharded buffers")
    kinds = {k: [0.0] * w for k in names}
    kinds["dense + local buffers"] = [plan.base.storage.hbm_bytes] * w
    for opt in plan.tables.values():
        for s in opt.shards:
            wt, stb, held, _ = shard_data_bytes(opt, s, plan.topology, plan.workload)
            if opt.placement == Placement.HBM or plan.topology.compute_device == "cpu":
                kinds["weights"][s.rank] += wt
                kinds["optimizer state"][s.rank] += stb
            elif opt.placement == Placement.UVM_CACHING:
                kinds["uvm cache"][s.rank] += held
            kinds["sharded buffers"][s.rank] += s.storage.hbm_bytes - held
    return kinds


def plot_plan(plan: PlanResult, path: str, compare: PlanResult | None = None) -> None:
    """PNG: per-rank HBM stacked by kind against the cap; per-rank predicted compute + comms.
    With `compare`, the second SKU's plan is drawn beside the first."""
    import matplotlib  # optional dependency, needed only for plan.plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = [plan] if compare is None else [plan, compare]
    fig, axes = plt.subplots(2, len(plans), figsize=(6 * len(plans) + 2, 7), squeeze=False)
    colors = ["#8c8c8c", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]
    for col, p in enumerate(plans):
        ax_m, ax_t = axes[0][col], axes[1][col]
        kinds = memory_breakdown(p)
        ranks = list(range(p.topology.world_size))
        bottom = [0.0] * len(ranks)
        for (kind, vals), c in zip(kinds.items(), colors, strict=False):
            ax_m.bar(ranks, [v / GB for v in vals], bottom=bottom, label=kind, color=c)
            bottom = [b + v / GB for b, v in zip(bottom, vals, strict=False)]
        ax_m.axhline(p.topology.hbm_bytes_per_rank / GB, color="red", linestyle="--", label="HBM cap")
        ax_m.axhline(p.caps.hbm_bytes / GB, color="red", linestyle=":", label="cap less reserve")
        ax_m.set(title=f"{p.topology.world_size} x {p.topology.device.name}: HBM per rank", ylabel="GB",
                 ylim=(0, max(max(bottom), p.topology.hbm_bytes_per_rank / GB) * 1.08))
        comp = [x.compute_s * 1e3 for x in p.rank_perf]
        comm = [x.comms_s * 1e3 for x in p.rank_perf]
        ax_t.bar(ranks, comp, label="compute", color="#1f77b4")
        ax_t.bar(ranks, comm, bottom=comp, label="comms", color="#d62728")
        ax_t.set(title=f"predicted step {p.predicted_step_s * 1e3:.3f} ms (slowest rank)", xlabel="rank",
                 ylabel="ms", ylim=(0, max(c + m for c, m in zip(comp, comm, strict=True)) * 1.08))
    # One legend per row, outside the plot area to the right, so it never covers a bar.
    for ax in (axes[0][-1], axes[1][-1]):
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format=Path(path).suffix.lstrip(".").lower() or "png", dpi=100)
    plt.close(fig)
    with atomic_write(path, "wb") as f:  # never through a link planted at `path`
        f.write(png.getvalue())


def format_group_choice(choice: GroupChoice, width: int = 40) -> str:
    """The sharding group sizes and layouts weighed: per size and layout its replicas, predicted step (and
    2D's share of it: replica averaging, the dense all-reduce's extra reach), peak memory per rank or why
    it does not fit, an ASCII bar of the step, which link figures priced its collectives, and the choice."""
    fitting = [c for c in choice.candidates if c.plan is not None]
    longest = max(c.step_s for c in fitting)
    lines = [f"{'group':>6} {'layout':>10} {'replicas':>8} {'step ms':>9} {'sync ms':>8} {'dense+ ms':>9} "
             f"{'peak/rank':>9}  predicted step"]
    for c in choice.candidates:
        head = f"{c.group_size:>6} {c.layout:>10} {c.replicas:>8}"
        if c.plan is None:
            lines.append(f"{head} {'-':>9} {'-':>8} {'-':>9} {'-':>9}  does not fit: {c.infeasible}")
            continue
        peak = max(p.allocated_bytes for p in predict_memory(c.plan))
        bar = "#" * max(1, round(width * c.step_s / longest))
        mark = "  <- chosen" if c is choice.best else ""
        lines.append(f"{head} {c.step_s * 1e3:>9.3f} {c.sync_s * 1e3:>8.3f} {c.dense_extra_s * 1e3:>9.3f} "
                     f"{size_text(peak):>9}  {bar}{mark}")
    lines += [f"{c.label:>6}: {c.figures}" for c in choice.candidates if c.figures]
    best = choice.best
    lines.append(f"sharding group size {choice.chosen} ({best.replicas} replica(s), {best.layout} layout, "
                 f"use_inter_host_allreduce={choice.use_inter_host_allreduce}): predicted step "
                 f"{best.step_s * 1e3:.3f} ms, the lowest of the {len(fitting)} size(s) and layout(s) that "
                 f"fit among {len(choice.candidates)} weighed")
    return "\n".join(lines)
