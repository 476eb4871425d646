"""Analytical cost model: bytes moved over the bandwidth that carries them, FLOPs over FLOP/s. Constants
marked "empirical" are fitted or measured: recalibrate them (benchmarks/planner_validate.py) on new hardware.
"""

from __future__ import annotations

import math

from anyrec.backends.dispatch import FBGEMM_EMBEDDING, Impl, KernelProfile
from anyrec.backends.hardware import EmbeddingCost
from anyrec.backends.specs import DEFAULT_SCALE_OUT_LATENCY_S, DEFAULT_SCALE_UP_LATENCY_S
from anyrec.planner.sequence import (
    activation_bytes,
    dense_bytes_per_sample,
    hstu_time_s,
    job_activation_dtypes,
    job_hstu_rates,
    rows_kept_for_backward,
    sequence_lookups,
    sequence_perf,
    stu_flops,
)
from anyrec.planner.types import (
    Perf,
    Placement,
    RankCost,
    Shard,
    ShardEstimator,
    ShardingOption,
    ShardingType,
    Storage,
    TableSpec,
    Topology,
    Workload,
)

ID_BYTES = 8  # int64 ids and offsets, as torchrec's KeyedJaggedTensor carries them
OUTPUT_BYTES = 4  # pooled embeddings and their gradients travel as fp32
# empirical: streaming elementwise kernels (zero-fill, dense optimizer) vs peak; an H200 (2026-11-30) copied
# at 4.18 of 4.8 TB/s.
ELEMENTWISE_EFFICIENCY = 0.87
# empirical: NCCL/RCCL all-to-all and ring bus bandwidth / link bandwidth, where the spec measured none
COMMS_EFFICIENCY = 0.75
DENSE_EFFICIENCY = 0.5  # empirical: DLRM-size GEMMs reach about half of dense peak FLOP/s
# empirical: recommendation ids follow a power law; 20% of rows take about 80% of lookups (Pareto),
# so hit rate = ratio ** (ln 0.8 / ln 0.2) gives 0.8 at torchrec's default 0.2 cache ratio.
_CACHE_HIT_EXPONENT = math.log(0.8) / math.log(0.2)
# DDP all-reduces gradients in buckets of this many bytes (torch's default bucket_cap_mb=25): one
# collective latency per bucket.
DDP_BUCKET_BYTES = 25 * 2**20
# Embedding all-to-alls per step of each sharding type used (splits, lengths and ids in; pooled out
# forward; their gradients back): torchrec batches every table of one sharding type into these; a
# torch.profiler trace of a 2-rank table-wise step counts 5 gloo all-to-alls per step (2026-12-01).
EMBEDDING_A2A_PER_STEP = 5
CPU_ACCESS_BYTES = 64  # one cache line
# Dense-model optimizer state bytes per parameter; its keys are the optimizers the planner knows.
OPTIMIZER_DENSE_STATE_BYTES = {"sgd": 0, "adagrad": 4, "rowwise_adagrad": 4, "adam": 8}
# Optimizers whose embedding state is one value per row (of each shard): splitting a row over column
# shards gives each piece its own value, so the update would change with the plan.
ROW_STATE_OPTIMIZERS = ("rowwise_adagrad",)
COLUMN_SPLIT_SHARDINGS = ("column_wise", "table_column_wise")  # torchrec's types that split rows' columns


def inexact_update_reason(optimizer: str, sharding: str) -> str | None:
    """Why `sharding` cannot train a table with exactly the update `optimizer` gives it unsharded,
    or None when it can (every sharding type splits rows intact except column-wise ones)."""
    if optimizer in ROW_STATE_OPTIMIZERS and sharding in COLUMN_SPLIT_SHARDINGS:
        return (f"{sharding} sharding cannot train optim={optimizer} exactly: its one accumulator per row "
                f"would be kept per column shard, so the update would change with the plan; use another "
                f"sharding type or an element-wise optimizer (adagrad, adam, sgd)")
    return None


