"""The co-design planner: enumerate options, propose placements, partition, and explain the plan."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from dataclasses import dataclass, field

from anyrec.planner.enumerators import MIN_COLUMN_SHARD_DIM, EmbeddingEnumerator
from anyrec.planner.estimators import (
    DenseEstimator,
    check_optimizer,
    get_kernel,
    usable_caps,
)
from anyrec.planner.partitioners import ExhaustivePartitioner, GreedyPerfPartitioner
from anyrec.planner.proposers import EscalatingPlacementProposer
from anyrec.planner.types import (
    ALL_SHARDINGS,
    Enumerator,
    Partitioner,
    Perf,
    Placement,
    PlanOptions,
    Proposer,
    RankCost,
    ShardingOption,
    Storage,
    TableSpec,
    Topology,
    Workload,
)

logger = logging.getLogger(__name__)

DEFAULT_EBC_FQN = "sparse_arch.embedding_bag_collection"  # torchrec DLRM's EmbeddingBagCollection


class InfeasiblePlanError(ValueError):
    """No plan fits: the message names what does not fit, the bytes needed and available, and what would."""


@dataclass
class PlanResult:
    """A plan: the chosen option (with ranks) per table, and the predicted per-rank cost."""

    tables: dict[str, ShardingOption]
    topology: Topology
    workload: Workload
    base: RankCost  # per-rank dense model and local-batch buffers
    caps: Storage  # usable per-rank bytes (HBM less reserve, DDR)
    solver: str  # "exhaustive" (exact) | "greedy"
    plan_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    options_by_table: dict[str, list[ShardingOption]] = field(default_factory=dict, repr=False)

    @property
    def rank_storage(self) -> list[Storage]:
        out = [self.base.storage] * self.topology.world_size
        for opt in self.tables.values():
            for s in opt.shards:
                out[s.rank] = out[s.rank] + s.storage
        return out

    @property
    def rank_perf(self) -> list[Perf]:
        out = [self.base.perf] * self.topology.world_size
        for opt in self.tables.values():
            for s in opt.shards:
                out[s.rank] = out[s.rank] + s.perf
        return out

    @property
    def predicted_step_s(self) -> float:
        """The slowest rank's predicted seconds per step."""
        return max(p.total_s for p in self.rank_perf)

    @property
    def lower_bound_s(self) -> float:
        """A lower bound on any plan's step time with these options: the mean rank load, and no rank
        below the dense cost. The gap to `predicted_step_s` bounds how far the search is from optimal
        (exact when solver == "exhaustive")."""
        w = self.topology.world_size
        opts = [o for o in self.options_by_table.values() if o]
        mean = sum(min(o.total_perf_s for o in os) for os in opts) / w
        one_shard = max((min(max(s.perf.total_s for s in o.shards) for o in os) for os in opts), default=0.0)
        return self.base.perf.total_s + max(mean, one_shard)

    def placements(self) -> dict[Placement, list[str]]:
        out: dict[Placement, list[str]] = {p: [] for p in Placement}
        for name, opt in self.tables.items():
            out[opt.placement].append(name)
        return out

    def to_sharding_plan(
        self, module_path: str = DEFAULT_EBC_FQN, module=None, compute_device: str | None = None
    ):
        """A torchrec ShardingPlan for the EmbeddingBagCollection at `module_path` (built on the meta
        device from the TableSpecs when `module` is not given)."""
        from anyrec.planner.torchrec_plan import to_sharding_plan

        return to_sharding_plan(self, module_path, module, compute_device)

    def to_json_dict(self) -> dict:
        """The plan as the JSON schema of `plan.output`."""
        ranks = []
        for r, (st, pf) in enumerate(zip(self.rank_storage, self.rank_perf, strict=False)):
            ranks.append(
                {
                    "rank": r,
                    "hbm_bytes": int(st.hbm_bytes),
                    "hbm_cap_bytes": int(self.topology.hbm_bytes_per_rank),
                    "ddr_bytes": int(st.ddr_bytes),
                    "predicted_ms": pf.total_s * 1e3,
                }
            )
        tables = [
            {
                "name": name,
                "sharding": opt.sharding.value,
                "placement": opt.placement.value,
                "kernel": opt.compute_kernel,
                "ranks": sorted(set(opt.ranks)),
            }
            for name, opt in self.tables.items()
        ]
        return {
            "hardware": self.topology.device.name,
            "world_size": self.topology.world_size,
            "predicted_step_ms": self.predicted_step_s * 1e3,
            "ranks": ranks,
            "tables": tables,
        }

    def report(self, advice: bool = True) -> str:
        """Readable report: per rank memory and time, per table sharding/placement/ranks and why."""
        from anyrec.planner.report import format_report

        return format_report(self, advice=advice)

    def plot(self, path: str, compare: PlanResult | None = None) -> None:
        """PNG: per-rank memory stacked by kind against the cap, per-rank time as compute + comms."""
        from anyrec.planner.report import plot_plan

        plot_plan(self, path, compare)


