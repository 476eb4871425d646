"""Planner value types and role interfaces. Units: bytes for memory, seconds for time inside the planner
(reports print ms), bytes/s for bandwidth."""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from anyrec.backends.dispatch import FBGEMM_EMBEDDING
from anyrec.backends.hardware import EmbeddingCost, HSTURates
from anyrec.backends.specs import DeviceSpec
from anyrec.choices import Precision
from anyrec.schema import HSTUShape

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1}


class ShardingType(StrEnum):
    """How one table is split over ranks (the names torchrec uses)."""

    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"


class ReplicaUpdate(StrEnum):
    """How 2D keeps a shard's replicas one model (`planner.replica_update`)."""

    AVERAGE = "average"  # torchrec's sync(): weights and optimizer state averaged every k steps
    GRADIENTS = "gradients"  # each step's embedding gradients exchanged before the fused update


class Placement(StrEnum):
    """Where a table's weights and optimizer state live."""

    HBM = "hbm"  # device memory (on a CPU compute device: host memory the process owns)
    UVM_CACHING = "uvm_caching"  # host memory, with a software cache of hot rows in HBM
    DDR = "ddr"  # host memory, read over the host<->device link on every lookup


ALL_SHARDINGS: tuple[ShardingType, ...] = tuple(ShardingType)
# Sharding types whose shards get their ranks at enumeration; the partitioner places the others' shards.
FIXED_RANK_SHARDINGS = {ShardingType.DATA_PARALLEL, ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE}


@dataclass(frozen=True)
class TableSpec:
    """One embedding table as the planner sees it; `pooling_factor`: mean ids per sample, all its features."""

    name: str
    num_rows: int
    embedding_dim: int
    pooling_factor: float
    feature_names: list[str]
    weight_dtype: str = "fp32"
    sequence: bool = False  # unpooled (torchrec's EmbeddingCollection): one output vector per id

    def __post_init__(self) -> None:
        if self.num_rows <= 0 or self.embedding_dim <= 0:
            raise ValueError(f"table {self.name}: num_rows and embedding_dim must be > 0")
        if self.pooling_factor < 0:
            raise ValueError(f"table {self.name}: pooling_factor must be >= 0")
        if self.weight_dtype not in DTYPE_BYTES:
            known = sorted(DTYPE_BYTES)
            raise ValueError(f"table {self.name}: unknown weight_dtype {self.weight_dtype!r}; known: {known}")
        if not self.feature_names:
            raise ValueError(f"table {self.name}: needs at least one feature name")

    @property
    def num_features(self) -> int:
        return len(self.feature_names)

    @property
    def bags_per_sample(self) -> float | int:
        """Output vectors per sample: one per feature pooled, one per id (its pooling factor) unpooled."""
        return self.pooling_factor if self.sequence else self.num_features

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def weight_bytes(self) -> int:
        return self.num_rows * self.embedding_dim * self.element_bytes


@dataclass(frozen=True)
class Topology:
    """The job's machines: `world_size` ranks of one DeviceSpec, `local_world_size` per host;
    `hbm_cap_bytes` / `ddr_cap_bytes` override the DeviceSpec capacities (e.g. a shared node)."""

    device: DeviceSpec
    world_size: int
    local_world_size: int | None = None
    # a torch device type (the backend's); default: DeviceSpec.torch_device_type
    compute_device: str | None = None
    hbm_cap_bytes: int | None = None
    ddr_cap_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.world_size <= 0:
            raise ValueError(f"world_size must be > 0, got {self.world_size}")
        local = self.local_world_size or min(self.world_size, 8)
        if local <= 0 or self.world_size % local != 0:
            raise ValueError(f"world_size {self.world_size} must be a multiple of local_world_size {local}")
        object.__setattr__(self, "local_world_size", local)
        compute = self.compute_device or self.device.torch_device_type
        # Any torch device type: "cpu" keeps tables in host memory, every other is an accelerator.
        if not (compute.isidentifier() and compute.islower()):
            raise ValueError(f"compute_device must be a torch device type, got {compute!r}")
        object.__setattr__(self, "compute_device", compute)

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def hbm_bytes_per_rank(self) -> int:
        return self.hbm_cap_bytes if self.hbm_cap_bytes is not None else self.device.memory_bytes

    @property
    def ddr_bytes_per_rank(self) -> int:
        if self.ddr_cap_bytes is not None:
            return self.ddr_cap_bytes
        # Unknown host memory: torchrec's default of 128 GB per rank.
        return self.device.host_memory_bytes or 128 * 10**9

    def host_of(self, rank: int) -> int:
        return rank // self.local_world_size