def state_bytes(optimizer: str, rows: int, dim: int, impl: Impl = FBGEMM_EMBEDDING) -> int:
    """Optimizer state bytes for a shard of `rows` x `dim` as embedding implementation `impl` lays the
    state out (FBGEMM's layout by default: also the dense optimizer's for data-parallel tables)."""
    return rows * impl.optimizer_state_bytes_per_row(optimizer, dim)


def simd_utilisation(dim: int, simd_width: int) -> float:
    """Fraction of SIMD lanes doing work when one wavefront/warp walks an embedding row."""
    return dim / simd_lanes(dim, simd_width)


def simd_lanes(dim: int, simd_width: int) -> int:
    """SIMD lanes one row of `dim` occupies: rows at least as wide as the SIMD width pad up to a multiple
    of it; narrower rows are packed (several per wavefront), padded to a power of two."""
    return math.ceil(dim / simd_width) * simd_width if dim >= simd_width else 1 << (dim - 1).bit_length()


def cache_hit_rate(cache_ratio: float) -> float:
    """Predicted fraction of lookups served from the HBM cache of a uvm_caching table."""
    return min(1.0, cache_ratio**_CACHE_HIT_EXPONENT)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def touched_rows(n_ids: float, rows: float) -> float:
    """Expected distinct rows among `n_ids` lookups drawn uniformly from `rows` rows: rows x (1 -
    e^(-n/rows)). Uniform is the most spread-out case: skewed ids (the usual) touch fewer."""
    if rows <= 0 or n_ids <= 0:
        return 0.0
    return -rows * math.expm1(-n_ids / rows)


def lookup_time_s(n_ids: float, n_bags: float, dim: int, table: TableSpec, placement: Placement,
                  topology: Topology, optimizer: str, embedding: EmbeddingCost, cache_ratio: float = 0.0,
                  fused_optimizer: bool = True, profile: KernelProfile | None = None,
                  rows: float | None = None) -> tuple[float, float]:
    """Forward and backward seconds for a shard that reads `n_ids` rows of width `dim` into `n_bags` bags.

    Both passes read the ids. Forward reads the rows and writes pooled outputs; backward reads output
    gradients and, with the optimizer fused (TBE: ids sorted, each row updated once), reads and writes
    each of the `touched_rows` of `rows` (default: the table's) and its optimizer state once; unfused
    (data-parallel), it scatter-adds every id into a dense gradient. `profile` overrides `embedding`'s.
    """
    profile = profile or embedding.profile
    dev = topology.device
    cpu = topology.compute_device == "cpu"
    access = CPU_ACCESS_BYTES if cpu else profile.access_bytes
    row_bytes = _round_up(dim * table.element_bytes, access)
    st = embedding.state_bytes_per_row(optimizer, dim) if fused_optimizer else 0
    state_row_bytes = _round_up(st, access) if st else 0
    fwd_rows = n_ids * row_bytes
    updated = touched_rows(n_ids, table.num_rows if rows is None else rows) if fused_optimizer else n_ids
    bwd_rows = 2 * updated * (row_bytes + state_row_bytes)
    out_bytes = n_bags * dim * OUTPUT_BYTES + n_ids * ID_BYTES
    hbm_bw = dev.memory_bw_bytes_per_s * profile.bw_efficiency * simd_utilisation(dim, dev.simd_width)
    latency = n_ids * profile.per_row_s
    if cpu or placement == Placement.HBM:
        return (fwd_rows + out_bytes) / hbm_bw + latency, (bwd_rows + out_bytes) / hbm_bw + 2 * latency
    h2d = dev.h2d_bw_bytes_per_s or dev.host_memory_bw_bytes_per_s
    if h2d <= 0:
        raise ValueError(f"{dev.name}: h2d_bw_bytes_per_s is 0, cannot place tables in host memory")
    if placement == Placement.UVM_CACHING:
        hit = cache_hit_rate(cache_ratio)
        per_byte = hit / hbm_bw + (1.0 - hit) / h2d
    else:  # DDR: every row crosses the host link
        per_byte = 1.0 / h2d
    return fwd_rows * per_byte + out_bytes / hbm_bw, bwd_rows * per_byte + out_bytes / hbm_bw


