"""From a job's model and config to planner inputs, as the trainer and `anyrec-plan` share them: tables and
dense parameters from the model itself (the trainer's, or `anyrec-plan`'s on the meta device), ids per
sample and the dense part's per-sample facts from the model family (`anyrec.schema.WorkloadFacts`)."""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Callable, Sequence

from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

from anyrec.backends.dispatch import implementations
from anyrec.backends.hardware import EmbeddingCost, HSTURates
from anyrec.config import PlannerConfig, Precision
from anyrec.planner.estimators import inexact_update_reason
from anyrec.planner.planner import CoDesignPlanner
from anyrec.planner.types import InfeasiblePlanError, Placement, PlanResult, ShardingType, TableSpec, Topology
from anyrec.schema import WorkloadFacts

logger = logging.getLogger(__name__)

# torchrec runs a replicated table on the CPU with FBGEMM's dense TBE, whose CPU kernel computes the weight
# gradient inside its own autograd function; torch still warns on every rank that the op has no Autograd
# kernel and "may lead to silently incorrect behavior". The gradient is exact (tests/test_replicated_cpu.py
# compares it with a reference), so where anyrec replicates tables that warning is filtered, not shown as
# a fault.
BENIGN_DENSE_TBE_WARNING = (r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not "
                            r"registered")
_said: set[tuple[str, str]] = set()


def quiet_dense_tbe_warning() -> None:
    """Filter torch's benign warning about FBGEMM's CPU dense TBE (see above): every rank that trains
    replicated tables calls it."""
    warnings.filterwarnings("ignore", message=BENIGN_DENSE_TBE_WARNING, category=UserWarning)


def _replicating_every_table(optimizer: str, reason: str, device_type: str) -> None:
    """Say once why every table is replicated; quiet torch's benign warning about the kernel running them."""
    if (optimizer, reason) not in _said:
        _said.add((optimizer, reason))
        able = " or ".join(i.name for i in implementations("embedding")
                           if i.fused_update_reason(optimizer, device_type) is None) or "none"
        logger.info("optim=%s: every table is replicated (data_parallel) because %s; anyrec updates them "
                    "with the same %s rule (backend.embedding_kernel= %s would shard them)", optimizer,
                    reason, optimizer, able)
    quiet_dense_tbe_warning()


# what torchrec's EmbeddingCollection sharder shards (its data-parallel tables are not planned here)
SEQUENCE_SHARDINGS = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)
WEIGHT_DTYPES = {DataType.FP32: "fp32", DataType.FP16: "fp16", DataType.BF16: "bf16", DataType.INT8: "int8"}


def collection_configs(collection: nn.Module) -> list[BaseEmbeddingConfig]:
    """The table configs of an embedding collection: a torchrec EmbeddingCollection's (unpooled) or an
    EmbeddingBagCollection's (torchrec's or anyrec's own)."""
    if isinstance(collection, EmbeddingCollection):
        return collection.embedding_configs()
    return collection.embedding_bag_configs()


def model_tables(configs: Sequence[BaseEmbeddingConfig], facts: WorkloadFacts) -> list[TableSpec]:
    """One TableSpec per embedding table of the model; pooling = ids per sample over its features (the
    model's `facts`); an EmbeddingConfig's table is unpooled (a sequence: one output per id)."""
    hot = facts.lookups_per_sample
    return [
        TableSpec(name=c.name, num_rows=c.num_embeddings, embedding_dim=c.embedding_dim,
                  pooling_factor=float(sum(hot.get(f, 1) for f in c.feature_names)),
                  feature_names=list(c.feature_names), weight_dtype=WEIGHT_DTYPES.get(c.data_type, "fp32"),
                  sequence=isinstance(c, EmbeddingConfig))
        for c in configs
    ]


def dense_parameters(model: nn.Module, ebc: nn.Module) -> list[nn.Parameter]:
    """Parameters of `model` outside its EmbeddingBagCollection `ebc` (replicated on every rank; each
    tensor has a per-step gradient and optimizer update)."""
    sparse = {id(p) for p in ebc.parameters()}
    return [p for p in model.parameters() if id(p) not in sparse]


