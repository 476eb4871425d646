"""Structured config schemas (Hydra ConfigStore) and where the YAML config groups live. Library code
takes these dataclasses (or plain values); `DictConfig` stops at the entry points."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from anyrec.choices import Precision, Switch, parse_switch


def config_dir() -> Path:
    """The Hydra config groups: shipped inside the package when installed, else the repo's `configs/`."""
    here = Path(__file__).resolve().parent
    folders = [here / "configs", here.parent / "configs"]
    for folder in folders:
        if (folder / "config.yaml").is_file():
            return folder
    raise FileNotFoundError(f"anyrec config groups not found in {folders[0]} or {folders[1]}")


# Closed choices are enums: a value outside them fails when the config is composed, before any
# process group starts. StrEnum's functional form gives each member its own name as value, so they
# compare and print as the strings.
Interaction = StrEnum("Interaction", "dot dcn")
OnMalformed = StrEnum("OnMalformed", "error skip")
DenseTransform = StrEnum("DenseTransform", "torchrec log1p")
SparseOps = StrEnum("SparseOps", "auto fbgemm portable")
PlannerName = StrEnum("PlannerName", "codesign simple")
Sharding = StrEnum("Sharding", "auto table_wise row_wise column_wise table_row_wise data_parallel")
Optimizer = StrEnum("Optimizer", "sgd adagrad rowwise_adagrad adam")
Calibrate = StrEnum("Calibrate", "auto always never")
CalibrationSize = StrEnum("CalibrationSize", "small large quick")
TablePrecision = StrEnum("TablePrecision", "fp32 fp16 int8")
IdLayout = StrEnum("IdLayout", "offsets lengths")
Split = StrEnum("Split", "train eval")
Int8Kernel = StrEnum("Int8Kernel", "auto fbgemm torch")
ReplicaUpdateChoice = StrEnum("ReplicaUpdateChoice", "auto average gradients")
GroupWord = StrEnum("GroupWord", "world auto")
# model.hstu.stu_recompute: what an STU layer's backward recomputes rather than keeps: selective (the input
# norm, the UVQK projection and the gated output, as the MLPerf DLRMv4 reference) or none
STURecompute = StrEnum("STURecompute", "selective none")

# Choices a word or a number (`auto|N`), and auto|true|false (which the command line gives as a bool), are
# no OmegaConf type: their schema type is Any, and each is parsed once, where its section is built (the
# dataclass's __post_init__, which OmegaConf.to_object calls), into the typed value library code reads.
GroupSize = GroupWord | int  # planner.sharding_group_size: world (1D), auto (the planner chooses) or N ranks


def parse_stu_recompute(value: object) -> STURecompute:
    """`model.hstu.stu_recompute` (selective or none, any case) as an STURecompute; ValueError in one line."""
    if isinstance(value, STURecompute):
        return value
    word = str(value).strip().lower()
    if word not in STURecompute.__members__:
        choices = " or ".join(STURecompute.__members__)
        raise ValueError(f"model.hstu.stu_recompute={value!r}: choose {choices}")
    return STURecompute[word]


def _count(value: object) -> int | None:
    """A positive whole number given as an int or its digits; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 1 else None
    text = str(value).strip()
    return int(text) if text.isdigit() and int(text) >= 1 else None


def parse_threads(value: object) -> int | None:
    """`backend.threads`: None for auto, else a thread count >= 1; ValueError in one line."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    n = _count(value)
    if n is None:
        raise ValueError(f"backend.threads={value!r}: choose auto or a thread count >= 1")
    return n


def parse_group_size(value: object) -> GroupSize:
    """`planner.sharding_group_size`: world, auto or a number of ranks >= 1 (that it divides the world size
    is checked where the world size is known, `anyrec.planner.planned`); ValueError in one line."""
    if isinstance(value, GroupWord):
        return value
    word = str(value).strip().lower()
    if word in GroupWord.__members__:
        return GroupWord[word]
    n = _count(value)
    if n is None:
        raise ValueError(f"planner.sharding_group_size={value!r}: expected world, auto or a number of "
                         f"ranks >= 1")
    return n