def make_workload(
    tables: list[TableSpec],
    batch_size_per_rank: int,
    optimizer: str,
    dense_param_count: int = 0,
    options: PlanOptions | None = None,
    **overrides: object,
) -> Workload:
    """Validated Workload; `overrides` replace fields of `options` (e.g. allowed_placements=("hbm",))."""
    if not tables:
        raise ValueError("no tables to plan")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError("table names must be unique")
    if batch_size_per_rank <= 0:
        raise ValueError(f"batch_size_per_rank must be > 0, got {batch_size_per_rank}")
    if dense_param_count < 0:
        raise ValueError(f"dense_param_count must be >= 0, got {dense_param_count}")
    check_optimizer(optimizer)
    opts = dataclasses.replace(options or PlanOptions(), **overrides)
    get_kernel(opts.kernel)
    return Workload(list(tables), batch_size_per_rank, optimizer, dense_param_count, opts)


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector: planning allocates tens of thousands of short-lived, acyclic
    option objects (freed by reference counting), and collections triggered by them cost 2-4x the
    enumeration time at 1,000 tables."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class CoDesignPlanner:
    """Orchestrates enumerator -> proposer -> partitioner; collaborators are injectable."""

    def __init__(
        self,
        enumerator: Enumerator | None = None,
        proposer: Proposer | None = None,
        partitioner: Partitioner | None = None,
        exact_partitioner: Partitioner | None = None,
        dense_estimator: DenseEstimator | None = None,
    ) -> None:
        self.enumerator = enumerator or EmbeddingEnumerator()
        self.proposer = proposer or EscalatingPlacementProposer()
        self.partitioner = partitioner or GreedyPerfPartitioner()
        self.exact_partitioner = exact_partitioner or ExhaustivePartitioner()
        self.dense_estimator = dense_estimator or DenseEstimator()

    def plan(
        self,
        tables: list[TableSpec],
        topology: Topology,
        batch_size_per_rank: int,
        optimizer: str,
        dense_param_count: int = 0,
        options: PlanOptions | None = None,
        **overrides: object,
    ) -> PlanResult:
        """Plan `tables` on `topology`; raises InfeasiblePlanError when nothing fits."""
        with _gc_paused():
            return self._plan(tables, topology, batch_size_per_rank, optimizer, dense_param_count, options,
                              **overrides)

    def _plan(self, tables, topology, batch_size_per_rank, optimizer, dense_param_count, options,
              **overrides):
        start = time.perf_counter()
        wl = make_workload(tables, batch_size_per_rank, optimizer, dense_param_count, options, **overrides)
        allowed = wl.options.allowed_placements
        if topology.compute_device == "cpu" and allowed != (Placement.HBM,):
            if Placement.HBM not in allowed:
                raise ValueError("compute_device 'cpu' keeps tables in host memory: allow placement 'hbm'")
            allowed = (Placement.HBM,)
        base = self.dense_estimator.estimate(topology, wl)
        caps = usable_caps(topology, wl)
        free = Storage(caps.hbm_bytes - base.storage.hbm_bytes, caps.ddr_bytes - base.storage.ddr_bytes)
        notes: list[str] = []
        if free.hbm_bytes <= 0:
            from anyrec.planner.advice import explain_infeasible

            raise InfeasiblePlanError(explain_infeasible(wl, topology, caps, base, None))

        options = None
        if Placement.HBM in allowed:
            # Fast path: enumerate HBM only, and partition if the demand can fit.
            options = self.enumerator.enumerate(topology, wl, {t.name: (Placement.HBM,) for t in wl.tables})
            demand = sum(min(o.total_storage.hbm_bytes for o in opts) for opts in options.values() if opts)
            if all(options.values()) and demand <= free.hbm_bytes * topology.world_size:
                result = self._partition(options, topology, wl, base, caps)
                if result is not None:
                    return self._finish(result, options, topology, wl, base, caps, start, notes)
        if allowed != (Placement.HBM,) or options is None:
            options = self.enumerator.enumerate(topology, wl, {t.name: allowed for t in wl.tables})
        none = [n for n, opts in options.items() if not opts]
        if none:
            kinds = ", ".join(s.value for s in wl.options.allowed_shardings)
            raise InfeasiblePlanError(
                f"cannot plan {len(none)} of {len(wl.tables)} tables ({', '.join(none[:3])}"
                f"{', ...' if len(none) > 3 else ''}) with sharding {kinds} on {topology.world_size} x "
                f"{topology.device.name}: column-wise needs dim / shards >= {MIN_COLUMN_SHARD_DIM} (and a "
                f"multiple of 4), row-wise at least as many rows as ranks, table-row-wise more than one host"
            )
        for proposal in self.proposer.proposals(options, topology, free, wl):
            restricted = {n: [o for o in opts if o.placement in proposal[n]] for n, opts in options.items()}
            result = self._partition(restricted, topology, wl, base, caps)
            if result is not None:
                moved = [n for n, p in proposal.items() if p != (Placement.HBM,)]
                if moved:
                    notes.append(
                        f"{len(moved)} of {len(wl.tables)} tables leave HBM: all tables in HBM need more "
                        f"than the {free.hbm_bytes * topology.world_size / 1e9:.1f} GB free over "
                        f"{topology.world_size} x {topology.device.name}"
                    )
                return self._finish(result, restricted, topology, wl, base, caps, start, notes)
        from anyrec.planner.advice import explain_infeasible

        raise InfeasiblePlanError(explain_infeasible(wl, topology, caps, base, options))

    def _partition(self, options, topology, wl, base, caps):
        exact = (
            ExhaustivePartitioner.search_space(options, topology.world_size) <= wl.options.exhaustive_limit
        )
        part = self.exact_partitioner if exact else self.partitioner
        chosen = part.partition(options, topology, base, caps)
        if chosen is None:
            return None
        return chosen, ("exhaustive" if exact else "greedy")

    def _finish(self, result, options, topology, wl, base, caps, start, notes) -> PlanResult:
        from anyrec.planner.report import explain_tables

        chosen, solver = result
        ordered = {t.name: chosen[t.name] for t in wl.tables}
        plan = PlanResult(ordered, topology, wl, base, caps, solver, notes=notes, options_by_table=options)
        plan.reasons = explain_tables(plan)
        plan.plan_time_s = time.perf_counter() - start
        logger.info(
            "planned %d tables on %d x %s in %.3f s (%s): predicted step %.3f ms",
            len(wl.tables),
            topology.world_size,
            topology.device.name,
            plan.plan_time_s,
            solver,
            plan.predicted_step_s * 1e3,
        )
        return plan


def evaluate_assignment(
    assignment: dict[str, tuple[str, str, list[int]]],
    topology: Topology,
    workload: Workload,
    enumerator: Enumerator | None = None,
) -> PlanResult:
    """Cost a given plan (table -> (sharding, placement, ranks)) under anyrec's model, e.g. a torchrec
    plan. Column-wise takes as many shards as ranks listed; ranks are ignored for fixed-rank types."""
    enumerator = enumerator or EmbeddingEnumerator()
    wl = workload
    placements = {t.name: (Placement(assignment[t.name][1]),) for t in wl.tables}
    full = dataclasses.replace(wl.options, allowed_shardings=ALL_SHARDINGS, max_column_shards=1 << 30)
    options = enumerator.enumerate(topology, dataclasses.replace(wl, options=full), placements)
    chosen: dict[str, ShardingOption] = {}
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
    return PlanResult(
        chosen, topology, wl, base, usable_caps(topology, wl), "given", options_by_table=options
    )