def plan_options(cfg: PlannerConfig, embedding: EmbeddingCost, optimizer: str,
                 device_type: str | None = None) -> dict[str, object]:
    """PlanOptions fields from the `planner` config group for `embedding` (the implementation and its
    profiles) on a `device_type` device (None: any). Only what the implementation runs is offered: no
    sharded tables where its fused update lacks `optimizer` on the device (the trainer refuses those by
    the same record); a forced `planner.sharding` it cannot run, or that would change `optimizer`'s
    update, is a ValueError."""
    impl = embedding.impl
    placements = tuple(p for p in Placement if p.value in impl.compute_kernels)
    shardings = tuple(s for s in ShardingType if s != ShardingType.DATA_PARALLEL or impl.data_parallel)
    no_fused = impl.fused_update_reason(optimizer, device_type) if device_type else None
    if no_fused is not None:
        shardings = tuple(s for s in shardings if s == ShardingType.DATA_PARALLEL)
        if not shardings:
            raise ValueError(f"optim={optimizer}: {no_fused} and cannot replicate tables")
        _replicating_every_table(optimizer, no_fused, device_type)
    opts: dict[str, object] = {"embedding": embedding, "uvm_cache_ratio": cfg.uvm_cache_ratio,
                               "reserve_fraction": cfg.memory_reserve_fraction,
                               "allowed_placements": placements if cfg.allow_uvm else (Placement.HBM,),
                               "allowed_shardings": shardings}
    if cfg.sharding != "auto":
        valid = [s.value for s in ShardingType]
        if cfg.sharding not in valid:
            raise ValueError(f"planner.sharding={cfg.sharding!r} is not one of auto, {', '.join(valid)}")
        if no_fused is not None and cfg.sharding != ShardingType.DATA_PARALLEL:
            raise ValueError(f"planner.sharding={cfg.sharding} with optim={optimizer}: {no_fused}")
        if ShardingType(cfg.sharding) not in shardings:
            raise ValueError(f"planner.sharding={cfg.sharding} cannot run with "
                             f"backend.embedding_kernel={impl.name}")
        reason = inexact_update_reason(optimizer, cfg.sharding)
        if reason is not None:
            raise ValueError(f"planner.sharding={cfg.sharding}: {reason}")
        opts["allowed_shardings"] = (ShardingType(cfg.sharding),)
    return opts


def planner_inputs(model: nn.Module, ebc: nn.Module, facts: WorkloadFacts, cfg_planner: PlannerConfig,
                   optimizer: str, embedding: EmbeddingCost, device_type: str | None = None,
                   attention_impl: str = "triton", hstu_rates: tuple[HSTURates, ...] = (),
                   precision: Precision = Precision.auto) -> tuple[list[TableSpec], int, dict[str, object]]:
    """What the planner needs of `model` (embedding collection `ebc`, the model's workload `facts`): its
    tables, its dense parameter count and the PlanOptions fields (the `planner` config group's and the
    model's; the dense part's `precision`, resolved where the job's device is known, `auto` for a device
    planned offline; an HSTU part's sizes with the `attention_impl` that runs its attention and the
    attention rates the hardware measured, `hstu_rates`)."""
    dense = dense_parameters(model, ebc)
    options = plan_options(cfg_planner, embedding, optimizer, device_type)
    options.update(interaction_pairs=facts.interaction_pairs, dense_tensors=len(dense),
                   dense_lookup_bytes_per_sample=facts.dense_lookup_bytes_per_sample,
                   dense_activation_bytes_per_sample=facts.dense_activation_bytes_per_sample,
                   dense_gradient_bytes_per_sample=facts.dense_gradient_bytes_per_sample,
                   dense_features=facts.dense_features, dense_flops_per_sample=facts.dense_flops_per_sample,
                   hstu=facts.hstu, attention_impl=attention_impl, hstu_rates=hstu_rates,
                   dense_dtype=precision)
    tables = model_tables(collection_configs(ebc), facts)
    if any(t.sequence for t in tables):  # torchrec shards an EmbeddingCollection these three ways
        allowed = tuple(s for s in options["allowed_shardings"] if s in SEQUENCE_SHARDINGS)
        if not allowed:
            raise ValueError(f"planner.sharding={cfg_planner.sharding}: sequence embeddings shard "
                             f"{', '.join(SEQUENCE_SHARDINGS)}")
        options["allowed_shardings"] = allowed
    return tables, sum(p.numel() for p in dense), options


