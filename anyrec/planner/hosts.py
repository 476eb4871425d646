"""What the hosts do to a plan: how many tables go table-row-wise, and why, from the plan's own costs.

Table-row-wise keeps a table's rows on one host: the lookups split over its `local_world_size`
ranks, the pooled outputs are reduced over the scale-up links, and only that host's share of the
output crosses hosts over scale-out. Row-wise spreads the rows over every rank and reduces across
hosts; table-wise keeps one whole copy on one rank.
"""

from __future__ import annotations

from anyrec.planner.types import ShardingType

GB = 1e9
TWRW = ShardingType.TABLE_ROW_WISE


def _best_s(plan, name: str, sharding: ShardingType) -> float | None:
    """Least predicted step time (summed over shards) of `sharding` for one table at its placement."""
    chosen = plan.tables[name]
    times = [o.total_perf_s for o in plan.options_by_table.get(name, [])
             if o.sharding == sharding and o.placement == chosen.placement]
    return min(times) if times else None


def table_row_wise_count(plan) -> str:
    """'k of n': the plan's tables that are table-row-wise."""
    return f"{sum(o.sharding == TWRW for o in plan.tables.values())} of {len(plan.tables)}"


def host_summary(plan) -> str:
    """One paragraph: the hosts, the links between them, and the table-row-wise count with its reason."""
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
    per_host = [0] * topo.num_hosts
    for name in twrw:
        per_host[plan.tables[name].host] += 1
    balanced = plan.lower_bound_s - plan.base.perf.total_s  # the mean rank load the search aims at
    work = rw_work = 0.0
    beats_rw = too_big = too_slow = 0
    for name in twrw:
        own = plan.tables[name].total_perf_s
        rw, tw = _best_s(plan, name, ShardingType.ROW_WISE), _best_s(plan, name, ShardingType.TABLE_WISE)
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
    return (f"{head}; table_row_wise: {len(twrw)} of {n} tables (per host {'/'.join(map(str, per_host))}): "
            + ("; ".join(why) or "the least predicted step time"))