@dataclass
class ModelConfig:
    """A model: its family (`anyrec.models.family`), tables, MLPs and the interaction."""

    name: str = MISSING
    family: str = "dlrm"  # dlrm (DLRM, DLRMv2) | dlrmv4 (HSTU over user sequences)
    interaction: Interaction = Interaction.dot
    embedding_dim: int = 16
    num_dense_features: int = 13
    table_rows: list[int] = field(default_factory=list)  # one table per sparse feature
    multi_hot: list[int] = field(default_factory=list)  # ids per sample per feature (empty: all 1)
    bottom_mlp: list[int] = field(default_factory=list)  # last width == embedding_dim for dot
    top_mlp: list[int] = field(default_factory=list)  # last width == 1
    dcn_num_layers: int = 3
    dcn_low_rank: int = 512
    # family dlrmv4: anyrec.models.hstu.DLRMv4Config fields, and `table_scale` (every table that x the
    # reference's rows)
    hstu: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    """Where batches come from; `batch_size` is per rank (or derived from `global_batch_size`)."""

    name: str = "synthetic"  # synthetic | criteo_tsv | criteo_npy | criteo_multihot
    batch_size: int = 256
    global_batch_size: int | None = None  # if set: batch_size = global_batch_size / world size
    # synthetic
    zipf_exponent: float = 1.05  # id popularity ~ 1/rank^s; 0 = uniform
    signal_scale: float = 2.5  # std of the hidden click logit: higher = more learnable
    id_range_scale: float = 1.0  # ids drawn from [0, scale * rows): > 1 makes out-of-range ids
    # Criteo files
    path: str | None = None  # directory holding the files below
    train_files: list[str] = field(default_factory=list)  # TSV names, or npy prefixes ("day_0")
    eval_files: list[str] = field(default_factory=list)  # empty: evaluate on the train files
    on_malformed: OnMalformed = OnMalformed.error  # skip: count them and report the count
    hash_ids: bool = True  # ids modulo the table size (Criteo ids are 32-bit hashes)
    dense_transform: DenseTransform = DenseTransform.torchrec  # TSV; torchrec: log(x - min + 2) (tsv_to_npys)
    prefetch: int = 2  # batches made ahead by background threads (files; synthetic on a CPU); 0 = in the step
    prefetch_workers: int = 1  # threads making them (order is kept either way)
    # sequence sources (yambda_synthetic, yambda): anyrec.sequence_schema.SequenceDataConfig fields, checked
    # with the other values when the typed config is built (anyrec._hydra.to_object)
    sequence: dict[str, Any] = field(default_factory=dict)


@dataclass
class BackendConfig:
    """Which backend drives the run and which kernel serves each op."""

    name: str = "auto"  # auto | cpu | cuda | rocm | an installed plugin's name
    embedding_kernel: str = "auto"  # auto | fbgemm | triton | torch
    interaction_kernel: str = "auto"  # auto | triton | torch
    dcn_kernel: str = "auto"  # auto | triton | torch
    attention_kernel: str = "auto"  # HSTU attention: auto | triton | torch
    # FBGEMM sparse ops of torchrec's sharded path: auto (FBGEMM where it has a kernel for the device,
    # pure-torch kernels elsewhere) | fbgemm | portable (pure torch everywhere, overriding FBGEMM)
    sparse_ops: SparseOps = SparseOps.auto
    # CPU, several ranks per host: bind each rank's threads to its share of the cores (false: threads
    # float, their count still split; auto: bind unless other processes use the cores, backends/core_load)
    bind_cores: Any = Switch.auto  # auto | true | false: a Switch once built
    # CPU: torch threads per rank: auto (the job's own step timed at each candidate count during warm-up,
    # the fastest kept, timed again when the load changes; backends/threads.py) | N (fixed)
    threads: Any = None  # auto | N: None (auto) or N once built

    def __post_init__(self) -> None:
        self.bind_cores = parse_switch("backend.bind_cores", self.bind_cores)
        self.threads = parse_threads(self.threads)


@dataclass
class HardwareConfig:
    """The device the planner reasons about (`anyrec.backends.resolve_hardware` resolves it). A calibrated
    YAML has this shape, so besides `hardware.sku=FILE` it is also a group option (`hardware=NAME`, its
    folder on Hydra's searchpath), its measurements then in `measurements`."""

    sku: str = "auto"  # auto | a SKU name | /path/to/hardware.yaml
    spec: dict[str, Any] = field(default_factory=dict)  # DeviceSpec field overrides
    measurements: dict[str, Any] = field(default_factory=dict)  # calibration extras (per kernel)