def plan_model(model: nn.Module, ebc: nn.Module, facts: WorkloadFacts, cfg_planner: PlannerConfig,
               optimizer: str, topology: Topology, batch_size_per_rank: int, embedding: EmbeddingCost,
               planner: CoDesignPlanner | None = None, id_zipf_exponent: float = 0.0,
               resident_bytes: int = 0, attention_impl: str = "triton",
               allow_recompute: bool = False, hstu_rates: tuple[HSTURates, ...] = (),
               precision: Precision = Precision.auto) -> PlanResult:
    """Plan the tables of `model`'s embedding collection `ebc` on `topology` with the co-design planner;
    `id_zipf_exponent`: the ids' skew where the data's is known (0: uniform, the most rows touched);
    `resident_bytes`: what the data sources keep on each device (the plan leaves room for it). An HSTU
    model that fits only with activation recompute gets that plan, said in its notes, where
    `allow_recompute` (a what-if plan: the trainer does not recompute yet); otherwise InfeasiblePlanError
    says it would fit with recompute. An HSTU model refused at this batch is told the largest batch per
    rank that does fit here (`what_fits`: planned, not estimated)."""
    tables, dense_params, options = planner_inputs(model, ebc, facts, cfg_planner, optimizer, embedding,
                                                   topology.compute_device, attention_impl, hstu_rates,
                                                   precision)
    options.update(id_zipf_exponent=id_zipf_exponent, resident_bytes=resident_bytes)
    planner = planner or CoDesignPlanner()
    allowed = options["allowed_placements"]

    def plan(recompute: bool, batch: int = batch_size_per_rank, **extra: object) -> PlanResult:
        return planner.plan(tables, topology, batch, optimizer, dense_params, **{**options, **extra},
                            activation_recompute=recompute)

    try:
        return plan(False)
    except InfeasiblePlanError as e:
        if facts.hstu is None:
            raise
        try:
            result = plan(True)
        except InfeasiblePlanError:
            tail = what_fits(plan, batch_size_per_rank, allowed, embedding, topology)
            raise InfeasiblePlanError(f"{e}{tail}") from None
        step = f"predicted step {result.predicted_step_s * 1e3:.0f} ms"
        if not allow_recompute:
            tail = what_fits(plan, batch_size_per_rank, allowed, embedding, topology)
            raise InfeasiblePlanError(f"{e}; it would fit with activation recompute (not implemented in the "
                                      f"trainer; {step}){tail}") from None
        result.notes.append(f"activation recompute: no plan fits without it; each STU layer keeps only its "
                            f"input and recomputes the rest in the backward ({step}); not implemented in "
                            f"the trainer: a what-if plan")
        return result


BATCH_STEP = 32  # smaller batches per rank are tried in multiples of this (of 1 below it)


def largest_fitting_batch(plan_at: Callable[[int], PlanResult], batch: int) -> PlanResult | None:
    """The plan at the largest batch per rank below `batch` (a multiple of BATCH_STEP where `batch` is
    larger) that `plan_at` finds; None where not even the smallest fits. A batch's memory grows with its
    size, so a binary search."""
    step = BATCH_STEP if batch > BATCH_STEP else 1
    lo, hi, best = 1, (batch - 1) // step, None
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            best, lo = plan_at(mid * step), mid + 1
        except InfeasiblePlanError:
            hi = mid - 1
    return best


def what_fits(plan: Callable[..., PlanResult], batch: int, allowed: tuple[Placement, ...],
              embedding: EmbeddingCost, topology: Topology) -> str:
    """The tail of a refusal: the largest batch per rank below `batch` that plans here without recompute
    (`plan(recompute, batch, **options)`) with the `allowed` placements, or, where they leave out UVM
    caching and no batch fits without it, with it (where the implementation offers it); or that no
    smaller batch fits either."""
    found = largest_fitting_batch(lambda b: plan(False, b), batch)
    uvm = ""
    if (found is None and Placement.UVM_CACHING not in allowed and topology.compute_device != "cpu"
            and Placement.UVM_CACHING.value in embedding.impl.compute_kernels):
        # as planner.allow_uvm=true offers them: every placement the implementation runs
        placements = tuple(p for p in Placement if p.value in embedding.impl.compute_kernels)
        found = largest_fitting_batch(lambda b: plan(False, b, allowed_placements=placements), batch)
        uvm = " with planner.allow_uvm=true"
    where = f"{topology.world_size} x {topology.device.name}"
    if found is None:
        return f"; no smaller batch fits {where} either"
    off = Counter(o.placement.value for o in found.tables.values() if o.placement != Placement.HBM)
    rate = topology.world_size * found.workload.batch_size_per_rank / found.predicted_step_s
    tables = (", " + ", ".join(f"{n} of {len(found.tables)} tables in {p}" for p, n in sorted(off.items()))
              if off else ", every table in HBM")
    return (f"; would fit on {where}: {found.workload.batch_size_per_rank} samples per rank{uvm}{tables} "
            f"(planned: predicted {rate:,.0f} samples/s)")
