"""Sequence embeddings and an HSTU dense part in the cost model (DLRMv4): what torchrec's
EmbeddingCollection costs per sharding type, and the STU layers' time and memory.

An EmbeddingCollection table looks up every position of a sequence and pools nothing: each id is its own
output row, so a step moves B x S x D rows through the output all-to-all each way (forward the rows,
backward their gradients), not B x D bags. torchrec shards such a table table-wise, column-wise or
row-wise; row-wise sends each id to the rank that holds its row (with the permutation that puts the rows
back in order) and each row back, an all-to-all, where a pooled table reduce-scatters partial sums.

The STU layers' FLOPs are the reference's count (`stu_flops`: 315.7 GFLOP per sample at the DLRMv4
reference's sizes). Where the calibration on first contact measured the job's kernels at its own shapes
(`measured_hstu`), the GEMMs, the attention implementation and the elementwise work run at the measured
rates; otherwise the GEMMs at the device's dense efficiency, the attention at its implementation's assumed
efficiency (`ATTENTION_EFFICIENCY`), both in bf16 where the device has it, and the elementwise work (norms,
SiLU, gating, dropout, casts) streams the layers' activations through HBM at its bandwidth. Memory: each
layer keeps, per token, what autograd saves of anyrec's STU layer (`stu_layer_kept_bytes_per_token`, checked
against a measurement by tests/test_planner_saved_tensors.py): with the model's selective recompute
(`HSTUShape.stu_recompute`, the reference's) its input, U and the attention output, the rest recomputed in
its backward (the UVQK GEMM once more, `selective_recompute_s`); without it every tensor its ops save
(`stu_kept_bytes_per_token`). With activation recompute (a what-if) a layer keeps only its input and
recomputes the rest in the backward (one more forward of the STU stack).

Sequences are jagged and nothing is padded: the GEMMs, the lookups, the all-to-alls and the kept tensors
grow with the mean tokens per sample, the attention with the mean of the squared lengths (`HSTUShape`'s
`mean_tokens`, `rms_tokens`); a batch's memory is planned at its mean plus three standard deviations of a
batch's tokens (`memory_tokens_per_sample`), never above the longest.

Legend: B samples per rank, S tokens per sample, L layers, D model dim, H heads, A q/k dim per head,
V u/v dim per head (U = H x V), a bytes of an activation element (2 in bf16, 4 in fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from anyrec.backends.hardware import HSTURates
from anyrec.backends.specs import DeviceSpec
from anyrec.config import Precision, STURecompute
from anyrec.kernels.hstu import CHUNK_SCORE_ELEMENTS
from anyrec.planner.types import Perf, PlanOptions, ShardingOption, ShardingType, Topology, Workload
from anyrec.schema import HSTUShape

ID_BYTES = 8  # int64 ids, as torchrec's KeyedJaggedTensor carries them (estimators.ID_BYTES)
OUTPUT_BYTES = 4  # an fp32 table's rows and their gradients travel as fp32 (no quantised comms)
FP32_BYTES = 4
INDEX_BYTES = 8  # an int64 index per token: the token's source row, its position and time buckets
LAYER_NORM_STATS_BYTES = 8  # a layer norm's mean and reciprocal deviation, fp32, per row
# A batch's tokens are a sum of B lengths: its memory is planned this many standard deviations above the mean
TOKEN_SIGMAS = 3.0
# Jagged HSTU attention's forward + backward FLOP over the causal pairs, achieved / dense bf16 peak, by the
# implementation (`backend.attention_kernel`). assumed, not measured on a GPU yet: anyrec's Triton kernels
# tile Q x K on chip like FlashAttention (whose forward + backward reaches ~35 % of peak on an H100, its
# authors report ~35-40 %); the torch version pads chunks of sequences and materialises their scores
# (memory-bound, ~10 %). A device where benchmarks/hstu_attention.py measured its kernel should use that.
ATTENTION_EFFICIENCY: dict[str, float] = {"triton": 0.35, "torch": 0.10}
# The attention's backward temporaries per token beyond its inputs and output, as a multiple of a token's
# q, k, v bytes: the Triton kernel's dq (fp32 accumulation), dk and dv. The torch version's are its padded
# buffers (`torch_attention_bytes_per_sample`, per sample), its dq, dk and dv among them (measured: the
# same six score-sized buffers at 40 and 66 tokens with dlrmv4_small's heads of 16; with short sequences and
# wide heads, d > N, its q, k, v gradients would pass them: not measured).
ATTENTION_WORKSPACE_QKV: dict[str, float] = {"triton": 2.0, "torch": 0.0}
# The elementwise passes stream each layer's saved activations about three times a step: written in the
# forward, read in the backward, gradients of the same size written. estimate, not measured.
ELEMENTWISE_PASSES = 3.0
# The torch attention (anyrec.kernels.hstu) pads each chunk of whole sequences to its longest and holds
# [b, H, N, N] fp32 score tensors: a layer keeps two (the scores, which SiLU's backward reads, and the
# probabilities, which the value GEMM's backward reads), its [b, N, N] bool mask and the padded q, k and v
# for its backward. The backward of the last layer holds TORCH_ATTENTION_BACKWARD_SCORES more at its peak
# (the gradients on their way through the value GEMM, the mask, the 1/max_len scale, SiLU and alpha, less
# the probabilities it has freed, its q, k, v gradients among them). measured: the attention alone on simdev
# (fp32, dlrmv4_small's heads and dims, 64 and 128 samples of 40 and 66 tokens) holds 5.9 score-sized
# buffers above its inputs and its output's gradient at its backward's peak (2026-12-07).
TORCH_ATTENTION_KEPT_SCORES = 2
TORCH_ATTENTION_BACKWARD_SCORES = 6
ELEMENTWISE_EFFICIENCY = 0.87  # as estimators.ELEMENTWISE_EFFICIENCY (an H200 copy: 4.18 of 4.8 TB/s)
# Samples the DLRMv4 reference trained to its target on 8 GPUs (mean of 20 seeds): what plans are timed to
REFERENCE_SAMPLES = 69.3e6
SEQUENCE_SHARDINGS = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)


@dataclass(frozen=True)
class STUFlops:
    """Forward + backward FLOP of one sample through the STU stack, by part (the reference's split)."""

    attention: float
    uvqk: float
    output: float

    @property
    def total(self) -> float:
        return self.attention + self.uvqk + self.output


def stu_flops(shape: HSTUShape) -> STUFlops:
    """The reference's count per sample: 2 FLOP per multiply-add, a GEMM's backward twice its forward (over
    the mean tokens); the attention over half the S x S pairs (causal) for QK^T and AV, its backward 2.5x
    its forward (3.5x in all), S^2 the mean of the squared lengths."""
    S, L, D, H = shape.mean_tokens, shape.num_layers, shape.model_dim, shape.num_heads
    A, V = shape.qk_dim, shape.v_dim
    gemm = 2 * 3  # FLOP per multiply-add, forward + backward
    uvqk = L * gemm * S * D * 2 * H * (A + V)
    output = L * gemm * S * 3 * H * V * D
    attention = L * attention_layer_flops(shape.rms_tokens ** 2, H, A, V)
    return STUFlops(float(attention), float(uvqk), float(output))


def stu_gemm_flops_per_token(shape: HSTUShape) -> float:
    """Forward + backward FLOP of one STU layer's UVQK and output GEMMs per token (`stu_flops`' count)."""
    D, H, A, V = shape.model_dim, shape.num_heads, shape.qk_dim, shape.v_dim
    return 2 * 3 * (D * 2 * H * (A + V) + 3 * H * V * D)


def attention_layer_flops(squared_tokens: float, heads: int, qk_dim: int, v_dim: int) -> float:
    """Forward + backward FLOP of one layer's attention over sequences whose squared lengths sum to
    `squared_tokens` (the reference's count: QK^T and AV over half the S x S pairs, the backward 2.5x the
    forward)."""
    return 2 * 3.5 * (squared_tokens / 2) * heads * (qk_dim + v_dim)


def check_sequence_sharding(option: ShardingOption) -> None:
    """ValueError (one line) for a sharding type torchrec's EmbeddingCollection sharder lacks."""
    if option.sharding not in SEQUENCE_SHARDINGS:
        raise ValueError(f"table {option.table.name}: sequence embeddings (EmbeddingCollection) shard "
                         f"{', '.join(SEQUENCE_SHARDINGS)}, not {option.sharding.value}")


def sequence_lookups(option: ShardingOption, topology: Topology, workload: Workload) -> tuple[float, float]:
    """Per step, the ids one shard of a sequence table looks up and the rows it outputs (the same: nothing
    is pooled): every id of the world's batch for a table-wise or column-wise shard, its rows' share (1 /
    world) for a row-wise one."""
    check_sequence_sharding(option)
    g = workload.batch_size_per_rank * topology.world_size
    ids = g * option.table.pooling_factor
    if option.sharding == ShardingType.ROW_WISE:
        ids /= topology.world_size
    return ids, ids


def sequence_comms_bytes(option: ShardingOption, topology: Topology, workload: Workload,
                         dim: int) -> tuple[float, float]:
    """Bytes one shard's rank sends to all ranks per step for a sequence table's shard of width `dim`: the
    input all-to-all (ids and each feature's lengths; row-wise also the permutation back, an int64 per id)
    and the output all-to-all (its rows forward; the backward sends the same bytes of their gradients)."""
    t = option.table
    b, w = workload.batch_size_per_rank, topology.world_size
    p, nf = t.pooling_factor, t.num_features
    if option.sharding == ShardingType.ROW_WISE:
        # every rank sends each of its ids to the row's owner and gets its rows back: b x p each way
        return b * (2 * p + nf) * ID_BYTES, b * p * dim * OUTPUT_BYTES
    check_sequence_sharding(option)
    # the shard's rank receives every rank's ids and sends every rank its rows
    return w * b * (p + nf) * ID_BYTES, w * b * p * dim * OUTPUT_BYTES


def sequence_perf(option: ShardingOption, topology: Topology, workload: Workload, lookup, all_to_all) -> Perf:
    """One shard's Perf for a sequence table: `lookup(ids, outputs, dim, rows)` -> (fwd, bwd) seconds of
    the lookup kernel, `all_to_all(bytes)` -> seconds of that share of a batched all-to-all."""
    t = option.table
    ids, outputs = sequence_lookups(option, topology, workload)
    dim = option.shards[0].num_cols
    rows = t.num_rows / topology.world_size if option.sharding == ShardingType.ROW_WISE else t.num_rows
    fwd, bwd = lookup(ids, outputs, dim, rows)
    id_bytes, row_bytes = sequence_comms_bytes(option, topology, workload, dim)
    out = all_to_all(row_bytes)
    return Perf(fwd, bwd, all_to_all(id_bytes) + out, out)


def activation_bytes(topology: Topology, dense_dtype: Precision) -> int:
    """Bytes of an activation element: 2 under bf16 autocast, 4 in fp32; `auto` (a device planned offline)
    is what the device's spec says auto runs (`DeviceSpec.auto_precision`: bf16 on an accelerator that has
    bf16 autocast), fp32 on a CPU."""
    if dense_dtype == Precision.auto:
        cpu = topology.compute_device == "cpu"
        return 2 if not cpu and topology.device.auto_precision == "bf16" else FP32_BYTES
    return 2 if dense_dtype == Precision.bf16 else FP32_BYTES


def rows_kept_for_backward(topology: Topology, dense_dtype: Precision) -> bool:
    """Whether the fp32 rows a sequence model read from the output all-to-all are still alive when its
    backward starts. In fp32 the preprocessor's first GEMMs save them as their inputs. Under bf16/fp16
    autocast those GEMMs save half-precision copies (`preprocessor_bytes_per_position`) and nothing else
    holds the rows: torchrec's sequence all-to-all (`All2All_Seq_Req_Wait`) and its unbucketize permute save
    no embeddings for their backward, so the rows are freed when the forward returns. (The all-to-all's
    send buffer is freed earlier, when the forward waits on it.)"""
    return activation_bytes(topology, dense_dtype) == FP32_BYTES


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes per element of what autograd keeps, by kind: `gemm`, a GEMM's input or output (2 under
    autocast); `norm_input`, a layer norm's input as it saves it; `stu_mask` and `input_mask`, the STU
    gating's and the input's dropout masks; `stack_input`, the STU stack's input (the first layer's)."""

    gemm: int
    norm_input: int
    stu_mask: int
    input_mask: int
    stack_input: int


def activation_dtypes(cpu: bool, half: bool) -> ActivationBytes:
    """What torch keeps on the device: on an accelerator, autocast runs layer norms in fp32 (CUDA's autocast
    lists layer_norm among its fp32 ops: its saved input is an fp32 copy, and the preprocessor's closing layer
    norms make the STU stack's input fp32) and dropout is the fused `native_dropout`, whose mask is bool; on
    the CPU, autocast leaves a layer norm in its input's dtype and dropout multiplies by a noise tensor of its
    input's dtype (the STU gating's input is fp32)."""
    a = 2 if half else FP32_BYTES
    if cpu:
        return ActivationBytes(a, a, FP32_BYTES, a, a)
    return ActivationBytes(a, FP32_BYTES, 1, 1, FP32_BYTES)


def job_activation_dtypes(topology: Topology, dense_dtype: Precision) -> ActivationBytes:
    """`activation_dtypes` of a job on `topology`'s device in its dense precision (`activation_bytes`)."""
    return activation_dtypes(topology.compute_device == "cpu", activation_bytes(topology, dense_dtype) == 2)


