"""2D sparse parallelism in the cost model: the tables are planned for one sharding group, and the step
pays what the group's plan costs plus what 2D adds, the averaging of the replicas and the dense all-reduce
over the whole world. `choose_group_size` prices every group size that divides the world and keeps the
fastest that fits.

Where a group's ranks sit is one of torchrec's two DMPCollection layouts (`use_inter_host_allreduce`,
`DMPCollection._create_process_groups`), weighed per group size (`choose_group_size`):
- strided (False, torchrec's default): group g holds ranks g, g + R, g + 2R, ... (R = world / group
  replicas), so a rank's replicas are the R neighbouring ranks (one host while R <= ranks per host) and
  a group strides over the hosts;
- contiguous (True): group g holds ranks g G .. g G + G - 1 (G the group size), on one host while
  G <= ranks per host, and a rank's replicas stride over the hosts.

A calibration that measured 2D's collectives on this host's ranks (`Hardware.subgroups`: the all-to-all
within groups of G, the all-reduce over R replicas) prices a group size that sits as it was measured (the
group, or the replica group, on one host) with those fits; other sizes, and a calibration without them,
keep the spec's link figures (the whole job's calibration, else the datasheet). The calibration measures
the strided layout's groups: a contiguous layout whose groups are other ranks is priced from the spec.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from anyrec.backends.hardware import LinkFit, SubgroupLinks
from anyrec.backends.specs import DeviceSpec
from anyrec.planner.estimators import (
    ID_BYTES,
    OUTPUT_BYTES,
    all_reduce_time_s,
    dense_all_reduce_time_s,
    reduce_scatter_time_s,
    shard_data_bytes,
    shard_lookups,
)
from anyrec.planner.types import InfeasiblePlanError, PlanResult, ReplicaUpdate, ShardingType, Topology

# One all-reduce for the weights and one for the optimizer state, each coalesced per dtype (torchrec's
# DMPCollection._sync): tables of one dtype give two collectives.
SYNC_COLLECTIVES = 2


@dataclass(frozen=True)
class GroupLayout:
    """`world_size` ranks, `local_world_size` per host, in sharding groups of `group_size`, laid out as
    torchrec's DMPCollection does for `use_inter_host_allreduce` (False: strided groups, True: contiguous
    groups; the module docstring)."""

    world_size: int
    local_world_size: int
    group_size: int
    use_inter_host_allreduce: bool = False

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.world_size % self.group_size:
            raise ValueError(f"sharding group size {self.group_size} does not divide the world size "
                             f"{self.world_size}")

    @property
    def name(self) -> str:
        return "contiguous" if self.use_inter_host_allreduce else "strided"

    @property
    def replicas(self) -> int:
        """Groups, each a replica of the others' tables (the replica group's size)."""
        return self.world_size // self.group_size

    @property
    def group_local_size(self) -> int:
        """Ranks of one group on one host (at least 1; contiguous groups that straddle a host boundary
        count the fewest a host holds)."""
        if self.use_inter_host_allreduce:
            return math.gcd(self.group_size, self.local_world_size)
        return max(1, self.local_world_size // self.replicas)

    @property
    def replica_local_size(self) -> int:
        """Ranks of one replica group on one host (at least 1)."""
        if self.use_inter_host_allreduce:
            return max(1, self.local_world_size // self.group_size)
        return min(self.replicas, self.local_world_size)

    def group_topology(self, device: DeviceSpec, compute_device: str | None = None) -> Topology:
        """The machines one group's tables are planned on: its ranks, spread as the layout spreads them."""
        return Topology(device, self.group_size, self.group_local_size, compute_device)

    def replica_topology(self, device: DeviceSpec, compute_device: str | None = None) -> Topology:
        """The machines one replica group's all-reduce spans: its R ranks, spread as the layout spreads
        them."""
        return Topology(device, self.replicas, self.replica_local_size, compute_device)

    def world_topology(self, device: DeviceSpec, compute_device: str | None = None) -> Topology:
        return Topology(device, self.world_size, self.local_world_size, compute_device)

    def sharding_groups(self) -> list[list[int]]:
        """Each sharding group's ranks, in torchrec's order (`DMPCollection._create_process_groups`: its
        device mesh's rows): strided, group g holds g, g + R, g + 2R, ...; contiguous, g G .. g G + G - 1."""
        if self.use_inter_host_allreduce:
            g = self.group_size
            return [list(range(start, start + g)) for start in range(0, self.world_size, g)]
        return [[self.replicas * r + g for r in range(self.group_size)] for g in range(self.replicas)]

    def replica_groups(self) -> list[list[int]]:
        """Each replica group's ranks (the mesh's columns): the i-th rank of every sharding group."""
        return [list(col) for col in zip(*self.sharding_groups(), strict=True)]

    def group_rank(self, rank: int) -> int:
        """`rank`'s index in its sharding group (the rank of the group's plan it runs)."""
        return rank % self.group_size if self.use_inter_host_allreduce else rank // self.replicas

    def as_measured(self) -> bool:
        """Whether the groups are the strided layout's (what a calibration measures on sub-groups)."""
        strided = dataclasses.replace(self, use_inter_host_allreduce=False)
        return self.sharding_groups() == strided.sharding_groups()