def link_latency_s(topology: Topology, inter_host: bool) -> float:
    """Fixed seconds of one collective over the scale-up (or scale-out) link: the spec's figure, else
    the default for SKUs that give none (anyrec.backends.specs)."""
    dev = topology.device
    if inter_host:
        return dev.scale_out_latency_s or DEFAULT_SCALE_OUT_LATENCY_S
    return dev.scale_up_latency_s or DEFAULT_SCALE_UP_LATENCY_S


def all_to_all_time_s(bytes_to_all: float, topology: Topology, latency: bool = True) -> float:
    """Seconds for one rank to send `bytes_to_all` spread evenly over all ranks (its own share stays):
    the link's latency (unless `latency=False`, for a share of a batched collective) + bytes / bw."""
    w, local = topology.world_size, topology.local_world_size
    if w == 1:
        return 0.0
    dev = topology.device
    intra = bytes_to_all * (local - 1) / w / dev.scale_up_bw_bytes_per_s if local > 1 else 0.0
    inter = bytes_to_all * (w - local) / w / dev.scale_out_bw_bytes_per_s if w > local else 0.0
    alpha = link_latency_s(topology, w > local) if latency else 0.0
    return alpha + max(intra, inter) / (dev.comms_efficiency or COMMS_EFFICIENCY)


def reduce_scatter_time_s(total_bytes: float, ranks: int, hosts: int, topology: Topology,
                          latency: bool = True) -> float:
    """Seconds for a hierarchical ring reduce-scatter (or all-gather) of `total_bytes` over `ranks`
    ranks on `hosts` hosts: intra-host ring over scale-up, then inter-host over scale-out; each
    stage pays its link's latency (unless `latency=False`)."""
    if ranks <= 1:
        return 0.0
    dev = topology.device
    per_host = ranks // hosts
    t = total_bytes * (per_host - 1) / per_host / dev.scale_up_bw_bytes_per_s if per_host > 1 else 0.0
    alpha = link_latency_s(topology, False) if per_host > 1 and latency else 0.0
    if hosts > 1:
        t += total_bytes / per_host * (hosts - 1) / hosts / dev.scale_out_bw_bytes_per_s
        alpha += link_latency_s(topology, True) if latency else 0.0
    return alpha + t / (dev.comms_efficiency or COMMS_EFFICIENCY)


def all_reduce_time_s(total_bytes: float, topology: Topology, latency: bool = True) -> float:
    """Seconds for an all-reduce of `total_bytes` over all ranks (reduce-scatter + all-gather)."""
    return 2 * reduce_scatter_time_s(total_bytes, topology.world_size, topology.num_hosts, topology,
                                     latency)


def dense_all_reduce_time_s(dense_param_count: int, topology: Topology) -> float:
    """Seconds per step of DDP's all-reduce of `dense_param_count` fp32 gradients over the topology's
    ranks, in DDP's buckets (each pays the latency)."""
    buckets = max(1, math.ceil(4 * dense_param_count / DDP_BUCKET_BYTES))
    return (all_reduce_time_s(4 * dense_param_count, topology, latency=False)
            + buckets * all_reduce_time_s(0.0, topology))


