"""Predicted peak device memory of each rank of a plan, term by term (docs/planning.md lists the terms
and how each was found). Each term is what the allocator counts as allocated: tensor sizes rounded up
to ALLOC_ROUND_BYTES; the caching allocator's own slack (reserved less allocated) is a separate term.

A step's peak is the persistent state (tables, their optimizer state, the dense model, the batches in
flight, the data source) plus the largest of three transient sets: the embedding lookup's temporaries,
the dense activations at the interaction's end, and the fused update's temporaries (`_rank_prediction`).
Constants marked "empirical" were counted from allocations at the peak (simdev's allocation tracking,
benchmarks/memory_accuracy.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

from anyrec.planner.estimators import (
    ID_BYTES,
    OPTIMIZER_DENSE_STATE_BYTES,
    OUTPUT_BYTES,
    shard_lookups,
    state_bytes,
)
from anyrec.planner.sequence import dense_bytes_per_sample
from anyrec.planner.types import Placement, PlanResult, ReplicaUpdate, ShardingType, Topology

# CUDA's caching allocator (and simdev's) rounds every allocation up to a multiple of 512 bytes.
ALLOC_ROUND_BYTES = 512
# The caching allocator runs with expandable segments: anyrec's CUDA and ROCm backends set them in
# PYTORCH_CUDA_ALLOC_CONF / PYTORCH_HIP_ALLOC_CONF and simdev's backend in SIMDEV_ALLOC_CONF before the first
# allocation (anyrec.backends._gpu.configure_allocator). Each pool maps pages of an address range on demand,
# 2 MiB pages for requests up to 1 MiB (the small pool) and 20 MiB above (CUDA's kSmallBuffer and
# kLargeBuffer); a free block is split for any request it holds and coalesces with its free neighbours, and
# an allocation that would pass the capacity first unmaps every whole free page. What the capacity must
# hold at the peak is then the pages that hold an allocated byte (`allocator_slack`), whatever order the
# step allocates in; without expandable segments the cached segments' holes depend on that order, which is
# how an allocated peak of 420 MiB once needed 665 MB.
ALLOC_SMALL_PAGE_BYTES = 2 * 2**20
ALLOC_LARGE_PAGE_BYTES = 20 * 2**20
# The live blocks at a step's peak lie in runs: what start-up made (tables, their state, the dense model, the
# data source), the batches the pipeline holds, the phase's temporaries. Each run ends in a page it shares
# with a free range on either side: half a page used on average. empirical: pages in use at the peak less
# the allocated peak, dlrmv2_small b2048 on simdev (2026-12-07): 3.4 and 2.2 large pages on its two ranks.
ALLOC_LIVE_RUNS = 3
# The allocated terms are themselves a model: a reserved prediction that must never be under what the device
# needs carries a margin for their error. empirical: -2.7 % at worst among dlrmv2_small's ranks at batches
# 2,048 and 4,096 per rank on simdev (2026-12-07), where 1 % under was an out-of-memory at the smallest
# capacity accepted.
ALLOCATED_MARGIN = 0.05
# empirical: the initial weights are drawn on the device in passes over 2^19 elements, whose hash keeps
# ~40.5 bytes an element of int64 temporaries (20.25 MiB on simdev, counted as 21): start-up's peak,
# beside the tables before any batch, whose segments stay reserved.
INIT_WORKSPACE_BYTES = 21 * 2**20
LENGTH_BYTES = 4  # int32 KJT lengths, as the data sources make them
VALUE_BYTES = 4  # fp32 dense features, labels, activations and gradients
# Tensors live at the peak besides those the terms size one by one (ids, lookup and update temporaries,
# per-table views): each pays half a rounding block on average. empirical: 100-190 at simdev peaks.
LIVE_TENSORS = 160


@dataclass(frozen=True)
class EmbeddingWorkspace:
    """Temporaries an embedding implementation allocates in one lookup (forward) and one fused update
    (backward), in bytes per looked-up value (ids x dim), per id and per touched row's value."""

    forward_per_value: float
    forward_per_id: float
    backward_per_value: float
    backward_per_id: float
    update_per_row_value: dict[str, float]  # by optimizer
    # data-parallel lookups run through autograd: what their forward saves for the backward, and what of
    # it is still alive when their gradient is made, per value
    replica_per_value: float = 0.0
    replica_update_per_value: float = 0.0