@dataclass
class PlannerConfig:
    """How embedding tables get their sharding."""

    name: PlannerName = PlannerName.codesign
    sharding: Sharding = Sharding.auto  # auto, or force one sharding type for every table
    allow_uvm: bool = True
    uvm_cache_ratio: float = 0.2
    # HBM kept free on top of the predicted peak (the memory model predicts the allocator's slack; the
    # device spec says what the runtime keeps outside the allocator): an optional extra margin
    memory_reserve_fraction: float = 0.0
    # 2D sparse parallelism: tables sharded within groups of this many ranks, each group a replica of
    # the others (torchrec's DMPCollection). world: one group of every rank (1D); auto: the size the
    # co-design model predicts fastest among those that fit; N: a divisor of the world size.
    sharding_group_size: Any = GroupWord.world  # a GroupSize once built
    replica_sync_every: int = 1  # steps between the replicas' weight averaging (2D only)
    # 2D: how the replicas stay one model. average: torchrec's averaging of weights and optimizer state
    # (1D's update for SGD only); gradients: each step's embedding gradients exchanged before the fused
    # update (1D's update for every optimizer); auto: gradients for a stateful optimizer averaged every
    # step, else average
    replica_update: ReplicaUpdateChoice = ReplicaUpdateChoice.auto

    def __post_init__(self) -> None:
        self.sharding_group_size = parse_group_size(self.sharding_group_size)


@dataclass
class OptimConfig:
    """Embedding (fused) and dense optimizers, gradient clipping and the learning-rate schedule."""

    name: Optimizer = Optimizer.adagrad
    dense_name: Optimizer | None = None  # the dense part's optimizer; None: `name`'s
    embedding_lr: float = 0.05
    dense_lr: float = 0.05
    eps: float = 1e-8
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # max L2 norm of the dense gradients; 0 = no clipping
    # Schedule (MLPerf DLRM style): linear warmup from 0, constant, then polynomial decay to
    # `end_lr_factor` x lr over `decay_steps` steps starting at `decay_start_step`.
    warmup_steps: int = 0
    decay_start_step: int = 0
    decay_steps: int = 0  # 0 = no decay
    decay_power: float = 2.0
    end_lr_factor: float = 0.0


@dataclass
class CheckpointConfig:
    """torch.distributed.checkpoint snapshots; off unless `dir` is set."""

    dir: str | None = None  # a run pointed at a directory with a checkpoint resumes from the latest
    every: int = 0  # steps between checkpoints; 0 = only at the end of training
    keep: int = 2  # the last k complete checkpoints stay; older ones are deleted
    resume: bool = True  # resume from the latest checkpoint in `dir` when there is one
    verify: bool = True  # check the files' SHA-256 before loading (the ranks share the reading)
    # A directory belongs to one run lineage (meta.json records it): resume=false on a directory
    # holding checkpoints is refused unless overwrite=true (then they go once this run has saved).
    overwrite: bool = False
    resume_from: str | None = None  # a compatible checkpoint of another lineage to start from
    on_signal: bool = True  # SIGINT/SIGTERM: stop at the next step boundary and save first


@dataclass
class TrainerConfig:
    """The training loop, evaluation, logging and checkpoints."""

    steps: int = 300
    seed: int = 0
    eval_steps: int = 20  # batches per rank per evaluation; 0 = none (a stream evaluates whole windows)
    evaluate: bool = True  # false: no evaluation at all, a stream's windows included (the steps only)
    eval_every: int = 0  # steps between evaluations; 0 = only at the end
    log_every: int = 25
    # >0: the last N steps run under torch.profiler (after a warm-up step), out of measured_step_ms; the
    # summary's step_breakdown_ms splits them per rank (forward, backward, optimizer, other, collectives)
    breakdown_steps: int = 0
    progress: bool = True
    pipeline: bool = True  # torchrec TrainPipelineSparseDist (input dist overlapped with compute)
    mixed_precision: Precision = Precision.auto  # auto: bf16 autocast on accelerators, fp32 on CPU
    # the dense model (MLPs, interaction, loss) through torch.compile: auto | true | false
    # (anyrec.trainer.compile; auto: when the saving over the job's steps exceeds the compile time)
    compile: Any = Switch.auto  # a Switch once built
    skip_nonfinite: bool = False  # NaN/inf loss or dense inputs of a training batch: skip it, not stop
    validate_inputs: bool = True  # check ids and feature counts of every batch before it is used
    run_dir: str | None = None  # JSONL/TensorBoard logs; the entry point sets Hydra's output dir
    tensorboard: bool = True
    fingerprint_weights: bool = False  # put a SHA-256 of all weights in the summary (slow if huge)
    collective_timeout_s: float = 600.0  # a rank waiting this long on a peer fails the job
    peer_timeout_s: float = 60.0  # a rank whose heartbeat stands still this long is named, the job fails
    # hardware=auto: plan with this machine's cached calibration, measured on first contact (auto),
    # measured again (always), or the backend's datasheet figures (never); anyrec.history.cache
    calibrate: Calibrate = Calibrate.auto
    calibrate_budget_s: float = 0.01  # seconds each timed measurement of that quick calibration repeats
    stop_check_every: int = 10  # steps between the ranks' checks for a stop request (a signal)
    stop_grace_s: float = 10.0  # a rank not stopped this long after a signal exits without a checkpoint
    # A file holding the HMAC key that signs checkpoint manifests, calibration cache entries and parity
    # records (unsigned or foreign ones are then refused); unset: $ANYREC_SIGNING_KEY, else no signing
    signing_key_file: str | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        self.compile = parse_switch("trainer.compile", self.compile)