def framework_time_s(workload: Workload, topology: Topology) -> float:
    """Seconds per step every plan pays on each rank beyond the bytes and FLOPs: the device's measured
    framework costs (DeviceSpec.step_*, 0 where unmeasured) for this workload's features, local batch,
    local ids, pooled values, interaction entries and dense parameter tensors."""
    dev = topology.device
    b = workload.batch_size_per_rank
    features = sum(t.num_features for t in workload.tables)
    ids = b * sum(t.pooling_factor for t in workload.tables)
    values = b * sum(t.bags_per_sample * t.embedding_dim for t in workload.tables)
    return (dev.step_fixed_s + features * dev.step_per_feature_s + b * dev.step_per_sample_s
            + ids * dev.step_per_id_s + values * dev.step_per_value_s
            + b * workload.options.interaction_pairs * dev.step_per_pair_s
            + workload.options.dense_tensors * dev.step_per_dense_tensor_s)


def sharding_group_time_s(topology: Topology) -> float:
    """Seconds per step of one group of sharded tables (one sharding type): the latency of its
    embedding all-to-alls, plus its measured framework cost (DeviceSpec.sharding_group_s)."""
    return EMBEDDING_A2A_PER_STEP * all_to_all_time_s(0.0, topology) + topology.device.sharding_group_s


def split_fwd_bwd(seconds: float) -> Perf:
    """Compute `seconds` as a Perf, a third in the forward pass and two thirds in the backward (as
    FLOPs split)."""
    return Perf(seconds / 3, 2 * seconds / 3, 0.0, 0.0)


class EmbeddingPerfEstimator(ShardEstimator):
    """Per-shard step time: lookup bytes over the placement's bandwidth, plus the comms each sharding type
    needs (all-to-all for table/column-wise, reduce-scatter for row-wise, all-reduce for data-parallel)."""

    def estimate(self, option: ShardingOption, topology: Topology, workload: Workload) -> None:
        t = option.table
        b, w = workload.batch_size_per_rank, topology.world_size
        g = b * w  # global batch
        p, f = t.pooling_factor, t.bags_per_sample
        emb = workload.options.embedding
        opt = workload.optimizer

        def lookup(n_ids: float, n_bags: float, dim: int, rows: float) -> tuple[float, float]:
            return lookup_time_s(n_ids, n_bags, dim, t, option.placement, topology, opt, emb,
                                 option.cache_ratio, rows=rows)

        st = option.sharding
        if t.sequence:  # an EmbeddingCollection table: every position is an output row (sequence.py)
            perf = sequence_perf(option, topology, workload, lookup,
                                 lambda nbytes: all_to_all_time_s(nbytes, topology, latency=False))
        elif st == ShardingType.DATA_PARALLEL:
            # torchrec's "dense" kernel (plain embedding bags, costed with the plain-torch Impl's profile)
            # scatters into a dense gradient of the whole table, zeroed, all-reduced and stepped by the
            # dense optimizer every step.
            fwd, bwd = lookup_time_s(b * p, b * f, t.embedding_dim, t, option.placement, topology, opt, emb,
                                     fused_optimizer=False, profile=emb.dense_profile)
            # Its elementwise passes: zero-fill, then the optimizer reads weights, gradient and state and
            # writes weights and state.
            state = state_bytes(opt, t.num_rows, t.embedding_dim)
            bw = topology.device.memory_bw_bytes_per_s * ELEMENTWISE_EFFICIENCY
            bwd += (4 * t.weight_bytes + 2 * state) / bw
            # DistributedModelParallel puts replicas' gradients in DDP's buckets with the dense model's:
            # their bytes count here, the buckets' latencies in DenseEstimator. Each replica's
            # bookkeeping (its lookup module, gradient and optimizer pass) is measured.
            perf = (Perf(fwd, bwd, 0.0, all_reduce_time_s(t.weight_bytes, topology, latency=False))
                    + split_fwd_bwd(topology.device.replicated_table_s))
        elif st in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE):
            dim = option.shards[0].num_cols
            fwd, bwd = lookup(g * p, g * f, dim, t.num_rows)
            ids = all_to_all_time_s(g * (p + f) * ID_BYTES, topology, latency=False)
            out = all_to_all_time_s(g * f * dim * OUTPUT_BYTES, topology, latency=False)
            perf = Perf(fwd, bwd, ids + out, out)
        elif st == ShardingType.ROW_WISE:
            fwd, bwd = lookup(g * p / w, g * f, t.embedding_dim, t.num_rows / w)
            ids = all_to_all_time_s(b * (p + f) * ID_BYTES, topology, latency=False)
            rs = reduce_scatter_time_s(g * f * t.embedding_dim * OUTPUT_BYTES, w, topology.num_hosts,
                                       topology, latency=False)
            perf = Perf(fwd, bwd, ids + rs, rs)
        else:  # table-row-wise
            local = topology.local_world_size
            fwd, bwd = lookup(g * p / local, g * f, t.embedding_dim, t.num_rows / local)
            out_bytes = g * f * t.embedding_dim * OUTPUT_BYTES
            ids = all_to_all_time_s(g * (p + f) * ID_BYTES / local, topology, latency=False)
            rs = reduce_scatter_time_s(out_bytes, local, 1, topology, latency=False)
            a2a = all_to_all_time_s(out_bytes / local, topology, latency=False)
            perf = Perf(fwd, bwd, ids + rs + a2a, rs + a2a)
        for s in option.shards:
            s.perf = perf