def stu_uvqk_bytes_per_token(shape: HSTUShape, ab: ActivationBytes) -> float:
    """Bytes per token autograd saves of an STU layer's UVQK part (its attention keeping q, k, v, views of
    the UVQK output, as the Triton kernel does): the input norm's input and statistics, the normed input as
    the GEMM reads it, the UVQK output."""
    D, U, QK = shape.model_dim, shape.num_heads * shape.v_dim, shape.num_heads * shape.qk_dim
    return ab.norm_input * D + LAYER_NORM_STATS_BYTES + ab.gemm * D + ab.gemm * (2 * U + 2 * QK)


def stu_gated_bytes_per_token(shape: HSTUShape, ab: ActivationBytes) -> float:
    """Bytes per token autograd saves of an STU layer's output part: the gating's three fp32 tensors (U,
    the attention output, the normed attention) and its norm's statistics, the dropout mask and the output
    GEMM's input [U, attention, gated]."""
    U = shape.num_heads * shape.v_dim
    mask = ab.stu_mask * 3 * U if shape.stu_dropout > 0 else 0
    return 3 * FP32_BYTES * U + LAYER_NORM_STATS_BYTES + mask + ab.gemm * 3 * U


def stu_kept_bytes_per_token(shape: HSTUShape, ab: ActivationBytes) -> float:
    """Bytes one STU layer's autograd keeps per token from its forward to its backward without selective
    recompute: every tensor its ops save, the UVQK part's and the output part's."""
    return stu_uvqk_bytes_per_token(shape, ab) + stu_gated_bytes_per_token(shape, ab)