# empirical (counted at simdev peaks, 2026-12-04): anyrec's torch TBE gathers [ids, dim] addresses (int64)
# and rows (fp32) and scatters them (int64 addresses) in the forward; its update merges duplicate ids
# with torch.unique and steps each touched row in fp64 (the FMA emulation of FBGEMM's rounding).
TORCH_WORKSPACE = EmbeddingWorkspace(20.0, 53.0, 4.0, 100.0,
                                     {"sgd": 79.0, "adagrad": 86.0, "rowwise_adagrad": 14.0, "adam": 36.0},
                                     replica_per_value=20.0, replica_update_per_value=8.0)
# FBGEMM's fused kernels (and anyrec's Triton ones) read rows in place: the forward keeps nothing beside
# its output; the backward sorts the ids (radix sort: keys, values and their copies, int64) and keeps no
# per-value buffer; data-parallel tables are nn.EmbeddingBag (it saves the ids only). Not yet measured
# on a GPU (benchmarks/gpu_suite.py measures it).
FUSED_WORKSPACE = EmbeddingWorkspace(0.0, 8.0, 0.0, 6 * ID_BYTES,
                                     {"sgd": 0.0, "adagrad": 0.0, "rowwise_adagrad": 0.0, "adam": 0.0})
EMBEDDING_WORKSPACE = {"torch": TORCH_WORKSPACE, "fbgemm": FUSED_WORKSPACE, "triton": FUSED_WORKSPACE}


ZIPF_GRID_POINTS = 256  # log-spaced points of the touched-rows integral (well under 1 % off from the sum)


def touched_rows_zipf(n_ids: float, rows: int, exponent: float) -> float:
    """Expected distinct rows among `n_ids` lookups of a table of `rows` rows whose ids are drawn with
    popularity ~ 1 / rank^`exponent` (0: uniform): the integral over ranks x of 1 - e^(-n p(x)), p the
    normalised power law. Skewed ids touch far fewer rows than uniform ones (a half at Criteo-like skew)."""
    if rows <= 0 or n_ids <= 0:
        return 0.0
    if exponent == 0:
        return -rows * math.expm1(-n_ids / rows)
    hi = rows + 1.0
    a = 1.0 - exponent
    norm = math.log(hi) if abs(a) < 1e-9 else (hi**a - 1.0) / a
    xs = [hi ** (i / ZIPF_GRID_POINTS) for i in range(ZIPF_GRID_POINTS + 1)]
    ys = [-math.expm1(-n_ids * x**-exponent / norm) for x in xs]
    area = sum((xs[i + 1] - xs[i]) * (ys[i] + ys[i + 1]) / 2 for i in range(ZIPF_GRID_POINTS))
    return min(float(rows), area)


def allocator_slack(allocated_bytes: int, startup_bytes: int) -> int:
    """Reserved less allocated at a step's peak of `allocated_bytes` after a start-up that peaked at
    `startup_bytes`, with expandable segments: start-up's excess (its pages stay mapped), the last large
    page partly used, each run of live blocks' two edge pages half used (ALLOC_LIVE_RUNS) and the small
    pool's partly used pages (one each end)."""
    peak = max(allocated_bytes, startup_bytes)
    last_page = -peak % ALLOC_LARGE_PAGE_BYTES
    return (peak - allocated_bytes + last_page + ALLOC_LIVE_RUNS * ALLOC_LARGE_PAGE_BYTES
            + 2 * ALLOC_SMALL_PAGE_BYTES)