def shard_lookups(option: ShardingOption, topology: Topology, workload: Workload,
                  sharded: bool = True) -> tuple[float, float, int]:
    """Per step, the ids one shard of `option` looks up, the bags it pools (its lookup's bags, whose
    outputs and their gradients it writes and reads) and how many shards share the table's touched rows
    (a row-wise shard's rows are a slice of the ids, whatever their popularity); `sharded=False`: one
    rank looking up its own batch."""
    t = option.table
    b, w = workload.batch_size_per_rank, topology.world_size
    p, f = t.pooling_factor, t.bags_per_sample
    if not sharded:
        return b * p, b * f, 1
    if t.sequence:
        ids, outputs = sequence_lookups(option, topology, workload)
        return ids, outputs, w if option.sharding == ShardingType.ROW_WISE else 1
    g = b * w
    if option.sharding in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE):
        return g * p, g * f, 1
    if option.sharding == ShardingType.ROW_WISE:
        return g * p / w, g * f, w
    return g * p / topology.local_world_size, g * f, topology.local_world_size


def shard_data_bytes(option: ShardingOption, shard: Shard, topology: Topology,
                     workload: Workload) -> tuple[int, int, int, int]:
    """A shard's weight bytes (a data-parallel replica's with its dense gradient) and optimizer state
    bytes, and how many bytes of them its placement keeps in HBM and in host DDR."""
    weights = shard.num_rows * shard.num_cols * option.table.element_bytes
    if option.sharding == ShardingType.DATA_PARALLEL:
        weights *= 2
    state = state_bytes(workload.optimizer, shard.num_rows, shard.num_cols, workload.options.embedding.impl)
    if option.placement == Placement.HBM or topology.compute_device == "cpu":
        return weights, state, weights + state, 0
    if option.placement == Placement.UVM_CACHING:
        return weights, state, int(option.cache_ratio * (weights + state)), weights + state
    return weights, state, 0, weights + state


class EmbeddingStorageEstimator(ShardEstimator):
    """Per-shard bytes: weights and optimizer state where the placement puts them, plus input ids and
    output/gradient buffers in HBM for every batch in flight (pipeline depth)."""

    def estimate(self, option: ShardingOption, topology: Topology, workload: Workload) -> None:
        t = option.table
        b, w = workload.batch_size_per_rank, topology.world_size
        g = b * w
        p, f = t.pooling_factor, t.bags_per_sample
        depth = workload.options.pipeline_depth
        st = option.sharding
        if t.sequence:
            ids, bags = sequence_lookups(option, topology, workload)
        elif st == ShardingType.DATA_PARALLEL:
            ids, bags = b * p, b * f
        elif st in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE):
            ids, bags = g * p, g * f
        elif st == ShardingType.ROW_WISE:
            ids, bags = g * p / w, g * f
        else:
            ids, bags = g * p / topology.local_world_size, g * f
        cache: dict[tuple[int, int], Storage] = {}
        for s in option.shards:
            key = (s.num_rows, s.num_cols)
            if key not in cache:
                _, _, hbm, ddr = shard_data_bytes(option, s, topology, workload)
                out = bags * s.num_cols * OUTPUT_BYTES
                if t.sequence:  # ids for every batch in flight; one batch's rows (or their gradient)
                    buffers = int(depth * ids * ID_BYTES + out)
                else:
                    buffers = int(depth * ((ids + bags) * ID_BYTES + out) + out)  # + output gradient
                cache[key] = Storage(hbm + buffers, ddr)
            s.storage = cache[key]


