"""The co-design planner: `make_workload` checks the inputs; `CoDesignPlanner.plan` enumerates options,
tries HBM first, then the proposer's placements, partitions, and explains the plan it returns."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time

from anyrec.planner.advice import explain_infeasible, explain_tables, size_text
from anyrec.planner.enumerators import MIN_COLUMN_SHARD_DIM, EmbeddingEnumerator
from anyrec.planner.estimators import (
    OPTIMIZER_DENSE_STATE_BYTES,
    DenseEstimator,
    inexact_update_reason,
    sharding_group_time_s,
    usable_caps,
)
from anyrec.planner.memory import predict_memory
from anyrec.planner.partitioners import MAKESPAN_TOLERANCE, ExhaustivePartitioner, GreedyPerfPartitioner
from anyrec.planner.proposers import EscalatingPlacementProposer
from anyrec.planner.types import (
    Enumerator,
    InfeasiblePlanError,
    Partitioner,
    Placement,
    PlanOptions,
    PlanResult,
    Proposer,
    RankCost,
    ShardingOption,
    ShardingType,
    Storage,
    TableSpec,
    Topology,
    Workload,
    sharding_groups,
)

logger = logging.getLogger(__name__)


# Rounds of re-planning with the budget cut by the predicted overshoot: the search fits the per-shard
# storage estimate, the memory model (anyrec.planner.memory) then checks the whole step's peak.
MEMORY_FIT_ROUNDS = 8


def memory_shortfall(plan: PlanResult, limit: int) -> list[int]:
    """Per rank, the bytes by which `plan`'s predicted peak (reserved: with the allocator's slack and the
    data source) exceeds `limit`, 0 where it fits; all 0 on a CPU (no device memory to run out of)."""
    if plan.topology.compute_device == "cpu":
        return [0] * plan.topology.world_size
    predicted = predict_memory(plan, plan.workload.options.resident_bytes)
    return [max(0, p.reserved_bytes - limit) for p in predicted]


def make_workload(tables: list[TableSpec], batch_size_per_rank: int, optimizer: str,
                  dense_param_count: int = 0, options: PlanOptions | None = None,
                  **overrides: object) -> Workload:
    """Validated Workload; `overrides` replace fields of `options` (e.g. allowed_placements=("hbm",)).
    Sharding types that would change the optimizer's update are dropped from `allowed_shardings`; when
    that leaves none, ValueError says why in one line."""
    if not tables:
        raise ValueError("no tables to plan")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError("table names must be unique")
    if batch_size_per_rank <= 0:
        raise ValueError(f"batch_size_per_rank must be > 0, got {batch_size_per_rank}")
    if dense_param_count < 0:
        raise ValueError(f"dense_param_count must be >= 0, got {dense_param_count}")
    if optimizer not in OPTIMIZER_DENSE_STATE_BYTES:
        known = ", ".join(sorted(OPTIMIZER_DENSE_STATE_BYTES))
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {known}")
    opts = dataclasses.replace(options or PlanOptions(), **overrides)
    exact = tuple(s for s in opts.allowed_shardings if inexact_update_reason(optimizer, s) is None)
    if not exact:
        raise ValueError(inexact_update_reason(optimizer, opts.allowed_shardings[0]))
    opts = dataclasses.replace(opts, allowed_shardings=exact)
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


def _step_s(chosen: dict[str, ShardingOption], topology: Topology, base: RankCost, group_s: float) -> float:
    """The slowest rank's seconds per step of `chosen`, its sharding groups included."""
    loads = [base.perf.total_s] * topology.world_size
    for opt in chosen.values():
        for shard in opt.shards:
            loads[shard.rank] += shard.perf.total_s
    return max(loads) + sharding_groups(chosen.values()) * group_s