@dataclass(frozen=True)
class Storage:
    """Bytes one shard (or one rank) holds in device memory (HBM) and host memory (DDR)."""

    hbm_bytes: int = 0
    ddr_bytes: int = 0

    def __add__(self, other: Storage) -> Storage:
        return Storage(self.hbm_bytes + other.hbm_bytes, self.ddr_bytes + other.ddr_bytes)

    def fits_in(self, other: Storage) -> bool:
        return self.hbm_bytes <= other.hbm_bytes and self.ddr_bytes <= other.ddr_bytes


@dataclass(frozen=True)
class Perf:
    """Predicted seconds one shard (or one rank) spends per training step, by phase and kind."""

    fwd_compute_s: float = 0.0
    bwd_compute_s: float = 0.0
    fwd_comms_s: float = 0.0
    bwd_comms_s: float = 0.0

    def __add__(self, other: Perf) -> Perf:
        return Perf(self.fwd_compute_s + other.fwd_compute_s, self.bwd_compute_s + other.bwd_compute_s,
                    self.fwd_comms_s + other.fwd_comms_s, self.bwd_comms_s + other.bwd_comms_s)

    @property
    def compute_s(self) -> float:
        return self.fwd_compute_s + self.bwd_compute_s

    @property
    def comms_s(self) -> float:
        return self.fwd_comms_s + self.bwd_comms_s

    @functools.cached_property
    def total_s(self) -> float:
        # Cached: the search reads it for every shard of every candidate many times (frozen, so safe).
        return self.fwd_compute_s + self.bwd_compute_s + self.fwd_comms_s + self.bwd_comms_s


@dataclass
class Shard:
    """One piece of a table: its rows/columns, where it lives and what it costs on its rank."""

    num_rows: int
    num_cols: int
    storage: Storage
    perf: Perf
    rank: int | None = None  # None until the partitioner places it


@dataclass
class ShardingOption:
    """One way to shard and place a table: sharding type, placement, compute kernel and its shards."""

    table: TableSpec
    sharding: ShardingType
    placement: Placement
    compute_kernel: str  # torchrec compute kernel: the embedding Impl's for the placement, or "dense"
    shards: list[Shard]
    host: int | None = None  # table-row-wise: the host whose ranks hold the rows
    cache_ratio: float = 0.0  # uvm_caching: fraction of rows cached in HBM

    @property
    def ranks_fixed(self) -> bool:
        return self.sharding in FIXED_RANK_SHARDINGS

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def total_perf_s(self) -> float:
        return sum(s.perf.total_s for s in self.shards)

    @property
    def total_storage(self) -> Storage:
        # Summed as ints, not Storage.__add__: the planner reads this for every option of every table.
        shards = self.shards
        return Storage(sum(s.storage.hbm_bytes for s in shards), sum(s.storage.ddr_bytes for s in shards))

    @property
    def ranks(self) -> list[int]:
        return [s.rank for s in self.shards if s.rank is not None]

    def label(self) -> str:
        k = f"x{self.num_shards}" if self.sharding == ShardingType.COLUMN_WISE else ""
        h = f"@host{self.host}" if self.host is not None else ""
        return f"{self.sharding.value}{k}{h}/{self.placement.value}"