def stu_selective_kept_bytes_per_token(shape: HSTUShape, ab: ActivationBytes, first_layer: bool) -> float:
    """Bytes one STU layer keeps per token with selective recompute: its input as it arrives (the STU
    stack's input for the first layer, the previous layer's GEMM output after it), U after SiLU and the
    attention output; the reference's set but its two norms' statistics (anyrec recomputes the norms)."""
    x = ab.stack_input if first_layer else ab.gemm
    return x * shape.model_dim + 2 * ab.gemm * shape.num_heads * shape.v_dim


def stu_layer_kept_bytes_per_token(shape: HSTUShape, ab: ActivationBytes, layer: int) -> float:
    """Bytes STU layer `layer` (0 the first) keeps per token, as `shape.stu_recompute` has it."""
    if shape.stu_recompute == STURecompute.selective:
        return stu_selective_kept_bytes_per_token(shape, ab, first_layer=layer == 0)
    return stu_kept_bytes_per_token(shape, ab)


def input_bytes_per_token(shape: HSTUShape, ab: ActivationBytes) -> float:
    """Bytes per token kept before the STU layers: the token's source row and its position and time bucket
    (int64 indices) and the input dropout's mask."""
    mask = ab.input_mask * shape.model_dim if shape.input_dropout > 0 else 0
    return 3 * INDEX_BYTES + mask