def layouts(world_size: int, local_world_size: int, group_size: int) -> list[GroupLayout]:
    """The layouts of groups of `group_size` that differ in their ranks: strided, then contiguous where its
    groups are other ranks."""
    strided = GroupLayout(world_size, local_world_size, group_size)
    contiguous = GroupLayout(world_size, local_world_size, group_size, True)
    return [strided] if contiguous.as_measured() else [strided, contiguous]


@dataclass(frozen=True)
class GroupLinks:
    """The specs one group size's collectives are priced with, and where their link figures come from."""

    group: DeviceSpec  # the group's plan: its all-to-alls and its share of the dense all-reduce
    replica: DeviceSpec  # the replicas' averaging
    world: DeviceSpec  # the dense all-reduce over the whole world
    group_source: str
    replica_source: str

    def describe(self, replicas: int) -> str:
        """Which figures priced the group's collectives (one line)."""
        if replicas == 1:  # 1D: no replicas to average
            return f"all-to-all {self.group_source}"
        if self.group_source == self.replica_source:
            return f"all-to-all and replica all-reduce {self.group_source}"
        return f"all-to-all {self.group_source}; replica all-reduce {self.replica_source}"


def _with_fit(device: DeviceSpec, fit: LinkFit, latency_per_stage: int) -> DeviceSpec:
    """`device` with its scale-up link set to a measured fit (as achieved: efficiency 1). The planner
    prices an all-reduce as two stages, each paying the latency: the fit's latency is split over them."""
    return device.replace(scale_up_bw_bytes_per_s=fit.bus_bw_bytes_per_s, comms_efficiency=1.0,
                          scale_up_latency_s=fit.latency_s / latency_per_stage)


def group_links(device: DeviceSpec, layout: GroupLayout, measured: dict[int, SubgroupLinks] | None = None,
                world_source: str = "from the datasheet's figures") -> GroupLinks:
    """How `layout` is priced: its group's all-to-all with the fit measured on groups of its size where
    the group sits on one host as measured, its replicas' all-reduce with the fit measured over as many
    replicas on one host; `device` (described by `world_source`) otherwise, and for a contiguous layout
    whose groups are not the measured (strided) ones."""
    entry = (measured or {}).get(layout.group_size)
    if entry is not None and not layout.as_measured():
        entry = None
        world_source = f"{world_source} (sub-groups measured in the strided layout only)"
    group, group_source = device, world_source
    if entry is not None and entry.all_to_all is not None and layout.group_local_size == layout.group_size:
        group = _with_fit(device, entry.all_to_all, 1)
        group_source = f"measured on groups of {layout.group_size}"
    replica, replica_source = device, world_source
    if entry is not None and entry.all_reduce_replicas is not None and entry.replicas == layout.replicas \
            and layout.replica_local_size == layout.replicas:
        replica = _with_fit(device, entry.all_reduce_replicas, 2)
        replica_source = f"measured over {layout.replicas} replicas"
    return GroupLinks(group, replica, device, group_source, replica_source)


