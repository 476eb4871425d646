"""One planned job, as a value: `plan_job` plans a job's tables once (the trainer, `anyrec-plan` and
calibration's step points all call it) and returns a `PlannedJob`: torchrec's ShardingPlan, the job's
`ParallelLayout` (how its ranks split into sharding groups and replicas, and how the replicas stay one
model: torchtitan's `ParallelDims` idea) and what the planner predicts of it (the step, each rank's
memory). The trainer computes it once, broadcasts it once, and hands it to sharding, 2D and the step
pipelines; nothing reads the layout back from the plan."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingCollection

from anyrec.backends.dispatch import Impl
from anyrec.backends.hardware import Hardware
from anyrec.backends.sharders import collection_sharder
from anyrec.config import AnyrecConfig, GroupSize, GroupWord, PlannerName, Precision, ReplicaUpdateChoice
from anyrec.planner.evaluate import evaluate_assignment
from anyrec.planner.job import collection_configs, plan_model, planner_inputs
from anyrec.planner.memory import MemoryPrediction, predict_memory
from anyrec.planner.planner import CoDesignPlanner, make_workload
from anyrec.planner.report import format_group_choice, format_report
from anyrec.planner.sequence import offline_attention
from anyrec.planner.simple import simple_table_shardings
from anyrec.planner.simple import to_sharding_plan as simple_sharding_plan
from anyrec.planner.torchrec_plan import to_sharding_plan
from anyrec.planner.twod import GroupChoice, GroupLayout, choose_group_size
from anyrec.planner.types import Perf, PlanResult, ReplicaUpdate, ShardingType, Topology
from anyrec.schema import WorkloadFacts

logger = logging.getLogger(__name__)

# 2D (torchrec's DMPCollection) for an EmbeddingCollection: DMPCollection's averaging finds the sequence
# tables' TBE kernels as it finds pooled ones, but anyrec's gradient exchange (1D's update for a stateful
# optimizer, planner.replica_update=gradients) and the 2D memory model cover pooled lookups only.
SEQUENCE_2D_REFUSAL = ("planner.sharding_group_size: 2D sparse parallelism is not available for sequence "
                       "embeddings (EmbeddingCollection) yet: anyrec's gradient exchange and its 2D cost "
                       "model cover pooled tables only; use planner.sharding_group_size=world")
# table -> (sharding type, placement, ranks): a plan given table by table (calibration's step points)
Assignment = dict[str, tuple[str, str, list[int]]]


@dataclass(frozen=True)
class ParallelLayout:
    """How a job's `world_size` ranks (`local_world_size` per host) hold its tables: sharded within groups
    of `group_size` ranks laid out as torchrec's `use_inter_host_allreduce` says, each group a replica of
    the others, the replicas kept one model by `replica_update` (AVERAGE: every `replica_sync_every`
    steps). One group of every rank is 1D."""

    world_size: int
    local_world_size: int
    group_size: int
    use_inter_host_allreduce: bool = False
    replica_update: ReplicaUpdate = ReplicaUpdate.AVERAGE
    replica_sync_every: int = 1

    def __post_init__(self) -> None:
        GroupLayout(self.world_size, self.local_world_size, self.group_size)  # refuses a non-divisor

    @classmethod
    def one_d(cls, world_size: int, local_world_size: int) -> ParallelLayout:
        """Every table sharded over the whole world (no replicas)."""
        return cls(world_size, local_world_size, world_size)

    @property
    def groups(self) -> GroupLayout:
        """Where the groups' ranks sit (the planner's view of the layout)."""
        return GroupLayout(self.world_size, self.local_world_size, self.group_size,
                           self.use_inter_host_allreduce)

    @property
    def is_2d(self) -> bool:
        """Whether the tables are sharded within groups smaller than the world (torchrec's DMPCollection)."""
        return self.group_size < self.world_size

    @property
    def replicas(self) -> int:
        """Sharding groups, each a replica of the others' tables."""
        return self.world_size // self.group_size

    @property
    def name(self) -> str:
        """The groups' layout: strided (torchrec's default) or contiguous."""
        return self.groups.name

    @property
    def group_local_size(self) -> int:
        """Ranks of one group on one host (torchrec's `node_group_size`)."""
        return self.groups.group_local_size

    @property
    def sync_every(self) -> int:
        """Steps between the replicas' averagings in the train pipeline (1 where nothing is averaged)."""
        return self.replica_sync_every if self.is_2d and self.replica_update == ReplicaUpdate.AVERAGE else 1

    def group_rank(self, rank: int) -> int:
        """`rank`'s index in its sharding group (the rank of the group's plan it runs)."""
        return self.groups.group_rank(rank)

    def describe(self) -> str:
        """One line: 1D, or the groups, their layout and how the replicas stay one model."""
        if not self.is_2d:
            return f"1D: every table sharded over {self.world_size} rank(s)"
        how = "exchange their embedding gradients every step"
        if self.replica_update == ReplicaUpdate.AVERAGE:
            how = f"are averaged every {self.replica_sync_every} step(s)"
        return (f"2D: {self.replicas} sharding groups of {self.group_size} ranks, {self.name} layout "
                f"(use_inter_host_allreduce={self.use_inter_host_allreduce}); the replicas {how}")


@dataclass(frozen=True)
class PlannedJob:
    """A job's plan and what is known of it: torchrec's ShardingPlan (for one sharding group in 2D: its
    ranks 0..group_size-1, which torchrec maps onto each group's), the layout, and the predictions where
    the co-design planner made them (`result`: its plan and costs; `groups`: the group sizes it weighed;
    `slowest`: the per-step cost of the slowest rank; `memory`: each world rank's predicted peak)."""

    plan: ShardingPlan
    layout: ParallelLayout
    result: PlanResult | None = None
    groups: GroupChoice | None = None
    slowest: Perf | None = None
    memory: tuple[MemoryPrediction, ...] | None = None

    @property
    def predicted_step_s(self) -> float | None:
        """Seconds per step the planner predicts (None: no prediction, the simple planner's plan)."""
        return self.result.predicted_step_s if self.result is not None else None


def group_size_in_ranks(size: GroupSize, world_size: int) -> int | None:
    """`planner.sharding_group_size` in ranks: world -> the world size, auto -> None (the co-design
    planner chooses), N -> N, which must divide the world size (ValueError in one line)."""
    if size == GroupWord.world:
        return world_size
    if size == GroupWord.auto:
        return None
    if world_size % size:
        raise ValueError(f"planner.sharding_group_size={size}: expected world, auto or a divisor of the "
                         f"world size {world_size}")
    return size


def resolve_replica_update(choice: ReplicaUpdateChoice, optimizer: str, sync_every: int) -> ReplicaUpdate:
    """`planner.replica_update` for a job: auto exchanges gradients where averaging is not 1D's update
    (a stateful optimizer, averaged every step) and averages otherwise (SGD, whose averaged update is
    1D's, or k > 1 steps, where the replicas are meant to drift between averagings). ValueError for
    gradients with k > 1 (exchanged replicas never drift; k would be ignored)."""
    if choice == ReplicaUpdateChoice.auto:
        stateful = optimizer != "sgd"
        return ReplicaUpdate.GRADIENTS if stateful and sync_every == 1 else ReplicaUpdate.AVERAGE
    update = ReplicaUpdate(choice.value)
    if update == ReplicaUpdate.GRADIENTS and sync_every != 1:
        raise ValueError(f"planner.replica_update=gradients keeps the replicas equal every step; "
                         f"planner.replica_sync_every={sync_every} applies to average only")
    return update


def id_skew(cfg: AnyrecConfig) -> float:
    """The ids' Zipf exponent where the data source sets it (synthetic data); 0 (uniform ids, the most
    rows touched per step) for files, whose skew is unknown before reading them."""
    return float(cfg.data.zipf_exponent) if cfg.data.name == "synthetic" else 0.0


def plan_job(cfg: AnyrecConfig, model: nn.Module, collection: nn.Module, module_path: str,
             facts: WorkloadFacts, hardware: Hardware, embedding: Impl, world_size: int,
             local_world_size: int, batch_size_per_rank: int, device_type: str | None = None,
             resident_bytes: int = 0, planner: CoDesignPlanner | None = None,
             place: Callable[[ShardingPlan], ShardingPlan] | None = None,
             assignment: Assignment | None = None, log: bool = False, attention: str | None = None,
             what_if: bool = False, precision: Precision = Precision.auto) -> PlannedJob:
    """Plan the tables of `model`'s embedding collection (`collection`, at `module_path` in `model`, the
    module the plan shards; pooled or sequence, the model family's `facts` say what the planner needs of
    the rest of the model) for `world_size` ranks (`local_world_size` per host) training
    `batch_size_per_rank` samples each, with the `embedding` implementation costed on `hardware`, on a
    `device_type` device (None: the hardware's spec, planning offline), leaving each device the
    `resident_bytes` its data sources keep. The configured planner chooses (`planner`: the co-design
    planner to use), or `assignment` gives every table's sharding (1D). `place` names each shard's device
    (the trainer's backend). `attention`: the implementation that runs an HSTU model's attention (None:
    triton on an accelerator, torch on a CPU); `what_if`: an offline plan (anyrec-plan) may use what the
    trainer lacks (activation recompute), said in its notes; `precision`: the dense part's, as the job's
    backend resolved it (`auto`, a device planned offline: its spec's `auto_precision`, fp32 on a CPU).
    ValueError (one line) for a job the trainer would refuse; InfeasiblePlanError when nothing fits."""
    pc = cfg.planner
    group = group_size_in_ranks(pc.sharding_group_size, world_size)
    pooled = not isinstance(collection, EmbeddingCollection)  # else sequence embeddings
    if not pooled and group != world_size:
        if group is not None:
            raise ValueError(SEQUENCE_2D_REFUSAL)
        group = world_size  # auto: 1D is the only layout sequence embeddings have
    if not pooled and pc.sharding == ShardingType.DATA_PARALLEL:
        # torchrec's EmbeddingCollection splits a data-parallel table's unpooled output by the wrong sizes
        raise ValueError("planner.sharding=data_parallel: sequence tables (EmbeddingCollection) are sharded "
                         "table_wise, row_wise or column_wise")
    if group is None and pc.name != PlannerName.codesign:
        raise ValueError("planner.sharding_group_size=auto needs planner=codesign (the cost model chooses)")
    update = resolve_replica_update(pc.replica_update, cfg.optim.name, pc.replica_sync_every)
    ebc = collection
    compute_device = Topology(hardware.spec, world_size, local_world_size, device_type).compute_device
    attention = attention or offline_attention(compute_device)
    place = place or (lambda plan: plan)

    def layout_of(size: int, inter_host: bool = False) -> ParallelLayout:
        return ParallelLayout(world_size, local_world_size, size, inter_host, update, pc.replica_sync_every)

    if assignment is not None:
        if group != world_size:
            raise ValueError("a plan given table by table is 1D: planner.sharding_group_size=world")
        tables, dense_params, options = planner_inputs(model, ebc, facts, pc, cfg.optim.name,
                                                       hardware.embedding_cost(embedding), device_type,
                                                       attention, hardware.hstu_rates, precision)
        workload = make_workload(tables, batch_size_per_rank, cfg.optim.name, dense_params, **options)
        result = evaluate_assignment(assignment, Topology(hardware.spec, world_size, local_world_size,
                                                          device_type), workload)
        return _planned(result, None, layout_of(world_size), module_path, ebc, compute_device, resident_bytes,
                        place)
    if pc.name == PlannerName.simple:
        if pc.sharding == ShardingType.DATA_PARALLEL and not embedding.data_parallel:
            raise ValueError(f"planner.sharding=data_parallel cannot run with "
                             f"backend.embedding_kernel={embedding.name}")
        layout = layout_of(group)  # torchrec's default layout
        shardings = simple_table_shardings(collection_configs(ebc), group, force=pc.sharding,
                                           optimizer=cfg.optim.name)
        sharder = collection_sharder(embedding, pooled)
        plan = simple_sharding_plan(ebc, shardings, module_path, group, layout.group_local_size,
                                    compute_device, sharder=sharder,
                                    compute_kernel=embedding.compute_kernel())
        return PlannedJob(place(plan), layout)

    def plan_for(topology: Topology) -> PlanResult:
        return plan_model(model, ebc, facts, pc, cfg.optim.name, topology, batch_size_per_rank,
                          hardware.embedding_cost(embedding), planner, id_zipf_exponent=id_skew(cfg),
                          resident_bytes=resident_bytes, attention_impl=attention, allow_recompute=what_if,
                          hstu_rates=hardware.hstu_rates, precision=precision)

    if group == world_size:  # 1D
        result = plan_for(Topology(hardware.spec, world_size, local_world_size, device_type))
        return _planned(result, None, layout_of(world_size), module_path, ebc, compute_device, resident_bytes,
                        place, log)
    # 2D: the tables planned for one sharding group, the group size chosen (auto) or priced (N)
    choice = choose_group_size(world_size, local_world_size, hardware.spec, device_type, plan_for,
                               None if group is None else [group], pc.replica_sync_every, hardware.subgroups,
                               hardware.link_source, update)
    if log:
        logger.info("2D: %s", format_group_choice(choice).splitlines()[-1])
        logger.debug("sharding group sizes weighed:\n%s", format_group_choice(choice))
    layout = layout_of(choice.chosen, choice.use_inter_host_allreduce)
    return _planned(choice.plan, choice, layout, module_path, ebc, compute_device, resident_bytes, place, log)


def _planned(result: PlanResult, groups: GroupChoice | None, layout: ParallelLayout, module_path: str,
             ebc: nn.Module, compute_device: str, resident_bytes: int,
             place: Callable[[ShardingPlan], ShardingPlan], log: bool = False) -> PlannedJob:
    """The PlannedJob of a co-design (or given) plan of one sharding group: its torchrec plan, its slowest
    rank and each world rank's predicted memory (world rank r runs its group's rank layout.group_rank(r))."""
    if log:  # the console has the planner's line and the notes; the log file the whole report
        logger.debug("co-design plan:\n%s", format_report(result, advice=False))
        for note in result.notes:
            logger.info("plan note: %s", note)
    slowest = max(result.rank_perf, key=lambda p: p.total_s)  # its total_s is result.predicted_step_s
    plan = to_sharding_plan(result, module_path, ebc, compute_device)
    memory = predict_memory(result, resident_bytes)
    per_rank = tuple(memory[layout.group_rank(r)] for r in range(layout.world_size))
    return PlannedJob(place(plan), layout, result, groups, slowest, per_rank)