@dataclass(frozen=True)
class STUBackward:
    """Bytes per token one STU layer's backward holds beside what the layers keep, in each of its three
    parts, which run one after another, each freeing its saved tensors as it ends (so a layer that keeps
    everything has freed its output part's by the attention's backward: those parts count net of them).
    Measured on the simulated device in fp32 (dlrmv4_small, 64 samples, with selective recompute): the
    output part 1,164 bytes a token against 1,160 here; the attention part the recomputed UVQK output and the
    torch attention's buffers (`TORCH_ATTENTION_BACKWARD_SCORES`); with an attention that keeps q, k, v (as
    the Triton kernel does) the UVQK part holds the peak, within 50 bytes a token of its terms here, with
    selective recompute and without (tests/test_simdev_memory.py)."""

    output: float  # the gating recomputed (selective), the output GEMM input's gradient
    attention: float  # the UVQK output recomputed (selective), the attention output's gradient, workspace
    uvqk: float  # the UVQK GEMM's inputs recomputed (selective), the UVQK output's and the input's gradients

    @property
    def peak(self) -> float:
        return max(self.output, self.attention, self.uvqk)


def stu_backward_bytes_per_token(shape: HSTUShape, ab: ActivationBytes, attention_impl: str,
                                 selective: bool) -> STUBackward:
    """The parts of one STU layer's backward (STUBackward); `selective`: the layer recomputes what it did
    not keep (`HSTUShape.stu_recompute`). The output GEMM's backward gives y's gradient in the GEMM's dtype,
    cast to fp32 for the gating; the attention kernel's workspace is `ATTENTION_WORKSPACE_QKV` times the q,
    k, v bytes (the torch attention's padded buffers are per sample: `torch_attention_bytes_per_sample`)."""
    D, U, QK = shape.model_dim, shape.num_heads * shape.v_dim, shape.num_heads * shape.qk_dim
    a = ab.gemm
    grad_y = FP32_BYTES * 3 * U + (a * 3 * U if a != FP32_BYTES else 0)
    uvqk_out = a * (2 * U + 2 * QK)
    workspace = ATTENTION_WORKSPACE_QKV.get(attention_impl, max(ATTENTION_WORKSPACE_QKV.values()))
    gated = stu_gated_bytes_per_token(shape, ab)
    output = (gated if selective else 0) + grad_y
    # under selective recompute the UVQK GEMM's output and input are recomputed for the attention's and the
    # UVQK part's backward; without it they are kept, and the output part's saved tensors are freed by then,
    # but for U's and the attention output's size (measured: they stay alive through the later parts)
    again = uvqk_out + a * D + LAYER_NORM_STATS_BYTES if selective else -(gated - 2 * FP32_BYTES * U)
    attention = again + a * U + workspace * a * (2 * QK + U)
    # the u, v, q, k gradients beside their concatenation, then the normed input's and the input's
    uvqk = again + 2 * uvqk_out + 2 * a * D
    return STUBackward(output, attention, uvqk)