def replica_bytes(plan: PlanResult) -> list[tuple[int, int]]:
    """Per rank of the group: the (weight, optimizer state) bytes its sharded tables' shards hold, which
    the replicas average (data-parallel tables are DDP's, averaged with the dense gradients)."""
    out = [(0, 0)] * plan.topology.world_size
    for opt in plan.tables.values():
        if opt.sharding == ShardingType.DATA_PARALLEL:
            continue
        for s in opt.shards:
            weights, state, _, _ = shard_data_bytes(opt, s, plan.topology, plan.workload)
            w, st = out[s.rank]
            out[s.rank] = (w + weights, st + state)
    return out


def replica_sync_time_s(plan: PlanResult, layout: GroupLayout, sync_every: int = 1,
                        device: DeviceSpec | None = None) -> float:
    """Seconds per step of averaging the replicas (every `sync_every` steps, amortised): the slowest
    rank's all-reduces of its shards' weights and optimizer state over its replica group, on `device`'s
    links (default: the plan's)."""
    if layout.replicas == 1:
        return 0.0
    topo = layout.replica_topology(device or plan.topology.device, plan.topology.compute_device)
    per_rank = [all_reduce_time_s(w, topo) + (all_reduce_time_s(st, topo) if st else 0.0)
                for w, st in replica_bytes(plan)]
    return max(per_rank, default=0.0) / sync_every


def exchange_bytes(plan: PlanResult) -> list[float]:
    """Per rank of the group: the bytes its sharded lookups put into the gradient exchange per step (the
    ids, the bags' lengths, the gradients of the pooled outputs: anyrec.trainer.replica_exchange)."""
    out = [0.0] * plan.topology.world_size
    for opt in plan.tables.values():
        if opt.sharding == ShardingType.DATA_PARALLEL:
            continue
        for s in opt.shards:
            ids, bags, _ = shard_lookups(opt, plan.topology, plan.workload)
            out[s.rank] += ID_BYTES * (ids + bags) + OUTPUT_BYTES * bags * s.num_cols
    return out


def replica_exchange_time_s(plan: PlanResult, layout: GroupLayout, device: DeviceSpec | None = None) -> float:
    """Seconds per step of exchanging the replicas' gradients, on the slowest rank: an all-gather of the
    R contributions over its replica group (on `device`'s links, default the plan's) and its kernels'
    replayed lookup, a forward and a fused backward over R groups' lookups in place of its own backward
    (lookup time taken as linear in the lookups)."""
    if layout.replicas == 1:
        return 0.0
    topo = layout.replica_topology(device or plan.topology.device, plan.topology.compute_device)
    replay = [0.0] * plan.topology.world_size
    for opt in plan.tables.values():
        if opt.sharding != ShardingType.DATA_PARALLEL:
            for s in opt.shards:
                replay[s.rank] += (layout.replicas * s.perf.fwd_compute_s
                                   + (layout.replicas - 1) * s.perf.bwd_compute_s)
    return max(reduce_scatter_time_s(layout.replicas * n, layout.replicas, topo.num_hosts, topo) + c
               for n, c in zip(exchange_bytes(plan), replay, strict=True))


def replica_update_time_s(plan: PlanResult, layout: GroupLayout, update: ReplicaUpdate, sync_every: int = 1,
                          device: DeviceSpec | None = None) -> float:
    """Seconds per step of keeping the replicas one model the way `update` does."""
    if update == ReplicaUpdate.GRADIENTS:
        return replica_exchange_time_s(plan, layout, device)
    return replica_sync_time_s(plan, layout, sync_every, device)


def dense_extra_time_s(plan: PlanResult, layout: GroupLayout, device: DeviceSpec | None = None) -> float:
    """Seconds per step the all-reduce of the dense gradients and the data-parallel tables' gradients
    takes over the whole world (on `device`'s links, default the plan's) beyond the group's (the group's
    plan prices it over the group; DDP runs it over every rank, torchrec's sync leaves data-parallel
    tables to it)."""
    world = layout.world_topology(device or plan.topology.device, plan.topology.compute_device)
    n = plan.workload.dense_param_count + sum(
        o.table.num_rows * o.table.embedding_dim for o in plan.tables.values()
        if o.sharding == ShardingType.DATA_PARALLEL)
    return dense_all_reduce_time_s(n, world) - dense_all_reduce_time_s(n, plan.topology)