def alloc_bytes(nbytes: float, tensors: int = 1) -> int:
    """Bytes the allocator counts for `tensors` tensors of `nbytes` in all (rounded up, each the same)."""
    if tensors <= 0 or nbytes <= 0:
        return 0
    each = -(-int(nbytes) // tensors)
    return tensors * (-(-each // ALLOC_ROUND_BYTES) * ALLOC_ROUND_BYTES)


@dataclass(frozen=True)
class MemoryPrediction:
    """One rank's predicted peak device bytes by term; `allocated_bytes` sums every term but the
    allocator's slack (what `max_memory_allocated` measures), `reserved_bytes` adds it."""

    embedding_weights_bytes: int  # sharded tables' shards and data-parallel replicas in HBM
    embedding_optimizer_bytes: int  # their optimizer state (fused; the dense optimizer's for replicas)
    # data-parallel tables' DDP bucket (world > 1, kept) and, while the backward makes it, their gradient
    replica_gradient_bytes: int
    dense_weights_bytes: int
    dense_gradient_bytes: int  # DDP's bucket (world > 1) or the parameters' .grad
    dense_optimizer_bytes: int  # created at the first step
    batch_bytes: int  # the pipeline's batches in flight and the ids the input all-to-all delivered
    embedding_io_bytes: int  # lookup outputs (or their gradients), pooled embeddings after the all-to-all
    activation_bytes: int  # the dense model's tensors alive at the peak
    workspace_bytes: int  # the embedding implementation's temporaries (EmbeddingWorkspace)
    data_source_bytes: int  # what the data source keeps on the device (read from it, not modelled)
    rounding_bytes: int  # other live tensors' rounding to ALLOC_ROUND_BYTES
    allocator_overhead_bytes: int  # reserved less allocated: partly used pages (allocator_slack)
    # "lookup" | "interaction" | "update" | "replica sync" (2D's averaging): the moment of the step the
    # peak falls in
    peak_phase: str

    @property
    def allocated_bytes(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self)
                   if f.name.endswith("_bytes") and f.name != "allocator_overhead_bytes")

    @property
    def reserved_bytes(self) -> int:
        return self.allocated_bytes + self.allocator_overhead_bytes

    def terms(self) -> dict[str, int]:
        """Every byte term by name (allocated terms first, the allocator's slack last)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name.endswith("_bytes")}


@dataclass
class _Rank:
    """What one rank's tables amount to (accumulated over the plan's shards)."""

    weights: int = 0
    state: int = 0
    replica_grad: int = 0
    ids: float = 0.0  # ids its sharded lookups read per step
    values: float = 0.0  # ids x dim of those lookups
    rows_values: float = 0.0  # touched rows x dim
    bags: float = 0.0  # pooled outputs (bags) its sharded lookups write
    out_values: float = 0.0  # bags x dim
    replica_ids: float = 0.0
    replica_values: float = 0.0
    sharded_weights: int = 0  # the sharded tables' shards: what 2D's replicas average
    sharded_state: int = 0


def averaging_flattens(topology: Topology) -> bool:
    """Whether 2D's averaging (`allreduce_coalesced`) copies its tensors into one temporary buffer:
    gloo, the CPU's process-group backend, flattens them; NCCL and RCCL reduce each tensor in place."""
    return topology.compute_device == "cpu"


def predict_memory(plan: PlanResult, data_source_bytes: int = 0,
                   sharded: bool = True) -> list[MemoryPrediction]:
    """Each rank's predicted peak device memory for `plan`; `data_source_bytes`: what the data source keeps
    on each device; `sharded=False`: one rank running every table itself (no input/output all-to-all)."""
    topo, wl = plan.topology, plan.workload
    opts = wl.options
    b, w = wl.batch_size_per_rank, topo.world_size
    impl = opts.embedding.impl
    ranks = [_Rank() for _ in range(w)]
    for opt in plan.tables.values():
        t = opt.table
        p = t.pooling_factor
        for s in opt.shards:
            r = ranks[s.rank]
            weights = s.num_rows * s.num_cols * t.element_bytes
            state = state_bytes(wl.optimizer, s.num_rows, s.num_cols, impl)
            if opt.placement == Placement.UVM_CACHING and topo.compute_device != "cpu":
                weights, state = int(opt.cache_ratio * weights), int(opt.cache_ratio * state)
            elif opt.placement == Placement.DDR and topo.compute_device != "cpu":
                weights = state = 0
            if opt.sharding == ShardingType.DATA_PARALLEL:
                r.weights += weights
                r.replica_grad += weights
                r.state += alloc_bytes(state)
                r.replica_ids += b * p
                r.replica_values += b * p * s.num_cols
                continue
            r.weights += weights
            r.state += state
            r.sharded_weights += weights
            r.sharded_state += state
            ids, bags, share = shard_lookups(opt, topo, wl, sharded)
            touched = touched_rows_zipf(ids * share, t.num_rows, opts.id_zipf_exponent) / share
            r.ids += ids
            r.values += ids * s.num_cols
            r.rows_values += touched * s.num_cols
            r.bags += bags
            r.out_values += bags * s.num_cols
    return [_rank_prediction(plan, r, data_source_bytes, sharded) for r in ranks]


def _rank_prediction(plan: PlanResult, r: _Rank, data_source_bytes: int, sharded: bool) -> MemoryPrediction:
    wl = plan.workload
    opts = wl.options
    b = wl.batch_size_per_rank
    ws = EMBEDDING_WORKSPACE.get(opts.embedding.impl.name, FUSED_WORKSPACE)
    n = wl.dense_param_count
    tensors = max(1, opts.dense_tensors)
    dense = alloc_bytes(n * VALUE_BYTES, tensors)
    # torch's optimizers create their state at the first step
    dense_state = alloc_bytes(n * OPTIMIZER_DENSE_STATE_BYTES[wl.optimizer], tensors)
    # The pipeline holds `pipeline_depth` local batches (ids, lengths, dense features, labels); sharded,
    # the input all-to-all delivers this rank's tables' ids and lengths for the batch in flight and the
    # next.
    local_ids = b * sum(t.pooling_factor for t in wl.tables)
    local_bags = b * sum(t.bags_per_sample for t in wl.tables)
    dense_in = b * (opts.dense_features + 1)  # dense features and the label
    depth = opts.pipeline_depth if sharded else 1  # one device steps eagerly, one batch at a time
    batch = depth * (alloc_bytes(local_ids * ID_BYTES) + alloc_bytes(local_bags * LENGTH_BYTES)
                     + alloc_bytes(dense_in * VALUE_BYTES, 2))
    if sharded:
        batch += 2 * (alloc_bytes(r.ids * ID_BYTES) + alloc_bytes(r.bags * LENGTH_BYTES))
    # Three moments can hold the peak: the lookup (its temporaries beside the bottom MLP's outputs), the
    # interaction's end (the dense activations beside the pooled embeddings: torchrec's KeyedTensor
    # and the model's concatenation of it, and the lookups' own outputs) and the fused update (its
    # temporaries beside the gradient of the lookups' outputs). Data-parallel lookups run through
    # autograd: what they save stays from their forward to the backward.
    pooled = alloc_bytes(b * sum(t.bags_per_sample * t.embedding_dim for t in wl.tables) * OUTPUT_BYTES)
    out = alloc_bytes(r.out_values * OUTPUT_BYTES)
    replica = alloc_bytes(ws.replica_per_value * r.replica_values + ID_BYTES * r.replica_ids)
    upd = ws.update_per_row_value.get(wl.optimizer, 0.0)
    lookup_ws = alloc_bytes(ws.forward_per_value * r.values + ws.forward_per_id * r.ids)
    # 2D exchanging gradients (anyrec.trainer.replica_exchange): the update runs over R groups' lookups
    # (its temporaries R times the group's, touched rows counted R times: an upper bound), beside the
    # gathered lookups (ids, bag lengths, output gradients: R contributions, padded, and their merged
    # copy) and the replayed lookup's output
    replicas = plan.replicas
    exchange = plan.replica_update == ReplicaUpdate.GRADIENTS and replicas > 1
    x = replicas if exchange else 1
    update_ws = alloc_bytes(x * (ws.backward_per_value * r.values + ws.backward_per_id * r.ids
                                 + upd * r.rows_values))
    if exchange:
        lookups = ID_BYTES * (r.ids + r.bags) + OUTPUT_BYTES * r.out_values
        update_ws += 2 * alloc_bytes(replicas * lookups) + alloc_bytes(replicas * r.out_values * OUTPUT_BYTES)
    update_ws += alloc_bytes(ws.replica_update_per_value * r.replica_values + ID_BYTES * r.replica_ids)
    bucket = alloc_bytes(r.replica_grad) if plan.topology.world_size > 1 else 0
    # phase -> (activations, embedding in/out, workspace, replicas' gradient)
    lookup_b, activation_b, gradient_b = dense_bytes_per_sample(opts, plan.topology, b)  # HSTU: sequence.py
    sequence = any(t.sequence for t in wl.tables)
    copies = 1 if sequence else 2  # sequence rows: read as they are, no concat
    # a sequence lookup's rows are freed once the output all-to-all has sent them (its autograd keeps
    # neither); unsharded, the lookups' output is the pooled embeddings
    kept_out = out if sharded and not sequence else 0
    phases = {
        "lookup": (alloc_bytes(b * lookup_b), out, lookup_ws + replica, bucket),
        "interaction": (alloc_bytes(b * activation_b), copies * pooled + kept_out, replica, bucket),
        "update": (alloc_bytes(b * gradient_b), out, update_ws,
                   bucket + alloc_bytes(r.replica_grad)),
    }
    if replicas > 1 and plan.replica_update == ReplicaUpdate.AVERAGE and averaging_flattens(plan.topology):
        # 2D's averaging, after the update: one flat buffer per coalesced all-reduce (the weights, then
        # the optimizer state: torchrec's DMPCollection._sync), the step's transients gone
        phases["replica sync"] = (0, 0, alloc_bytes(max(r.sharded_weights, r.sharded_state)), bucket)
    phase = max(phases, key=lambda k: sum(phases[k]))
    activations, io, workspace, replica_grad = phases[phase]
    tables = alloc_bytes(r.weights) + alloc_bytes(r.state)
    prediction = MemoryPrediction(
        embedding_weights_bytes=alloc_bytes(r.weights),
        embedding_optimizer_bytes=tables - alloc_bytes(r.weights),
        replica_gradient_bytes=replica_grad,
        dense_weights_bytes=dense,
        dense_gradient_bytes=dense,
        dense_optimizer_bytes=dense_state,
        batch_bytes=int(batch),
        embedding_io_bytes=io,
        activation_bytes=activations,
        workspace_bytes=workspace,
        data_source_bytes=data_source_bytes,
        rounding_bytes=LIVE_TENSORS * ALLOC_ROUND_BYTES // 2,
        allocator_overhead_bytes=0,
        peak_phase=phase,
    )
    # Start-up's peak (the tables, the dense model and the data source beside the initialiser's temporaries)
    # is not the step's, but the pages it mapped stay mapped for the step to reuse.
    startup = tables + dense + data_source_bytes + INIT_WORKSPACE_BYTES
    slack = (allocator_slack(prediction.allocated_bytes, startup)
             + int(ALLOCATED_MARGIN * max(prediction.allocated_bytes, startup)))
    return dataclasses.replace(prediction, allocator_overhead_bytes=slack)