def preprocessor_bytes_per_position(shape: HSTUShape, ab: ActivationBytes) -> float:
    """Bytes per sequence position the preprocessor keeps: its three MLPs' inputs (the item, the artist and
    album, the action bits' encoding) and the action bits (bool), then per MLP its hidden layer's fp32
    tensors (the SwishLayerNorm's input, its sigmoid, their product as the second GEMM reads it), the norm
    statistics and the output norm's input (D wide)."""
    h, a = shape.preprocessor_hidden_dim, ab.gemm
    per_mlp = 2 * FP32_BYTES * h + LAYER_NORM_STATS_BYTES + a * h + ab.norm_input * shape.model_dim \
        + LAYER_NORM_STATS_BYTES
    action_bits = 4 if shape.preprocessor_action_dim else 0  # three bits and the target flag, bool
    return a * (shape.preprocessor_in_dim + shape.preprocessor_action_dim) + action_bits + 3 * per_mlp


def memory_tokens_per_sample(shape: HSTUShape, batch: int) -> float:
    """Tokens per sample a batch of `batch` is planned with for memory: the mean plus TOKEN_SIGMAS standard
    deviations of a batch's mean (sd / sqrt(batch)), at most the longest."""
    mean, rms = shape.mean_tokens, shape.rms_tokens
    sd = max(0.0, rms * rms - mean * mean) ** 0.5
    return min(float(shape.seq_len), mean + TOKEN_SIGMAS * sd / max(batch, 1) ** 0.5)