def price_group(plan: PlanResult, layout: GroupLayout, sync_every: int = 1,
                links: GroupLinks | None = None, update: ReplicaUpdate = ReplicaUpdate.AVERAGE) -> PlanResult:
    """`plan` (one group's) with 2D's costs in its step: keeping the replicas one model (`update`), the
    world's dense all-reduce (on `links`' replica and world specs; default: the plan's)."""
    replica, world = (links.replica, links.world) if links is not None else (None, None)
    extra = (replica_update_time_s(plan, layout, update, sync_every, replica)
             + dense_extra_time_s(plan, layout, world))
    return dataclasses.replace(plan, replica_s=extra, replicas=layout.replicas, replica_update=update)


@dataclass
class GroupCandidate:
    """One group size and layout weighed: its priced plan, or why it does not fit."""

    group_size: int
    replicas: int
    plan: PlanResult | None
    use_inter_host_allreduce: bool = False
    sync_s: float = 0.0
    dense_extra_s: float = 0.0
    infeasible: str = ""
    figures: str = ""  # which link figures priced its collectives (GroupLinks.describe)

    @property
    def step_s(self) -> float | None:
        return self.plan.predicted_step_s if self.plan is not None else None

    @property
    def layout(self) -> str:
        return "contiguous" if self.use_inter_host_allreduce else "strided"

    @property
    def label(self) -> str:
        """The group size, and the layout where it is not torchrec's default."""
        return f"{self.group_size} contiguous" if self.use_inter_host_allreduce else str(self.group_size)


@dataclass
class GroupChoice:
    """The group sizes and layouts weighed, and the chosen one (the lowest predicted step among those that
    fit): `chosen` ranks per group, laid out as torchrec's `use_inter_host_allreduce` says."""

    chosen: int
    candidates: list[GroupCandidate]
    use_inter_host_allreduce: bool = False

    @property
    def best(self) -> GroupCandidate:
        return next(c for c in self.candidates if c.group_size == self.chosen
                    and c.use_inter_host_allreduce == self.use_inter_host_allreduce)

    @property
    def plan(self) -> PlanResult:
        return self.best.plan


def group_sizes(world_size: int) -> list[int]:
    """Every group size that divides the world, smallest first."""
    return [g for g in range(1, world_size + 1) if world_size % g == 0]


def choose_group_size(world_size: int, local_world_size: int, device: DeviceSpec, compute_device: str | None,
                      plan_for: Callable[[Topology], PlanResult], sizes: list[int] | None = None,
                      sync_every: int = 1, measured: dict[int, SubgroupLinks] | None = None,
                      world_source: str = "from the datasheet's figures",
                      update: ReplicaUpdate = ReplicaUpdate.AVERAGE) -> GroupChoice:
    """Plan each group size of `sizes` (default: every divisor of the world) in each of torchrec's layouts
    (`layouts`) with `plan_for(group topology)`, price 2D's costs, and choose the lowest predicted step
    among those that fit (ties: the larger group, fewer replicas to keep and average, then the strided
    layout, torchrec's default). Collectives are priced with the fits `measured` per group size where
    they apply (`group_links`), else with `device`'s links (`world_source` says where those come from);
    the replicas are kept one model by `update`. InfeasiblePlanError when none fits."""
    candidates = []
    for layout in [lay for g in sizes or group_sizes(world_size)
                   for lay in layouts(world_size, local_world_size, g)]:
        g, inter = layout.group_size, layout.use_inter_host_allreduce
        links = group_links(device, layout, measured, world_source)
        figures = links.describe(layout.replicas)
        try:
            plan = plan_for(layout.group_topology(links.group, compute_device))
        except InfeasiblePlanError as e:
            candidates.append(GroupCandidate(g, layout.replicas, None, inter,
                                             infeasible=str(e).splitlines()[0], figures=figures))
            continue
        candidates.append(GroupCandidate(
            g, layout.replicas, price_group(plan, layout, sync_every, links, update), inter,
            replica_update_time_s(plan, layout, update, sync_every, links.replica),
            dense_extra_time_s(plan, layout, links.world), figures=figures))
    fitting = [c for c in candidates if c.plan is not None]
    if not fitting:
        raise InfeasiblePlanError("no sharding group size fits: " + "; ".join(
            f"{c.label}: {c.infeasible}" for c in candidates))
    best = min(fitting, key=lambda c: (c.step_s, -c.group_size, c.use_inter_host_allreduce))
    return GroupChoice(best.group_size, candidates, best.use_inter_host_allreduce)