@dataclass
class TopologyConfig:
    """The cluster shape the planner plans for (training uses the real one)."""

    world_size: int = 1
    local_world_size: int | None = None  # ranks per host; default: all on one host


@dataclass
class PlanConfig:
    """Options of `anyrec-plan`."""

    output: str | None = None  # JSON plan
    plot: str | None = None  # PNG picture
    compare: str | None = None  # a second SKU (or YAML) to plan side by side
    batch_size: int | None = None  # per rank; default: data.batch_size


@dataclass
class CalibrationConfig:
    """Options of `anyrec.calibrate`; it measures on `backend.name`, ranks bound as `backend.bind_cores`."""

    output: str | None = None  # the hardware YAML to write (hardware.sku=FILE takes it)
    cache: bool = False  # also write this machine's cache entry, the one hardware=auto reads
    budget_s: float = 0.5  # seconds each timed measurement repeats
    # seconds from the job's start (start-up included) by which a calibration ends (anyrec.calibrate, and a
    # training job's first contact); what is not measured by then keeps the datasheet's figures, said so
    time_limit_s: float = 100.0
    size: CalibrationSize = CalibrationSize.small  # quick: what a training job measures on first contact


@dataclass
class ParityConfig:
    """Options of `anyrec-parity`: the variants of the base job, the tolerances, the record files."""

    variants: list[str] = field(default_factory=list)  # each: Hydra overrides, nproc=N, NAME=VALUE (env)
    loss_rtol: float = 1e-5  # largest relative per-step loss difference from the first variant
    weight_atol: float = 1e-5  # largest absolute weight difference
    save: str | None = None  # write every variant's record here (JSON)
    against: str | None = None  # compare with the first record of such a file (written elsewhere)
    timeout_s: float = 900.0  # per variant; past it the variant is killed with its process group


@dataclass
class ExportConfig:
    """Options of `anyrec-export`: a checkpoint to one scoring artifact (`torch.export`, `.pt2`)."""

    checkpoint: str | None = None  # a step_<n> folder, or a trainer.checkpoint.dir (its newest checkpoint)
    output: str | None = None  # the .pt2 file to write
    precision: TablePrecision = TablePrecision.fp32  # tables: fp32 | fp16 | int8 (row-wise)
    id_layout: IdLayout = IdLayout.offsets  # each feature's bags as batch + 1 offsets, or batch lengths
    # int8 lookups: fbgemm (torch's own FBGEMM 8-bit row-wise op, CPU), torch (plain ops, any device),
    # auto (fbgemm where this torch has it)
    int8_kernel: Int8Kernel = Int8Kernel.auto


@dataclass
class PredictConfig:
    """Options of `anyrec-predict`: score a data split with an artifact."""

    artifact: str | None = None  # the .pt2 file anyrec-export wrote
    split: Split = Split.eval
    steps: int | None = None  # batches per rank read; default: trainer.eval_steps
    world_size: int = 1  # read the rows these many training ranks read (the training run's world size)
    output: str | None = None  # scores (click probabilities, float32) as .npy


@dataclass
class AnyrecConfig:
    """The whole job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    calibrate: CalibrationConfig = field(default_factory=CalibrationConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)


@dataclass(frozen=True)
class Range:
    """The values a numeric option takes: from `low` to `high` (None: unbounded on that side), an end
    excluded where `*_open` says so, always finite; a list option's items each, the list non-empty where
    `nonempty` says so. `None` (an option left unset) is always taken. `words` says it for the user."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    nonempty: bool = False
    words: str = ""

    def admits(self, value: float) -> bool:
        """Whether one number lies in the range (NaN and infinities never do)."""
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """The range in words: ">= 1", "in (0, 1]", "a positive number of seconds (at most 1e+06)"."""
        if self.words:
            return self.words
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}"
                    f"{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return "a finite number"


