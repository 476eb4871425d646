"""Cost a given assignment (e.g. a torchrec plan, or a plan at another batch size) under anyrec's model."""

from __future__ import annotations

import dataclasses

from anyrec.planner.enumerators import EmbeddingEnumerator
from anyrec.planner.estimators import DenseEstimator, sharding_group_time_s, usable_caps
from anyrec.planner.types import ALL_SHARDINGS, Enumerator, Placement, PlanResult, Topology, Workload


def evaluate_assignment(assignment: dict[str, tuple[str, str, list[int]]], topology: Topology,
                        workload: Workload, enumerator: Enumerator | None = None) -> PlanResult:
    """Cost a given plan (table -> (sharding, placement, ranks)) under anyrec's model, e.g. a torchrec
    plan. Column-wise takes as many shards as ranks listed; ranks are ignored for fixed-rank types."""
    enumerator = enumerator or EmbeddingEnumerator()
    wl = workload
    placements = {t.name: (Placement(assignment[t.name][1]),) for t in wl.tables}
    full = dataclasses.replace(wl.options, allowed_shardings=ALL_SHARDINGS, max_column_shards=1 << 30)
    options = enumerator.enumerate(topology, dataclasses.replace(wl, options=full), placements)
    chosen = {}
    for t in wl.tables:
        sharding, _, ranks = assignment[t.name]
        match = [o for o in options[t.name] if o.sharding.value == sharding]
        if sharding == "column_wise":
            match = [o for o in match if o.num_shards == len(ranks)] or match
        elif sharding == "table_row_wise":
            host = topology.host_of(ranks[0]) if ranks else 0
            match = [o for o in match if o.host == host] or match
        if not match:
            raise ValueError(f"table {t.name}: no {sharding} option on this topology")
        opt = match[0]
        shards = [dataclasses.replace(s) for s in opt.shards]
        if not opt.ranks_fixed:
            placed = ranks if len(ranks) == len(shards) else list(ranks) * len(shards)
            for s, r in zip(shards, placed, strict=False):
                s.rank = r
        chosen[t.name] = dataclasses.replace(opt, shards=shards)
    base = DenseEstimator().estimate(topology, wl)
    return PlanResult(chosen, topology, wl, base, usable_caps(topology, wl), "given",
                      options_by_table=options, group_s=sharding_group_time_s(topology))


def evaluate_at_batch(plan: PlanResult, batch_size_per_rank: int) -> PlanResult:
    """`plan`'s assignment costed at another batch size per rank."""
    wl = dataclasses.replace(plan.workload, batch_size_per_rank=batch_size_per_rank)
    assignment = {n: (o.sharding.value, o.placement.value, o.ranks) for n, o in plan.tables.items()}
    return evaluate_assignment(assignment, plan.topology, wl)