@dataclass
class PlanOptions:
    """Knobs the caller (trainer, CLI) sets; defaults suit a GPU training job."""

    allowed_shardings: tuple[ShardingType, ...] = ALL_SHARDINGS
    allowed_placements: tuple[Placement, ...] = tuple(Placement)
    # The embedding implementation's record and the profiles it is costed with on the hardware at hand
    # (Hardware.embedding_cost); FBGEMM's with its built-in profiles by default.
    embedding: EmbeddingCost = field(default_factory=lambda: EmbeddingCost.builtin(FBGEMM_EMBEDDING))
    uvm_cache_ratio: float = 0.2  # HBM cache rows / table rows for uvm_caching (torchrec's default)
    # An extra margin of HBM kept free, on top of what the memory model predicts (the allocator's slack
    # and the runtime's reserved bytes are predicted, not a fraction: anyrec.planner.memory).
    reserve_fraction: float = 0.0
    # Bytes the job keeps on each device besides the model and its batches (the data source's tensors)
    resident_bytes: int = 0
    pipeline_depth: int = 3  # batches in flight: copies of input/output buffers (TrainPipelineSparseDist)
    max_column_shards: int = 8  # most column-wise pieces considered per table
    exhaustive_limit: int = 20_000  # search spaces at most this large are solved exactly
    # The dense part's precision, as the job's backend resolved it (Backend.dense_precision); auto (a device
    # planned offline): the spec's `auto_precision` (bf16 on an accelerator with bf16 autocast), fp32 on a
    # CPU. It picks the peak FLOP/s and an HSTU part's activation bytes.
    dense_dtype: Precision = Precision.auto
    # The dense part's bytes per sample alive at the forward's end (its activations), during the lookups,
    # and while the backward reaches the embeddings (job.dense_memory_per_sample)
    dense_activation_bytes_per_sample: int = 0
    dense_lookup_bytes_per_sample: int = 0
    dense_gradient_bytes_per_sample: int = 0
    dense_features: int = 0  # dense input features per sample (the batch's dense tensor)
    id_zipf_exponent: float = 0.0  # ids' popularity ~ 1 / rank^s (0: uniform): rows touched per step
    interaction_pairs: int = 0  # per sample (DeviceSpec.step_per_pair_s each): see job.interaction_pairs
    dense_tensors: int = 0  # parameter tensors of the dense model (DeviceSpec.step_per_dense_tensor_s each)
    # forward + backward FLOPs of the dense model per sample, where the model states them (attention's
    # grow with the sequence, not the parameters); 0: 6 per dense parameter (a matmul's 2 + 4)
    dense_flops_per_sample: float = 0.0
    # An HSTU dense part (DLRMv4): its STU layers' time and memory are costed from its sizes
    # (anyrec.planner.sequence), with the attention implementation's efficiency (measured where
    # `hstu_rates` has its implementation at the job's shapes: Hardware.attention);
    # `activation_recompute`: each STU layer keeps only its input and recomputes the rest in the backward
    hstu: HSTUShape | None = None
    attention_impl: str = "triton"
    hstu_rates: tuple[HSTURates, ...] = ()
    activation_recompute: bool = False

    def __post_init__(self) -> None:
        self.allowed_shardings = tuple(ShardingType(s) for s in self.allowed_shardings)
        self.allowed_placements = tuple(Placement(p) for p in self.allowed_placements)
        if not self.allowed_shardings:
            raise ValueError("allowed_shardings is empty")
        if not self.allowed_placements:
            raise ValueError("allowed_placements is empty")
        if not 0.0 < self.uvm_cache_ratio <= 1.0:
            raise ValueError(f"uvm_cache_ratio must be in (0, 1], got {self.uvm_cache_ratio}")
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")
        if self.pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {self.pipeline_depth}")


@dataclass
class Workload:
    """Everything about the job except the topology: the tables, batch, optimizer, dense model."""

    tables: list[TableSpec]
    batch_size_per_rank: int
    optimizer: str
    dense_param_count: int = 0
    options: PlanOptions = field(default_factory=PlanOptions)


class ShardEstimator(abc.ABC):
    """Predicts one cost of every shard of a sharding option (torchrec's split: a perf estimator fills
    `perf`, a storage estimator `storage`)."""

    @abc.abstractmethod
    def estimate(self, option: ShardingOption, topology: Topology, workload: Workload) -> None:
        """Fill this estimator's field of every shard of `option`."""


