"""Placement proposals: keep every table in HBM when it fits; otherwise move the tables that lose the
least time per HBM byte freed to UVM caching, then to host DDR, until the demand fits."""

from __future__ import annotations

import heapq

from anyrec.planner.types import Placement, Proposer, ShardingOption, Storage, Topology, Workload

TIERS: tuple[Placement, ...] = (Placement.HBM, Placement.UVM_CACHING, Placement.DDR)
# Fractions of the total free HBM to aim for, loosest first: a tighter target leaves the partitioner
# more room for the per-rank bin packing when the loose one does not partition.
FILL_TARGETS: tuple[float, ...] = (1.0, 0.95, 0.9, 0.8, 0.65, 0.5, 0.25, 0.0)


def _tier_costs(opts: list[ShardingOption]) -> dict[Placement, tuple[float, float, float]]:
    """Per placement: (min total HBM bytes, min per-rank HBM bytes, min total seconds) over options."""
    out: dict[Placement, tuple[float, float, float]] = {}
    for o in opts:
        hbm = [s.storage.hbm_bytes for s in o.shards]
        cost = (float(sum(hbm)), float(max(hbm)), o.total_perf_s)
        prev = out.get(o.placement)
        out[o.placement] = cost if prev is None else tuple(map(min, prev, cost))
    return out


class EscalatingPlacementProposer(Proposer):
    """HBM -> UVM caching -> DDR, one table at a time in order of least time lost per byte freed."""

    def proposals(self, options: dict[str, list[ShardingOption]], topology: Topology, free: Storage,
                  workload: Workload) -> list[dict[str, tuple[Placement, ...]]]:
        costs = {name: _tier_costs(opts) for name, opts in options.items()}
        tiers = {name: [p for p in TIERS if p in c] for name, c in costs.items()}
        level = dict.fromkeys(options, 0)
        # A table whose smallest per-rank footprint exceeds one rank's free HBM must leave HBM.
        for name, c in costs.items():
            while level[name] < len(tiers[name]) - 1 and c[tiers[name][level[name]]][1] > free.hbm_bytes:
                level[name] += 1

        def penalty(name: str) -> tuple[float, str] | None:
            i = level[name]
            if i + 1 >= len(tiers[name]):
                return None
            a, b = costs[name][tiers[name][i]], costs[name][tiers[name][i + 1]]
            freed = a[0] - b[0]
            if freed <= 0:
                return None
            return (b[2] - a[2]) / freed, name

        heap = [p for p in (penalty(n) for n in options) if p is not None]
        heapq.heapify(heap)
        total_free = float(free.hbm_bytes) * topology.world_size
        current = sum(costs[n][tiers[n][level[n]]][0] for n in options)  # HBM bytes the placements need
        out: list[dict[str, tuple[Placement, ...]]] = []
        for fill in FILL_TARGETS:
            while current > fill * total_free and heap:
                _, name = heapq.heappop(heap)
                before = costs[name][tiers[name][level[name]]][0]
                level[name] += 1
                current += costs[name][tiers[name][level[name]]][0] - before
                p = penalty(name)
                if p is not None:
                    heapq.heappush(heap, p)
            proposal = {n: (tiers[n][level[n]],) for n in options}
            if not out or proposal != out[-1]:
                out.append(proposal)
            if not heap:
                break
        return out