class CoDesignPlanner:
    """Orchestrates enumerator -> proposer -> partitioner; collaborators are injectable."""

    def __init__(self, enumerator: Enumerator | None = None, proposer: Proposer | None = None,
                 partitioner: Partitioner | None = None, exact_partitioner: Partitioner | None = None,
                 dense_estimator: DenseEstimator | None = None) -> None:
        self.enumerator = enumerator or EmbeddingEnumerator()
        self.proposer = proposer or EscalatingPlacementProposer()
        self.partitioner = partitioner or GreedyPerfPartitioner()
        self.exact_partitioner = exact_partitioner or ExhaustivePartitioner()
        self.dense_estimator = dense_estimator or DenseEstimator()

    @_gc_paused()
    def plan(self, tables: list[TableSpec], topology: Topology, batch_size_per_rank: int, optimizer: str,
             dense_param_count: int = 0, options: PlanOptions | None = None,
             **overrides: object) -> PlanResult:
        """Plan `tables` on `topology`; raises InfeasiblePlanError when nothing fits."""
        start = time.perf_counter()
        wl = make_workload(tables, batch_size_per_rank, optimizer, dense_param_count, options, **overrides)
        allowed = wl.options.allowed_placements
        if topology.compute_device == "cpu" and allowed != (Placement.HBM,):
            if Placement.HBM not in allowed:
                raise ValueError("compute_device 'cpu' keeps tables in host memory: allow placement 'hbm'")
            allowed = (Placement.HBM,)
        base = self.dense_estimator.estimate(topology, wl)
        usable = usable_caps(topology, wl)
        cut, short = 0, None
        for _ in range(MEMORY_FIT_ROUNDS):
            try:
                plan = self._plan_within(topology, wl, allowed, base,
                                         Storage(usable.hbm_bytes - cut, usable.ddr_bytes), start)
            except InfeasiblePlanError:
                if short is None:
                    raise
                break
            short = memory_shortfall(plan, usable.hbm_bytes)
            if not any(short):
                plan.caps = usable
                if cut:
                    plan.notes.append(f"planned with {size_text(cut)} less per rank than the per-shard "
                                      f"storage allows, so that each rank's predicted peak fits")
                return plan
            cut += max(short)
        reserved = topology.hbm_bytes_per_rank - usable.hbm_bytes
        uvm = ", allow uvm_caching placement" if Placement.UVM_CACHING not in allowed else ""
        raise InfeasiblePlanError(
            f"no plan fits {topology.world_size} x {topology.device.name} "
            f"({size_text(topology.hbm_bytes_per_rank)} each, {size_text(reserved)} kept for the runtime "
            f"and margin): the closest plan's predicted peak is "
            + ", ".join(f"rank {r}: {size_text(usable.hbm_bytes + s)} ({size_text(s)} short)"
                        for r, s in enumerate(short))
            + f" (docs/planning.md, memory terms); use more or larger devices{uvm} or a smaller batch")

    def _plan_within(self, topology: Topology, wl: Workload, allowed: tuple[Placement, ...], base: RankCost,
                     caps: Storage, start: float) -> PlanResult:
        """One search for a plan whose per-shard storage fits `caps` (InfeasiblePlanError: none does)."""
        free = Storage(caps.hbm_bytes - base.storage.hbm_bytes, caps.ddr_bytes - base.storage.ddr_bytes)
        notes: list[str] = []
        if free.hbm_bytes <= 0:
            raise InfeasiblePlanError(explain_infeasible(wl, topology, caps, base))

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
                    notes.append(f"{len(moved)} of {len(wl.tables)} tables leave HBM: all tables in HBM need "
                                 f"more than the {free.hbm_bytes * topology.world_size / 1e9:.1f} GB free "
                                 f"over {topology.world_size} x {topology.device.name}")
                return self._finish(result, restricted, topology, wl, base, caps, start, notes)
        raise InfeasiblePlanError(explain_infeasible(wl, topology, caps, base))

    def _partition(self, options, topology, wl, base, caps):
        """The search's plan; when it uses several sharding types, also the best plan with one of them
        (and data-parallel) where one fits: each type used costs every rank its own all-to-all rounds
        (`sharding_group_time_s`), which per-shard costs cannot express."""
        best = self._search(options, topology, wl, base, caps)
        group_s = sharding_group_time_s(topology)
        groups = sharding_groups(best[0].values()) if best is not None else 0
        if groups <= 1:
            return best
        best_s = _step_s(best[0], topology, base, group_s)
        # A one-type plan saves at most the other types' rounds: not worth a search when that is
        # within the partitioner's own tolerance (e.g. 20 us collectives beside an 80 ms step).
        if (groups - 1) * group_s <= MAKESPAN_TOLERANCE * best_s:
            return best
        dp = ShardingType.DATA_PARALLEL
        for st in sorted({o.sharding for o in best[0].values()} - {dp}):
            restricted = {n: [o for o in opts if o.sharding in (st, dp)] for n, opts in options.items()}
            if not all(restricted.values()):
                continue
            found = self._search(restricted, topology, wl, base, caps)
            if found is not None and (step := _step_s(found[0], topology, base, group_s)) < best_s:
                best, best_s = found, step
        return best

    def _search(self, options, topology, wl, base, caps):
        space = ExhaustivePartitioner.search_space(options, topology.world_size)
        exact = space <= wl.options.exhaustive_limit
        part = self.exact_partitioner if exact else self.partitioner
        chosen = part.partition(options, topology, base, caps)
        return None if chosen is None else (chosen, "exhaustive" if exact else "greedy")

    def _finish(self, result, options, topology, wl, base, caps, start, notes) -> PlanResult:
        chosen, solver = result
        ordered = {t.name: chosen[t.name] for t in wl.tables}
        plan = PlanResult(ordered, topology, wl, base, caps, solver, notes=notes, options_by_table=options,
                          group_s=sharding_group_time_s(topology))
        plan.reasons = explain_tables(plan)
        plan.plan_time_s = time.perf_counter() - start
        logger.info("planned %d tables on %d x %s in %.3f s (%s): predicted step %.3f ms", len(wl.tables),
                    topology.world_size, topology.device.name, plan.plan_time_s, solver,
                    plan.predicted_step_s * 1e3)
        return plan
