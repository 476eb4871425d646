"""Explanations: why each table got its sharding and placement, the model and job knobs that would
change the plan on this hardware (co-design advice), and the one-line explanation of an infeasible plan."""

from __future__ import annotations

import dataclasses
import math

from anyrec.backends.specs import SKUS, DeviceSpec
from anyrec.planner.estimators import (
    ID_BYTES,
    OUTPUT_BYTES,
    DenseEstimator,
    cache_hit_rate,
    simd_lanes,
    simd_utilisation,
    state_bytes,
    usable_caps,
)
from anyrec.planner.evaluate import evaluate_at_batch
from anyrec.planner.types import (
    Placement,
    PlanResult,
    RankCost,
    ShardingType,
    Storage,
    TableSpec,
    Topology,
    Workload,
)

GB = 1e9
MB = 1e6
MAX_DEVICES = 4096


def size_text(nbytes: float) -> str:
    """Bytes as GB with one decimal, or as MB where that would round to 0.0 GB."""
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.05 * GB else f"{nbytes / MB:.1f} MB"


def _accelerators() -> list[DeviceSpec]:
    return [s for k, s in SKUS.items() if k != "cpu"]


def table_bytes(t: TableSpec, wl: Workload) -> int:
    """Weights plus optimizer state of a whole table (state as the workload's embedding Impl lays it out)."""
    return t.weight_bytes + state_bytes(wl.optimizer, t.num_rows, t.embedding_dim, wl.options.embedding.impl)


def _buffers_per_rank(wl: Workload) -> float:
    """Approximate per-rank HBM for sharded ids/outputs: the global batch's buffers spread over ranks. A
    sequence table's batches in flight hold its ids only: the rows it outputs are one batch's, in the dense
    part's storage where they are alive at the peak (DenseEstimator)."""
    b, depth = wl.batch_size_per_rank, wl.options.pipeline_depth
    per = 0.0
    for t in wl.tables:
        ids = b * (t.pooling_factor + t.bags_per_sample) * ID_BYTES
        out = 0.0 if t.sequence else b * t.bags_per_sample * t.embedding_dim * OUTPUT_BYTES
        per += depth * (ids + out) + out
    return per


def _topology_for(device: DeviceSpec, world_size: int, like: Topology) -> Topology:
    local = min(world_size, like.local_world_size)
    while world_size % local:
        local -= 1
    return Topology(device, world_size, local, like.compute_device)


def _free_for_tables(wl: Workload, device: DeviceSpec, world_size: int, like: Topology) -> float:
    """Bytes of a rank's usable HBM left for tables once the dense part, its activations and the batch
    buffers have theirs (negative: they alone do not fit)."""
    topo = _topology_for(device, world_size, like)
    base = DenseEstimator().estimate(topo, wl)
    return usable_caps(topo, wl).hbm_bytes - base.storage.hbm_bytes - _buffers_per_rank(wl)


def fits_in_hbm(wl: Workload, device: DeviceSpec, world_size: int, like: Topology) -> bool:
    """Memory-model check that every table can live in HBM on `world_size` x `device` (aggregate
    bytes, and the largest table split row-wise over all ranks)."""
    free = _free_for_tables(wl, device, world_size, like)
    if free <= 0:
        return False
    sizes = [table_bytes(t, wl) for t in wl.tables]
    return sum(sizes) <= free * world_size and max(sizes) / world_size <= free


def min_devices_in_hbm(wl: Workload, device: DeviceSpec, like: Topology) -> int | None:
    """Fewest devices (1 to 8, then whole 8-device hosts) that hold every table in HBM; None if none do."""
    counts = [*range(1, 9), *range(16, MAX_DEVICES + 1, 8)]
    return next((w for w in counts if fits_in_hbm(wl, device, w, like)), None)


def _max_dim_in_hbm(wl: Workload, topo: Topology) -> int | None:
    """Largest embedding dim (multiple of 8, all tables) at which every table fits in HBM here."""
    for d in range(max(t.embedding_dim for t in wl.tables) - 8, 7, -8):
        tables = [dataclasses.replace(t, embedding_dim=min(t.embedding_dim, d)) for t in wl.tables]
        if fits_in_hbm(dataclasses.replace(wl, tables=tables), topo.device, topo.world_size, topo):
            return d
    return None