class Enumerator(abc.ABC):
    """Lists the candidate sharding options for each table."""

    @abc.abstractmethod
    def enumerate(self, topology: Topology, workload: Workload,
                  placements: dict[str, tuple[Placement, ...]]) -> dict[str, list[ShardingOption]]:
        """Options per table name, restricted to each table's allowed placements."""


class Partitioner(abc.ABC):
    """Picks one option per table and assigns ranks to its shards, minimising the slowest rank."""

    @abc.abstractmethod
    def partition(self, options: dict[str, list[ShardingOption]], topology: Topology, base_per_rank: RankCost,
                  caps: Storage) -> dict[str, ShardingOption] | None:
        """The chosen option per table with ranks set, or None when nothing fits `caps`."""


class Proposer(abc.ABC):
    """Decides which placements each table may use, escalating HBM -> UVM caching -> DDR."""

    @abc.abstractmethod
    def proposals(self, options: dict[str, list[ShardingOption]], topology: Topology, free: Storage,
                  workload: Workload) -> list[dict[str, tuple[Placement, ...]]]:
        """Placement restrictions to try, in order; the planner stops at the first that partitions."""


def sharding_groups(options: Iterable[ShardingOption]) -> int:
    """How many sharding types the sharded (not data-parallel) `options` use."""
    return len({o.sharding for o in options if o.sharding != ShardingType.DATA_PARALLEL})


@dataclass(frozen=True)
class RankCost:
    """Per-rank cost that does not depend on the embedding plan: dense model, buffers, reserve."""

    storage: Storage
    perf: Perf


class InfeasiblePlanError(ValueError):
    """No plan fits: the message names what does not fit, the bytes needed and available, and what would."""


@dataclass
class PlanResult:
    """A plan: the chosen option (with ranks) per table, and the predicted per-rank cost (presentation is
    in `report`; `torchrec_plan.to_sharding_plan` makes a torchrec ShardingPlan of it)."""

    tables: dict[str, ShardingOption]
    topology: Topology
    workload: Workload
    base: RankCost  # per-rank dense model and local-batch buffers
    caps: Storage  # usable per-rank bytes (HBM less reserve, DDR)
    solver: str  # "exhaustive" (exact) | "greedy" | "given" (costed, not searched)
    plan_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    options_by_table: dict[str, list[ShardingOption]] = field(default_factory=dict, repr=False)
    # Seconds per step of each group of sharded tables (one per sharding type used: torchrec gives each
    # its own input and output all-to-alls); every rank takes part in every group's collectives.
    group_s: float = 0.0
    # 2D sparse parallelism (this plan is one sharding group's, `replicas` groups in the world): seconds per
    # step each rank pays beyond the group's own collectives, averaging the replicas and the dense
    # all-reduce over the whole world (anyrec.planner.twod.price_group)
    replica_s: float = 0.0
    replicas: int = 1
    replica_update: ReplicaUpdate = ReplicaUpdate.AVERAGE

    def _per_rank(self, base, of: Callable[[Shard], Any]) -> list:
        """`base` plus `of(shard)` summed over the shards each rank holds."""
        out = [base] * self.topology.world_size
        for opt in self.tables.values():
            for s in opt.shards:
                out[s.rank] = out[s.rank] + of(s)
        return out

    @property
    def rank_storage(self) -> list[Storage]:
        return self._per_rank(self.base.storage, lambda s: s.storage)

    @property
    def sharding_groups(self) -> int:
        """Sharding types used by sharded (not data-parallel) tables."""
        return sharding_groups(self.tables.values())

    @property
    def group_perf(self) -> Perf:
        """Every rank's per-step cost of the plan's sharding groups (in the comms columns)."""
        s = self.sharding_groups * self.group_s
        return Perf(0.0, 0.0, s / 3, 2 * s / 3)

    @property
    def rank_perf(self) -> list[Perf]:
        base = self.base.perf + self.group_perf + Perf(0.0, 0.0, 0.0, self.replica_s)
        return self._per_rank(base, lambda s: s.perf)

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