def lengths_text(shape: HSTUShape) -> str:
    """`mean 2,760, rms 2,800, longest 4,096 tokens/sample` (or `4,096 tokens/sample, every sample at its
    longest` where the lengths are not given)."""
    if shape.mean_seq_len is None:
        return f"{shape.seq_len:,} tokens/sample, every sample at its longest"
    return (f"mean {shape.mean_tokens:,.0f}, rms {shape.rms_tokens:,.0f}, "
            f"longest {shape.longest_tokens:,.0f} tokens/sample")


@dataclass(frozen=True)
class HSTUMemory:
    """Per sample, the bytes of an HSTU dense part alive at its memory's two moments: `activation`, the peak
    of the last STU layer's backward (what every layer keeps, the gradient arriving, and the largest of that
    layer's backward parts: `STUBackward`; the torch attention's padded buffers beside its part) and
    `gradient`, the backward reaching the embeddings (the gradient of the embeddings read, fp32, and the
    preprocessor's input gradient). The per-token terms: `kept_layers` (every layer's kept tensors; with
    activation recompute, their inputs), `recomputed` (activation recompute's: the last layer's forward
    again), `preprocessor` (per position), `backward` (the largest backward part's, per token)."""

    kept_layers: float
    recomputed: float
    preprocessor: float
    backward: float
    activation: float
    gradient: float


@dataclass(frozen=True)
class TorchAttentionBytes:
    """Per sample, the torch attention's padded buffers: `kept` from the forward to the backward (every
    layer's), `backward` its last layer's backward temporaries."""

    kept: float
    backward: float