def explain_infeasible(wl: Workload, topo: Topology, caps: Storage, base: RankCost) -> str:
    """One line: what does not fit, bytes needed and available, and what would fit."""
    w, dev = topo.world_size, topo.device
    where = f"{w} x {dev.name}"
    free = caps.hbm_bytes - base.storage.hbm_bytes
    reserve = (f"{size_text(topo.hbm_bytes_per_rank)} less {wl.options.reserve_fraction:.0%} and "
               f"{size_text(dev.runtime_reserved_bytes)} for the runtime")
    allowed = wl.options.allowed_placements
    hbm_only = allowed == (Placement.HBM,)
    sizes = {t.name: table_bytes(t, wl) for t in wl.tables}
    biggest = max(sizes, key=sizes.get)
    if free <= 0:
        # per rank, whatever the tables: no placement of them, number of devices or table dim makes room
        return (f"cannot plan {len(wl.tables)} tables on {where}: the dense model, its optimizer, its "
                f"activations and the batch buffers at {wl.batch_size_per_rank:,} samples per rank need "
                f"{size_text(base.storage.hbm_bytes)} per rank but a rank has {size_text(caps.hbm_bytes)} "
                f"usable ({reserve}): {size_text(-free)} short before any table")
    if sizes[biggest] / w > free and hbm_only:
        what = (f"table {biggest} needs {size_text(sizes[biggest] / w)} per rank even split row-wise over "
                f"{w} rank(s); a rank has {size_text(free)} free ({reserve}, less "
                f"{size_text(base.storage.hbm_bytes)} dense and buffers)")
    else:
        total = sum(sizes.values())
        host = "" if hbm_only else (f"; in host memory they need {size_text(total / w)} per rank, "
                                    f"{size_text(caps.ddr_bytes)} DDR available")
        what = (f"the {len(wl.tables)} tables ({wl.optimizer}) need {size_text(total)} for weights and "
                f"optimizer state; {w} rank(s) have {size_text(free * w)} of HBM free "
                f"({size_text(free)} each: {reserve}, less {size_text(base.storage.hbm_bytes)} dense and "
                f"buffers){host}")
    fixes = []
    n_same = min_devices_in_hbm(wl, dev, topo)
    if n_same is not None and n_same > w:
        fixes.append(f"{n_same} x {dev.name} in HBM")
    if Placement.UVM_CACHING not in allowed and topo.compute_device != "cpu":
        fixes.append("allowing uvm_caching placement (allowed_placements)")
    for other in _accelerators():
        if other.name == dev.name or other.memory_bytes <= dev.memory_bytes:
            continue
        n = min_devices_in_hbm(wl, other, topo)
        if n is not None and n <= max(w, 1) * 2:
            fixes.append(f"{n} x {other.name} ({size_text(other.memory_bytes)})")
    d = _max_dim_in_hbm(wl, topo)
    if d is not None:
        fixes.append(f"embedding dim <= {d} on {where}")
    tail = "; would fit: " + ", ".join(fixes) if fixes else ""
    return f"cannot plan {len(wl.tables)} tables on {where}: {what}{tail}"


def alternatives_s(plan: PlanResult, name: str) -> dict[ShardingType, float]:
    """Least predicted seconds (summed over shards) per sharding type for table `name` at its placement."""
    placement = plan.tables[name].placement
    alts: dict[ShardingType, float] = {}
    for o in plan.options_by_table.get(name, []):
        if o.placement == placement:
            alts[o.sharding] = min(alts.get(o.sharding, math.inf), o.total_perf_s)
    return alts


def explain_tables(plan: PlanResult) -> dict[str, str]:
    """Why each table got its sharding and placement, from the alternatives the search had."""
    topo = plan.topology
    free = plan.caps.hbm_bytes - plan.base.storage.hbm_bytes
    balanced = plan.lower_bound_s - plan.base.perf.total_s
    out = {}
    for name, opt in plan.tables.items():
        alts = alternatives_s(plan, name)
        work = opt.total_perf_s
        tw = alts.get(ShardingType.TABLE_WISE)
        st = opt.sharding
        if st == ShardingType.DATA_PARALLEL:
            mb = opt.table.weight_bytes / 1e6
            why = f"replicated: local lookups + all-reduce of {mb:.2f} MB gradient is cheapest"
        elif st == ShardingType.TABLE_WISE:
            rw = alts.get(ShardingType.ROW_WISE)
            cmp = f" (row_wise {rw * 1e3:.3f} ms)" if rw is not None else ""
            why = f"whole table on one rank: least total time {work * 1e3:.3f} ms{cmp}"
        else:
            if tw is None:
                reason = f"a whole copy does not fit one rank's {free / GB:.1f} GB free HBM"
            elif tw > balanced:
                reason = (f"a whole copy ({tw * 1e3:.3f} ms) exceeds the balanced rank load "
                          f"({balanced * 1e3:.3f} ms)")
            else:
                reason = f"balances ranks ({work * 1e3:.3f} ms total vs table_wise {tw * 1e3:.3f} ms)"
            if st == ShardingType.COLUMN_WISE:
                why = f"{opt.num_shards} column pieces of dim {opt.shards[0].num_cols}: {reason}"
            elif st == ShardingType.ROW_WISE:
                why = f"rows over all {topo.world_size} ranks: {reason}"
            else:
                why = f"rows over host {opt.host}'s {topo.local_world_size} ranks (scale-up reduce): {reason}"
        if opt.placement == Placement.UVM_CACHING:
            why += (f"; UVM caching ({opt.cache_ratio:.0%} rows cached, predicted hit rate "
                    f"{cache_hit_rate(opt.cache_ratio):.0%}): HBM cannot hold every table")
        elif opt.placement == Placement.DDR:
            why += "; host DDR over the host link: HBM cannot hold it even cached"
        out[name] = why
    return out