def _num(bound: float) -> str:
    """A range's end as written: whole numbers without a decimal point, large ones with an exponent."""
    return f"{bound:g}" if abs(bound) >= 1e6 or not float(bound).is_integer() else str(int(bound))


COUNT = Range(1)  # ranks, batch sizes, widths, rows: at least one
STEPS = Range(0)  # a number of steps or batches where 0 means none (or "only at the end")
POSITIVE = Range(0, low_open=True)
FRACTION = Range(0, 1)
# Seconds a wait or a budget lasts: positive, and at most ~11.6 days (past that, a timedelta or a
# store's millisecond timeout overflows, and a user meant "forever", which anyrec does not offer)
SECONDS = Range(0, 1e6, low_open=True, words="a positive number of seconds (at most 1e+06)")

# Every numeric option of the schema and its range: checked once, when the typed config is built
# (`check_values`, run by `anyrec._hydra.to_object` for every entry point). tests/test_config.py holds
# this table to the schema: a numeric option without a range fails it.
RANGES: dict[str, Range] = {
    "model.embedding_dim": COUNT,
    "model.num_dense_features": COUNT,
    "model.table_rows": Range(1, nonempty=True),
    "model.multi_hot": COUNT,
    "model.bottom_mlp": COUNT,
    "model.top_mlp": COUNT,
    "model.dcn_num_layers": COUNT,
    "model.dcn_low_rank": COUNT,
    "data.batch_size": COUNT,
    "data.global_batch_size": COUNT,
    "data.zipf_exponent": Range(0),
    "data.signal_scale": Range(0),
    "data.id_range_scale": POSITIVE,
    "data.prefetch": Range(0),
    "data.prefetch_workers": COUNT,
    "planner.uvm_cache_ratio": Range(0, 1, low_open=True),
    "planner.memory_reserve_fraction": Range(0, 1, high_open=True),
    "planner.replica_sync_every": COUNT,
    "optim.embedding_lr": POSITIVE,
    "optim.dense_lr": POSITIVE,
    "optim.eps": POSITIVE,
    "optim.betas": Range(0, 1, high_open=True),
    "optim.weight_decay": Range(0),
    "optim.grad_clip_norm": Range(0),
    "optim.warmup_steps": STEPS,
    "optim.decay_start_step": STEPS,
    "optim.decay_steps": STEPS,
    "optim.decay_power": Range(0),
    "optim.end_lr_factor": FRACTION,
    "trainer.steps": STEPS,
    "trainer.seed": Range(0, 2**63 - 1),
    "trainer.eval_steps": STEPS,
    "trainer.eval_every": STEPS,
    "trainer.log_every": STEPS,
    "trainer.breakdown_steps": STEPS,
    "trainer.collective_timeout_s": SECONDS,
    "trainer.peer_timeout_s": SECONDS,
    "trainer.calibrate_budget_s": SECONDS,
    "trainer.stop_check_every": COUNT,
    "trainer.stop_grace_s": SECONDS,
    "trainer.checkpoint.every": STEPS,
    "trainer.checkpoint.keep": COUNT,
    "topology.world_size": COUNT,
    "topology.local_world_size": COUNT,
    "plan.batch_size": COUNT,
    "calibrate.budget_s": SECONDS,
    "calibrate.time_limit_s": SECONDS,
    "parity.loss_rtol": POSITIVE,
    "parity.weight_atol": POSITIVE,
    "parity.timeout_s": SECONDS,
    "predict.steps": COUNT,
    "predict.world_size": COUNT,
}


def _option(cfg: AnyrecConfig, key: str) -> Any:
    """The value at a dotted key of the typed config."""
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def check_values(cfg: AnyrecConfig) -> None:
    """Raise ValueError, one line naming the option and its range, for the first numeric option outside
    its range (`RANGES`); relations between options are checked where they are used."""
    for key, allowed in RANGES.items():
        value = _option(cfg, key)
        if value is None:
            continue
        if isinstance(value, list):
            if (allowed.nonempty and not value) or not all(allowed.admits(v) for v in value):
                need = "a non-empty list" if allowed.nonempty else "a list"
                raise ValueError(f"{key} must be {need}, each {allowed.describe()}, got {value}")
        elif not allowed.admits(value):
            raise ValueError(f"{key} must be {allowed.describe()}, got {value}")