def torch_attention_bytes_per_sample(shape: HSTUShape, batch: int, recompute: bool) -> TorchAttentionBytes:
    """The torch attention's padded score tensors per sample, its batch padded to the longest sample: each
    layer keeps its scores, probabilities, mask and padded q, k, v, and the last layer's backward holds
    TORCH_ATTENTION_BACKWARD_SCORES more. Where a batch's scores pass CHUNK_SCORE_ELEMENTS the attention
    runs chunk by chunk under checkpointing, and with `recompute` layer by layer: one chunk of one layer at
    a time in the backward, nothing kept (not measured)."""
    N, H = shape.longest_tokens, shape.num_heads
    scores = H * N * N  # score elements per sample
    per_layer = (FP32_BYTES * TORCH_ATTENTION_KEPT_SCORES * scores + N * N
                 + FP32_BYTES * H * N * (2 * shape.qk_dim + shape.v_dim))
    backward = FP32_BYTES * TORCH_ATTENTION_BACKWARD_SCORES * scores
    chunks = -(-max(batch, 1) * scores // CHUNK_SCORE_ELEMENTS)
    if chunks > 1 or recompute:
        return TorchAttentionBytes(0.0, (per_layer + backward) / chunks)
    return TorchAttentionBytes(shape.num_layers * per_layer, backward)


def hstu_memory_per_sample(shape: HSTUShape, ab: ActivationBytes, attention_impl: str, recompute: bool,
                           tokens: float, batch: int = 1) -> HSTUMemory:
    """The HSTU part's bytes per sample of `tokens` tokens in a batch of `batch` (see HSTUMemory);
    `recompute`: each layer keeps its input only and recomputes the rest in its backward
    (torch.utils.checkpoint around each STU layer, a what-if), whatever `shape.stu_recompute`: the last
    layer's forward runs again and its backward holds what a layer keeps without recompute."""
    L, a, D = shape.num_layers, ab.gemm, shape.model_dim
    positions = tokens - shape.contextual
    selective = shape.stu_recompute == STURecompute.selective and not recompute
    kept = sum(stu_layer_kept_bytes_per_token(shape, ab, i) for i in range(L))
    recomputed = 0.0
    if recompute:
        kept, recomputed = L * a * D, stu_kept_bytes_per_token(shape, ab)
    pre = preprocessor_bytes_per_position(shape, ab)
    parts = stu_backward_bytes_per_token(shape, ab, attention_impl, selective)
    # what is alive through the last layer's backward: every layer's kept tensors, the input's indices and
    # mask, the preprocessor's, the gradient arriving from the layer above (the stack output's)
    level = tokens * (kept + recomputed + input_bytes_per_token(shape, ab) + a * D) + positions * pre
    attention = tokens * parts.attention
    if attention_impl == "torch":
        padded = torch_attention_bytes_per_sample(shape, batch, recompute)
        level += padded.kept
        attention += padded.backward
    activation = level + max(tokens * parts.output, attention, tokens * parts.uvqk)
    gradient = positions * FP32_BYTES * shape.preprocessor_in_dim + tokens * a * D
    return HSTUMemory(kept, recomputed, pre, parts.peak, activation, gradient)


@dataclass(frozen=True)
class HSTUTime:
    """Seconds per step of an HSTU dense part on one rank, by kind; `recompute_s` is activation recompute's
    extra forward, `selective_recompute_s` what the model's selective recompute adds."""

    gemm_s: float
    attention_s: float
    elementwise_s: float
    recompute_s: float = 0.0
    selective_recompute_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (self.gemm_s + self.attention_s + self.elementwise_s + self.recompute_s
                + self.selective_recompute_s)


def measured_hstu(rates: tuple[HSTURates, ...], shape: HSTUShape, attention_impl: str,
                       half: bool) -> HSTURates | None:
    """The rate `attention_impl` was measured at on `shape`'s heads, dims and lengths in the job's dtype
    (bf16 where `half`), or None where it was not (another job's shapes, another implementation)."""
    dtype = "bf16" if half else "fp32"
    for r in rates:
        same = (r.impl == attention_impl and r.dtype == dtype
                and (r.heads, r.qk_dim, r.v_dim) == (shape.num_heads, shape.qk_dim, shape.v_dim))
        if same and all(math.isclose(a, b, rel_tol=1e-6) for a, b in (
                (r.mean_tokens, shape.mean_tokens), (r.rms_tokens, shape.rms_tokens),
                (r.longest_tokens, shape.longest_tokens))):
            return r
    return None


def job_hstu_rates(options: PlanOptions, topology: Topology) -> HSTURates | None:
    """`measured_hstu` for a job's HSTU shape, attention implementation and activation dtype."""
    if options.hstu is None:
        return None
    half = activation_bytes(topology, options.dense_dtype) == 2
    return measured_hstu(options.hstu_rates, options.hstu, options.attention_impl, half)


def offline_attention(device_type: str) -> str:
    """The attention implementation a device of `device_type` runs where no backend chose one (planning
    for hardware not at hand): anyrec's Triton kernels on an accelerator, the torch one on a CPU (Triton
    runs there only under its interpreter)."""
    return "torch" if device_type == "cpu" else "triton"


def attention_efficiency(attention_impl: str) -> float:
    """The implementation's attention efficiency (ATTENTION_EFFICIENCY); ValueError for an unknown one."""
    if attention_impl not in ATTENTION_EFFICIENCY:
        raise ValueError(f"attention implementation {attention_impl!r} has no efficiency in the cost model; "
                         f"known: {', '.join(ATTENTION_EFFICIENCY)}")
    return ATTENTION_EFFICIENCY[attention_impl]


def hstu_time_s(shape: HSTUShape, other_flops_per_sample: float, batch: int, device: DeviceSpec,
                ab: ActivationBytes, dense_efficiency: float, attention_impl: str,
                recompute: bool, rates: HSTURates | None = None) -> HSTUTime:
    """Forward + backward seconds of `batch` samples through the HSTU part on `device`. Where `rates` were
    measured at the job's shapes (`measured_hstu`): the STU GEMMs and the model's other GEMMs
    (`other_flops_per_sample`, over the same tokens) at the measured GEMM rate, the attention at its
    implementation's measured rate, the elementwise passes over the kept activations at the measured
    elementwise bandwidth; where the whole dense part was timed too (`rates.dense_step_s`), its time per
    sample at this batch instead, split by those parts' shares. Otherwise: the GEMMs at `dense_efficiency`
    of peak (bf16 peak where the activations are half, `ab`), the attention at its implementation's
    assumed efficiency of peak, the elementwise passes at HBM bandwidth. With `recompute`, one more
    forward of the STU stack."""
    flops = stu_flops(shape)
    peak = device.peak_bf16_flops if ab.gemm == 2 else device.peak_fp32_flops
    streamed = ELEMENTWISE_PASSES * batch * shape.mean_tokens * shape.num_layers * stu_kept_bytes_per_token(
        shape, ab)
    if rates is None:
        gemm_rate, attn_rate = peak * dense_efficiency, peak * attention_efficiency(attention_impl)
        elementwise = streamed / (device.memory_bw_bytes_per_s * ELEMENTWISE_EFFICIENCY)
        forward = 1 / 3.5  # of the attention's forward + backward, by the FLOP count
    else:
        gemm_rate, attn_rate = rates.gemm_flops_per_s, rates.flops_per_s
        elementwise = streamed / rates.elementwise_bw_bytes_per_s
        forward = rates.forward_s / rates.step_s
    gemm = batch * (flops.uvqk + flops.output + other_flops_per_sample) / gemm_rate
    attention = batch * flops.attention / attn_rate
    extra = 0.0
    if recompute:  # one more forward: a third of the GEMMs', the attention's forward, one elementwise pass
        extra = (batch * (flops.uvqk + flops.output) / 3 / gemm_rate + attention * forward
                 + elementwise / ELEMENTWISE_PASSES)
    selective = 0.0 if recompute else selective_recompute_s(shape, batch, device, ab, gemm_rate)
    if rates is not None and rates.dense_step_s > 0:
        # the whole dense part was timed at the job's shapes: its seconds (per sample, at this batch), split
        # by the parts' modelled shares; activation recompute's extra forward (a what-if) stays modelled
        parts = gemm + attention + elementwise + selective
        scale = rates.dense_step_s * batch / rates.batch / parts
        gemm, attention, elementwise, selective = (x * scale
                                                   for x in (gemm, attention, elementwise, selective))
    return HSTUTime(gemm, attention, elementwise, extra, selective)


def selective_recompute_s(shape: HSTUShape, batch: int, device: DeviceSpec, ab: ActivationBytes,
                          gemm_rate: float) -> float:
    """Seconds the selective recompute (`shape.stu_recompute`) adds to a step of `batch` samples: the UVQK
    GEMM's forward once more (a third of its FLOPs) at `gemm_rate`, and the tensors it recomputes rather
    than keeps written once more at HBM bandwidth (the norms, SiLU and gating: one elementwise pass)."""
    if shape.stu_recompute != STURecompute.selective:
        return 0.0
    L = shape.num_layers
    dropped = L * stu_kept_bytes_per_token(shape, ab) - sum(
        stu_layer_kept_bytes_per_token(shape, ab, i) for i in range(L))
    written = batch * shape.mean_tokens * dropped / (device.memory_bw_bytes_per_s * ELEMENTWISE_EFFICIENCY)
    return batch * stu_flops(shape).uvqk / 3 / gemm_rate + written


def dense_bytes_per_sample(options: PlanOptions, topology: Topology, batch: int) -> tuple[int, int, int]:
    """The dense part's bytes per sample alive during the lookups, at the forward's end (for HSTU: the
    backward's start, its peak) and while the backward reaches the embeddings: the model's stated figures,
    or, for an HSTU part, `hstu_memory_per_sample` at the job's activation dtypes and a batch of `batch`'s
    planned tokens (`memory_tokens_per_sample`)."""
    if options.hstu is None:
        return (options.dense_lookup_bytes_per_sample, options.dense_activation_bytes_per_sample,
                options.dense_gradient_bytes_per_sample)
    tokens = memory_tokens_per_sample(options.hstu, batch)
    m = hstu_memory_per_sample(options.hstu, job_activation_dtypes(topology, options.dense_dtype),
                               options.attention_impl, options.activation_recompute, tokens, batch)
    return 0, int(m.activation), int(m.gradient)