class DenseEstimator:
    """Per-rank cost every plan pays: the data-parallel dense model (weights, gradients, optimizer state,
    FLOPs, gradient all-reduce in DDP buckets), the local batch's pooled embeddings, and the fixed per-step
    costs batched over tables (the embedding implementation's launch cost, `framework_time_s`); the
    all-to-alls' latency depends on the plan (`sharding_group_time_s`)."""

    def estimate(self, topology: Topology, workload: Workload) -> RankCost:
        n = workload.dense_param_count
        b = workload.batch_size_per_rank
        opts = workload.options
        dense_state = OPTIMIZER_DENSE_STATE_BYTES[workload.optimizer]
        pooled = b * sum(t.bags_per_sample * t.embedding_dim for t in workload.tables) * OUTPUT_BYTES
        # sequence rows are read by the dense part as they arrive: one batch's, beside its activations at the
        # memory model's peak only where the dense part keeps them (fp32: rows_kept_for_backward); their
        # gradient comes when the activations are gone
        if any(t.sequence for t in workload.tables):
            copies = 1 if rows_kept_for_backward(topology, opts.dense_dtype) else 0
        else:
            copies = opts.pipeline_depth + 1
        hbm = n * (4 + 4 + dense_state) + copies * pooled
        hbm += b * dense_bytes_per_sample(opts, topology, b)[1]
        dev = topology.device
        half = activation_bytes(topology, opts.dense_dtype) == 2
        peak = dev.peak_bf16_flops if half else dev.peak_fp32_flops
        efficiency = dev.dense_efficiency or DENSE_EFFICIENCY
        if opts.hstu is not None and peak > 0:  # STU GEMMs, attention and elementwise (sequence.py)
            other = max(0.0, opts.dense_flops_per_sample - stu_flops(opts.hstu).total)
            compute = hstu_time_s(opts.hstu, other, b, dev, job_activation_dtypes(topology, opts.dense_dtype),
                                  efficiency, opts.attention_impl, opts.activation_recompute,
                                  job_hstu_rates(opts, topology)).total_s
        else:
            # forward 2 FLOPs per parameter per sample, backward 4, unless the model states its own
            flops = (opts.dense_flops_per_sample or 6.0 * n) * b
            compute = flops / (peak * efficiency) if peak > 0 else 0.0
        comms = dense_all_reduce_time_s(n, topology)
        launch = opts.embedding.profile.per_launch_s
        perf = Perf(compute / 3 + launch / 3, 2 * compute / 3 + 2 * launch / 3, 0.0, comms)
        perf = perf + split_fwd_bwd(framework_time_s(workload, topology))
        return RankCost(Storage(int(hbm), 0), perf)


def usable_caps(topology: Topology, workload: Workload) -> Storage:
    """Per-rank bytes the planner may fill: HBM less what the runtime keeps outside the allocator and the
    optional margin (`reserve_fraction`), and host DDR."""
    opts = workload.options
    runtime = topology.device.runtime_reserved_bytes
    hbm = int(topology.hbm_bytes_per_rank * (1.0 - opts.reserve_fraction)) - runtime
    return Storage(max(hbm, 0), topology.ddr_bytes_per_rank)