def comms_crossover_batch(plan: PlanResult) -> tuple[int | None, str]:
    """Batch size per rank at which predicted comms overtake compute on the slowest rank, with the
    direction ("above" or "below"), using the costs' linearity in batch size."""
    b1, b2 = plan.workload.batch_size_per_rank, 2 * plan.workload.batch_size_per_rank
    p1, p2 = plan.rank_perf, evaluate_at_batch(plan, b2).rank_perf
    r = max(range(len(p1)), key=lambda i: p1[i].total_s)
    a_c = (p2[r].compute_s - p1[r].compute_s) / (b2 - b1)
    a_m = (p2[r].comms_s - p1[r].comms_s) / (b2 - b1)
    if math.isclose(a_m, a_c, rel_tol=1e-9):
        return None, ""
    cross = ((p1[r].compute_s - a_c * b1) - (p1[r].comms_s - a_m * b1)) / (a_m - a_c)
    if cross <= 0:
        return None, "always" if a_m > a_c else "never"
    return int(cross), ("above" if a_m > a_c else "below")


def co_design_advice(plan: PlanResult) -> list[str]:
    """Knobs that would change this plan: SIMD-misaligned dims, tables pushed out of HBM that another
    SKU holds, the batch size where comms dominate, the fewest devices per SKU that hold the model."""
    topo, wl = plan.topology, plan.workload
    dev = topo.device
    out: list[str] = []
    dims: dict[int, list[str]] = {}
    for name, opt in plan.tables.items():  # the table's dim, and its column pieces' dim
        for d in {opt.table.embedding_dim, opt.shards[0].num_cols}:
            dims.setdefault(d, []).append(name)
    for d, names in sorted(dims.items()):
        u = simd_utilisation(d, dev.simd_width)
        if u < 1.0:
            up = simd_lanes(d, dev.simd_width)
            ok = sorted({s.name for s in _accelerators() if simd_utilisation(d, s.simd_width) == 1.0})
            ex = ", ".join(names[:3]) + (f" +{len(names) - 3}" if len(names) > 3 else "")
            out.append(f"dim {d} ({ex}) fills {u:.0%} of the {dev.simd_width}-wide SIMD on {dev.name}: "
                       f"lookups cost as much as dim {up}; use dim {up} for free capacity or a multiple of "
                       f"{dev.simd_width}" + (f" (no waste on {', '.join(ok)})" if ok else ""))
    off = [n for n, o in plan.tables.items() if o.placement != Placement.HBM]
    if off:
        w = topo.world_size
        better = [f"{other.name} ({size_text(other.memory_bytes)})" for other in _accelerators()
                  if other.name != dev.name and fits_in_hbm(wl, other, w, topo)]
        fits = f"; all fit in HBM on {w} x " + " or ".join(better) if better else "; no other SKU holds them"
        out.append(f"{len(off)} table(s) leave HBM on {w} x {dev.name} ({size_text(dev.memory_bytes)}): "
                   + ", ".join(off[:5]) + fits)
    try:
        cross, direction = comms_crossover_batch(plan)
    except ValueError:
        cross, direction = None, ""
    b = wl.batch_size_per_rank
    if direction == "always":
        out.append(f"comms dominate compute on the slowest rank at every batch size (now {b}/rank)")
    elif cross is not None:
        now = "now" if (b > cross if direction == "above" else b < cross) else "not yet"
        out.append(f"comms overtake compute on the slowest rank {direction} batch {cross}/rank "
                   f"({now}: batch {b}/rank)")
    counts, short = [], []
    for other in _accelerators():
        n = min_devices_in_hbm(wl, other, topo)
        if n is not None:
            counts.append(f"{other.name} {n}")
        elif _free_for_tables(wl, other, MAX_DEVICES, topo) <= 0:  # more devices leave a rank as full
            short.append(other.name)
        else:
            counts.append(f"{other.name} >{MAX_DEVICES}")
    line = "fewest devices holding every table in HBM: " + (", ".join(counts) if counts else "none")
    if short:
        line += (f"; on {', '.join(short)} no device count does at {b:,} samples per rank: the dense part, "
                 f"its activations and the batch buffers alone fill a rank (a smaller batch per rank or "
                 f"activation recompute)")
    out.append(line)
    return out
