"""anyrec.planner.sequence: sequence embeddings per EmbeddingCollection sharding type, the STU layers' FLOPs,
time and memory, activation recompute, and DLRMv4's two done-when plans."""

import dataclasses
import re

import pytest
import torch

from anyrec.backends import resolve_hardware
from anyrec.backends.dispatch import FBGEMM_EMBEDDING, get_impl
from anyrec.backends.specs import get_sku
from anyrec.config import STURecompute
from anyrec.kernels.hstu import CHUNK_SCORE_ELEMENTS
from anyrec.models.dlrmv4 import ATTENTION_OP
from anyrec.models.family import resolve_family
from anyrec.models.hstu import DLRMv4Config, dlrmv4_flops_per_sample
from anyrec.plan import run
from anyrec.planner import sequence
from anyrec.planner.advice import _buffers_per_rank
from anyrec.planner.estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator, shard_lookups
from anyrec.planner.job import largest_fitting_batch
from anyrec.planner.memory import predict_memory
from anyrec.planner.planned import SEQUENCE_2D_REFUSAL, plan_job
from anyrec.planner.planner import CoDesignPlanner, make_workload
from anyrec.planner.types import (
    InfeasiblePlanError,
    Perf,
    Placement,
    Shard,
    ShardingOption,
    ShardingType,
    Storage,
    TableSpec,
    Topology,
)
from anyrec.schema import HSTUShape
from tests.conftest import compose_config

REFERENCE = HSTUShape(4096, 3, 512, 4, 128, 128, contextual=8, preprocessor_in_dim=1536,
                      preprocessor_hidden_dim=256)
B, W, S, D = 64, 4, 1000, 256


def _option(sharding: ShardingType, sequence_table: bool = True, cols: int = D) -> ShardingOption:
    t = TableSpec("items", 100_000, D, float(S), ["items"], sequence=sequence_table)
    n = W if sharding == ShardingType.ROW_WISE else 1
    shards = [Shard(t.num_rows // n, cols, Storage(), Perf(), rank=r) for r in range(n)]
    return ShardingOption(t, sharding, Placement.HBM, "fused", shards)


def _topology() -> Topology:
    return Topology(get_sku("mi355x"), W)


def _workload(option: ShardingOption):
    return make_workload([option.table], B, "rowwise_adagrad")


def test_reference_stu_flops_are_315_7_gflop_per_sample():
    f = sequence.stu_flops(REFERENCE)
    assert f.total / 1e9 == pytest.approx(315.7, abs=0.05)
    assert (f.attention / 1e9, f.uvqk / 1e9, f.output / 1e9) == pytest.approx((180.4, 77.3, 58.0), abs=0.05)
    model = dlrmv4_flops_per_sample(DLRMv4Config(), 4096)  # the model's own count agrees
    assert (f.attention, f.uvqk, f.output) == (model.attention, model.uvqk, model.output)


def test_sequence_rows_travel_unpooled_each_way():
    topo = _topology()
    tw, rw = _option(ShardingType.TABLE_WISE), _option(ShardingType.ROW_WISE)
    # table-wise: the owner sends every rank's B x S rows of D fp32; row-wise: each rank its own B x S
    assert sequence.sequence_comms_bytes(tw, topo, _workload(tw), D)[1] == W * B * S * D * 4
    assert sequence.sequence_comms_bytes(rw, topo, _workload(rw), D)[1] == B * S * D * 4
    # ids: every rank's ids and each feature's lengths to the owner; row-wise also the permutation back
    assert sequence.sequence_comms_bytes(tw, topo, _workload(tw), D)[0] == W * B * (S + 1) * 8
    assert sequence.sequence_comms_bytes(rw, topo, _workload(rw), D)[0] == B * (2 * S + 1) * 8
    # one output row per id: a row-wise shard writes its share of the ids, not every bag
    assert sequence.sequence_lookups(rw, topo, _workload(rw)) == (B * S, B * S)
    assert shard_lookups(rw, topo, _workload(rw)) == (B * S, B * S, W)


def test_sequence_table_costs_its_rows_not_bags():
    topo = _topology()
    seq, pooled = _option(ShardingType.ROW_WISE), _option(ShardingType.ROW_WISE, sequence_table=False)
    for opt in (seq, pooled):
        EmbeddingPerfEstimator().estimate(opt, topo, _workload(opt))
    # the backward sends each row's gradient back: as many bytes as the forward's rows
    p = seq.shards[0].perf
    assert p.bwd_comms_s > 0 and p.fwd_comms_s > p.bwd_comms_s
    # pooled row-wise reduce-scatters B x D bags per rank; unpooled moves B x S rows: far more
    assert p.comms_s > 10 * pooled.shards[0].perf.comms_s


def test_column_wise_sequence_shard_moves_its_columns():
    topo = _topology()
    cw = _option(ShardingType.COLUMN_WISE, cols=D // 2)
    assert sequence.sequence_comms_bytes(cw, topo, _workload(cw), D // 2)[1] == W * B * S * (D // 2) * 4


def test_sequence_storage_keeps_one_batch_of_rows():
    topo = _topology()
    tw = _option(ShardingType.TABLE_WISE)
    wl = _workload(tw)
    EmbeddingStorageEstimator().estimate(tw, topo, wl)
    rows = W * B * S * D * 4
    weights = tw.table.weight_bytes
    got = tw.shards[0].storage.hbm_bytes - weights
    assert rows <= got < 1.1 * rows + wl.options.pipeline_depth * W * B * S * 8 + 2 * tw.table.num_rows * 4


def test_data_parallel_sequence_is_refused():
    opt = _option(ShardingType.DATA_PARALLEL)
    with pytest.raises(ValueError, match="EmbeddingCollection"):
        sequence.sequence_lookups(opt, _topology(), _workload(opt))


GPU_BF16 = sequence.activation_dtypes(cpu=False, half=True)
GPU_FP32 = sequence.activation_dtypes(cpu=False, half=False)


def test_stu_memory_terms_and_recompute():
    shape = REFERENCE
    kept = sequence.stu_kept_bytes_per_token(shape, GPU_BF16)
    # bf16 on a GPU: the norm's fp32 input, normed, uvqk, y at 2 bytes, the gating's three fp32 tensors, the
    # two norms' statistics; no mask without dropout
    assert kept == 4 * 512 + 2 * (512 + 2048 + 3 * 512) + 4 * 3 * 512 + 16
    dropout = HSTUShape(4096, 3, 512, 4, 128, 128, contextual=8, stu_dropout=0.1)
    assert sequence.stu_kept_bytes_per_token(dropout, GPU_BF16) == kept + 3 * 512  # a bool mask
    full = sequence.hstu_memory_per_sample(shape, GPU_BF16, "triton", recompute=False, tokens=4096)
    less = sequence.hstu_memory_per_sample(shape, GPU_BF16, "triton", recompute=True, tokens=4096)
    assert full.activation > 1.5 * less.activation > 0
    # recompute keeps each layer's input and one layer's tensors
    assert full.activation - less.activation == pytest.approx(4096 * (2 * kept - 3 * 2 * 512))
    # selective recompute: a layer keeps its input (the first layer's fp32, the stack's input under autocast),
    # U and the attention output, and one layer's larger recomputed part is alive in its backward
    selective = dataclasses.replace(shape, stu_recompute=STURecompute.selective)
    assert [sequence.stu_layer_kept_bytes_per_token(selective, GPU_BF16, i) for i in range(3)] == [
        4 * 512 + 2 * 2 * 512, 3 * 2 * 512, 3 * 2 * 512]
    # the last layer's backward peaks in its output part: the gating recomputed and the output GEMM input's
    # gradient (bf16 from the GEMM, then fp32 for the gating); without recompute its gradient alone, the
    # later parts net of the gating's saved tensors (but U's and the attention output's size), freed by then
    gated = 4 * 3 * 512 + 8 + 2 * 3 * 512
    uvqk_out = 2 * (2 * 512 + 2 * 512)
    again = uvqk_out + 2 * 512 + 8  # the UVQK GEMM's output and input, recomputed
    parts = sequence.stu_backward_bytes_per_token(selective, GPU_BF16, "triton", selective=True)
    assert parts.output == gated + (2 + 4) * 3 * 512 == parts.peak
    assert parts.attention == again + 2 * 512 + 2 * 2 * (2 * 512 + 512)  # its output's gradient, workspace
    assert parts.uvqk == again + 2 * uvqk_out + 2 * 2 * 512  # the u, v, q, k gradients, concatenated
    keeps = sequence.stu_backward_bytes_per_token(shape, GPU_BF16, "triton", selective=False)
    assert keeps.output == (2 + 4) * 3 * 512 == keeps.peak
    assert keeps.uvqk == -(gated - 2 * 4 * 512) + 2 * uvqk_out + 2 * 2 * 512
    sel = sequence.hstu_memory_per_sample(selective, GPU_BF16, "triton", recompute=False, tokens=4096)
    assert full.activation - sel.activation == pytest.approx(4096 * (3 * kept - (4096 + 2 * 3072) - gated))
    assert sel.activation < 0.7 * full.activation
    # activation recompute (the what-if) overrides it
    assert sequence.hstu_memory_per_sample(selective, GPU_BF16, "triton", True, 4096) == less
    # fp32 keeps more than bf16; the torch attention's padded buffers hold more than the Triton kernel's
    # workspace
    assert sequence.stu_kept_bytes_per_token(shape, GPU_FP32) > kept
    torch_ws = sequence.hstu_memory_per_sample(shape, GPU_BF16, "torch", recompute=False, tokens=4096)
    assert torch_ws.activation > full.activation
    # memory grows with the tokens (jagged: nothing padded)
    half = sequence.hstu_memory_per_sample(shape, GPU_BF16, "triton", recompute=False, tokens=2048)
    assert half.activation < 0.51 * full.activation


def test_lengths_mean_for_gemms_mean_square_for_attention():
    jagged = HSTUShape(4096, 3, 512, 4, 128, 128, contextual=8, mean_seq_len=2048, rms_seq_len=2896)
    f, bound = sequence.stu_flops(jagged), sequence.stu_flops(REFERENCE)
    assert f.uvqk == pytest.approx(bound.uvqk / 2) and f.output == pytest.approx(bound.output / 2)
    assert f.attention == pytest.approx(bound.attention * (2896 / 4096) ** 2)
    # a batch's memory: the mean plus three standard deviations of a batch's mean, at most the longest
    sd = (2896 ** 2 - 2048 ** 2) ** 0.5
    assert sequence.memory_tokens_per_sample(jagged, 1024) == pytest.approx(2048 + 3 * sd / 32)
    assert sequence.memory_tokens_per_sample(jagged, 1) == 4096
    assert sequence.memory_tokens_per_sample(REFERENCE, 1024) == 4096
    assert "mean 2,048, rms 2,896, longest 4,096" in sequence.lengths_text(jagged)
    for bad in ({"mean_seq_len": 2048}, {"mean_seq_len": 3000, "rms_seq_len": 2900},
                {"mean_seq_len": 3000, "rms_seq_len": 5000}, {"mean_seq_len": 4, "rms_seq_len": 5}):
        with pytest.raises(ValueError, match="HSTU shape"):
            HSTUShape(4096, 3, 512, 4, 128, 128, contextual=8, **bad)


def test_dlrmv4_plans_the_configured_lengths():
    _, cfg = compose_config(["model=dlrmv4"])
    facts = resolve_family(cfg.model).workload_facts(cfg.model)
    assert (facts.hstu.mean_tokens, facts.hstu.rms_tokens, facts.hstu.seq_len) == (2760, 2800, 4096)
    assert facts.lookups_per_sample["item_id"] == 2760 - 8
    model = dlrmv4_flops_per_sample(DLRMv4Config(), 2760)
    at_rms = dlrmv4_flops_per_sample(DLRMv4Config(), 2800).attention  # at the rms: above
    assert facts.dense_flops_per_sample == pytest.approx(model.total - model.attention + at_rms)
    assert facts.dense_flops_per_sample > model.total
    _, bound = compose_config(["model=dlrmv4", "~model.hstu.mean_seq_len", "~model.hstu.rms_seq_len"])
    hstu = resolve_family(bound.model).workload_facts(bound.model).hstu
    assert hstu.mean_tokens == hstu.rms_tokens == 4096  # every sample at its longest: the bound
    _, one = compose_config(["model=dlrmv4", "~model.hstu.rms_seq_len"])
    with pytest.raises(ValueError, match="together"):
        resolve_family(one.model).workload_facts(one.model)


def test_hstu_time_splits_gemm_attention_and_recompute():
    dev = get_sku("mi355x")
    t = sequence.hstu_time_s(REFERENCE, 0.0, 1024, dev, GPU_BF16, 0.5, "triton", recompute=False)
    f = sequence.stu_flops(REFERENCE)
    assert t.gemm_s == pytest.approx(1024 * (f.uvqk + f.output) / (dev.peak_bf16_flops * 0.5))
    assert t.attention_s == pytest.approx(1024 * f.attention / (dev.peak_bf16_flops * 0.35))
    assert t.elementwise_s > 0 and t.recompute_s == 0
    r = sequence.hstu_time_s(REFERENCE, 0.0, 1024, dev, GPU_BF16, 0.5, "triton", recompute=True)
    assert r.recompute_s == pytest.approx(t.gemm_s / 3 + t.attention_s / 3.5 + t.elementwise_s / 3)
    fp32 = sequence.hstu_time_s(REFERENCE, 0.0, 1024, dev, GPU_FP32, 0.5, "triton", recompute=False)
    assert fp32.gemm_s > 10 * t.gemm_s  # bf16 where the device has it
    assert t.selective_recompute_s == 0
    # selective recompute: the UVQK GEMM's forward once more and the tensors it drops written once more
    selective = dataclasses.replace(REFERENCE, stu_recompute=STURecompute.selective)
    s = sequence.hstu_time_s(selective, 0.0, 1024, dev, GPU_BF16, 0.5, "triton", recompute=False)
    dropped = 3 * sequence.stu_kept_bytes_per_token(REFERENCE, GPU_BF16) - (4096 + 2 * 3072)
    written = 1024 * 4096 * dropped / (dev.memory_bw_bytes_per_s * sequence.ELEMENTWISE_EFFICIENCY)
    assert s.selective_recompute_s == pytest.approx(t.gemm_s * f.uvqk / (f.uvqk + f.output) / 3 + written)
    assert s.total_s == pytest.approx(t.total_s + s.selective_recompute_s)
    what_if = sequence.hstu_time_s(selective, 0.0, 1024, dev, GPU_BF16, 0.5, "triton", recompute=True)
    assert what_if.selective_recompute_s == 0 and what_if.recompute_s == r.recompute_s
    slow = sequence.hstu_time_s(REFERENCE, 0.0, 1024, dev, GPU_BF16, 0.5, "torch", recompute=False)
    assert slow.attention_s > 3 * t.attention_s
    with pytest.raises(ValueError, match="no efficiency"):
        sequence.attention_efficiency("cutlass")


def _plan(overrides: list[str]):
    _, cfg = compose_config(["model=dlrmv4", *overrides])
    lines: list[str] = []
    return run(cfg, print_fn=lines.append), "\n".join(lines)


def _sequence_plan(device_type: str | None, sharding: ShardingType = ShardingType.ROW_WISE):
    """A small HSTU workload (one sequence table) planned on 2 x MI355X run on `device_type`."""
    shape = HSTUShape(64, 2, 32, 2, 16, 16, contextual=1, preprocessor_in_dim=32, preprocessor_hidden_dim=32)
    table = TableSpec("items", 10_000, 32, 60.0, ["items"], sequence=True)
    topo = Topology(get_sku("mi355x"), 2, 2, device_type)
    return CoDesignPlanner().plan([table], topo, 256, "rowwise_adagrad", 1000, hstu=shape,
                                  allowed_shardings=(sharding,))


def test_sequence_rows_at_the_backward_start():
    """At the backward's start a sequence model holds neither the output all-to-all's send buffer (freed at
    the forward's wait) nor, under bf16 autocast, the fp32 rows it read (its GEMMs keep bf16 copies); in
    fp32 its first GEMMs keep the rows."""
    rows = 256 * 60 * 32 * 4  # one rank's batch of rows read, fp32
    for sharding in (ShardingType.ROW_WISE, ShardingType.TABLE_WISE):
        gpu = predict_memory(_sequence_plan(None, sharding))
        assert all(m.peak_phase == "interaction" and m.embedding_io_bytes == 0 for m in gpu)
    cpu = _sequence_plan("cpu")
    assert [m.embedding_io_bytes for m in predict_memory(cpu)] == [rows, rows]
    # the planner's per-rank dense storage holds the rows where the peak does
    gpu = _sequence_plan(None)
    for plan, kept in ((gpu, 0), (cpu, rows)):
        activations = 256 * sequence.dense_bytes_per_sample(plan.workload.options, plan.topology, 256)[1]
        assert kept <= plan.base.storage.hbm_bytes - activations < kept + rows / 10  # + the dense model
    # the advice's buffers: a sequence table's batches in flight hold its ids, not rows
    wl = gpu.workload
    assert _buffers_per_rank(wl) == wl.options.pipeline_depth * 256 * (60 + 60) * 8


def test_mi355x_plans_the_reference_batch_with_every_table_in_hbm_and_prints_samples_per_s():
    """8 x MI355X at 1,024 samples per rank: the STU layers' selective recompute (the model's default, the
    reference's) keeps the predicted peak under the usable 286 GB with every table in HBM, no what-if; the
    same plan with layers that keep everything is 85-100 GB over a rank (docs/planning.md)."""
    result, text = _plan(["hardware=mi355x", "topology.world_size=8"])
    opts = result.workload.options
    assert result.workload.batch_size_per_rank == 1024 and not opts.activation_recompute
    assert opts.hstu.stu_recompute == STURecompute.selective
    assert all(o.placement == Placement.HBM for o in result.tables.values())
    assert "samples/s" in text and "M samples" in text and "selective recompute" in text
    assert "tables leave HBM" not in text and "what-if" not in text
    # the fleet line: a count where one holds every table, and where none can at this batch, why not
    (fewest,) = (ln for ln in text.splitlines() if "fewest devices holding every table" in ln)
    assert "MI355X 5" in fewest and ">" not in fewest, fewest
    assert "on H100, H200 no device count does at 1,024 samples per rank" in fewest, fewest
    assert {o.sharding for o in result.tables.values()} <= set(sequence.SEQUENCE_SHARDINGS)
    usable = 286e9
    assert all(m.reserved_bytes <= usable for m in predict_memory(result))
    keeps_all = dataclasses.replace(opts, hstu=dataclasses.replace(opts.hstu,
                                                                   stu_recompute=STURecompute.none))
    whole = dataclasses.replace(result, workload=dataclasses.replace(result.workload, options=keeps_all))
    short = max(m.reserved_bytes for m in predict_memory(whole)) - usable
    assert 85e9 < short < 100e9


def _h100_refusal(*extra: str) -> tuple[str, int]:
    with pytest.raises(InfeasiblePlanError, match=r"GB short before any table") as e:
        _plan(["hardware=h100", "topology.world_size=8", *extra])
    line = str(e.value)
    assert "\n" not in line and "activations" in line and "allowing uvm_caching" not in line
    return line, int(re.search(r"would fit on 8 x H100: (\d+) samples per rank", line).group(1))


def test_h100_refuses_the_reference_batch_naming_memory_and_what_fits():
    """8 x H100 at 1,024 per rank: one line naming the memory and the shortfall, and the largest smaller
    batch, planned (planning it again fits; the next step up does not without recompute)."""
    line, batch = _h100_refusal()
    assert 32 <= batch < 1024 and "planned: predicted" in line
    fits, _ = _plan(["hardware=h100", "topology.world_size=8", f"plan.batch_size={batch}"])
    assert fits.workload.batch_size_per_rank == batch and not fits.workload.options.activation_recompute
    try:
        above, _ = _plan(["hardware=h100", "topology.world_size=8", f"plan.batch_size={batch + 32}"])
        assert above.workload.options.activation_recompute
    except InfeasiblePlanError:
        pass
    # with HBM only, no batch fits (the tables alone fill a rank): the hint plans with UVM allowed
    hbm_line, hbm_batch = _h100_refusal("planner.allow_uvm=false")
    assert hbm_batch == batch and "with planner.allow_uvm=true" in hbm_line


def test_largest_fitting_batch_searches_multiples():
    fits_below = 300

    def plan_at(b: int):
        if b > fits_below:
            raise InfeasiblePlanError("too big")
        return b

    assert largest_fitting_batch(plan_at, 1024) == 288
    assert largest_fitting_batch(plan_at, 20) == 19  # below one step: any batch
    assert largest_fitting_batch(lambda b: plan_at(b + 1000), 1024) is None


def test_trainer_refuses_a_plan_that_needs_recompute():
    _, cfg = compose_config(["model=dlrmv4", "hardware=mi355x", "topology.world_size=8",
                             "planner.allow_uvm=false", "model.hstu.stu_recompute=none"])
    family = resolve_family(cfg.model)
    meta = torch.device("meta")
    model = family.build_train(cfg.model, meta, meta, {ATTENTION_OP: get_impl(ATTENTION_OP, "triton")})
    args = (cfg, model, family.sparse_module(model), family.sparse_path, family.workload_facts(cfg.model),
            resolve_hardware("mi355x"), FBGEMM_EMBEDDING, 8, 8, 1024)
    what_if = plan_job(*args, what_if=True)
    assert what_if.result.workload.options.activation_recompute
    # as the trainer calls it: refused, with a batch that fits without recompute
    with pytest.raises(InfeasiblePlanError, match="would fit with activation recompute .* would fit on 8 x "
                                                  r"MI355X: \d+ samples per rank"):
        plan_job(*args)


def test_2d_for_sequences_is_refused_in_one_line():
    with pytest.raises(ValueError) as e:
        _plan(["hardware=mi355x", "topology.world_size=8", "planner.sharding_group_size=4"])
    assert str(e.value) == SEQUENCE_2D_REFUSAL


def test_data_parallel_sequence_tables_are_refused_in_one_line():
    """torchrec's EmbeddingCollection cannot run a data-parallel sequence table (its output split
    fails mid-step): a forced data_parallel is refused before any table is built."""
    for planner in ("codesign", "simple"):
        with pytest.raises(ValueError, match="sequence tables") as e:
            _plan(["hardware=mi355x", "topology.world_size=8", "planner.sharding=data_parallel",
                   f"planner={planner}"])
        assert "\n" not in str(e.value)


def test_torch_attention_holds_padded_scores():
    """The torch attention pads a batch to its longest sample and keeps [b, H, N, N] fp32 scores: two per
    layer, their mask and the padded q, k, v, and six more in the last layer's backward; past the chunk
    bound it runs one checkpointed chunk at a time. The Triton kernel holds none of it."""
    shape = HSTUShape(64, 2, 32, 2, 16, 16, contextual=8, mean_seq_len=51.7, rms_seq_len=52.0,
                      longest_seq_len=57)
    scores = 2 * 57 * 57
    per_layer = 4 * 2 * scores + 57 * 57 + 4 * 2 * 57 * (2 * 16 + 16)
    one_chunk = sequence.torch_attention_bytes_per_sample(shape, 128, recompute=False)
    assert one_chunk == sequence.TorchAttentionBytes(2 * per_layer, 4 * 6 * scores)
    torch_m, triton_m = (sequence.hstu_memory_per_sample(shape, GPU_FP32, impl, False, 52.0, 128)
                         for impl in ("torch", "triton"))
    # the padded buffers at the peak, in the attention's part of the last layer's backward (its q, k, v
    # gradients among them: no Triton workspace), beside what every layer keeps
    parts = {impl: sequence.stu_backward_bytes_per_token(shape, GPU_FP32, impl, selective=False)
             for impl in ("torch", "triton")}
    assert parts["triton"].attention - parts["torch"].attention == 2 * 4 * 2 * (2 * 16 + 16)
    torch_peak = max(parts["torch"].output * 52, parts["torch"].attention * 52 + one_chunk.backward,
                     parts["torch"].uvqk * 52)
    assert torch_m.activation - triton_m.activation == pytest.approx(
        one_chunk.kept + torch_peak - 52 * parts["triton"].peak)
    # padded to the longest sample, not the mean: the bound when the data's longest is not given
    bound = HSTUShape(64, 2, 32, 2, 16, 16, contextual=8, mean_seq_len=51.7, rms_seq_len=52.0)
    assert bound.longest_tokens == 64
    padded_bound = sequence.torch_attention_bytes_per_sample(bound, 128, False)
    assert padded_bound.kept > 1.2 * one_chunk.kept and padded_bound.backward > 1.2 * one_chunk.backward
    # a batch whose scores pass the chunk bound: one chunk of one layer at a time
    big = 4 * CHUNK_SCORE_ELEMENTS // scores
    chunks = -(-big * scores // CHUNK_SCORE_ELEMENTS)
    chunked = sequence.torch_attention_bytes_per_sample(shape, big, False)
    assert chunks == 4 and chunked.kept == 0
    assert chunked.backward == pytest.approx((per_layer + 4 * 6 * scores) / chunks, rel=1e-9)
    with pytest.raises(ValueError, match="longest_seq_len"):
        HSTUShape(64, 2, 32, 2, 16, 16, contextual=8, mean_seq_len=51.7, rms_seq_len=52.0,
                  longest_seq_len=80)


def test_offline_plans_cost_the_attention_the_planned_device_runs():
    """Planned for hardware not at hand, a CPU runs the torch attention (its padded scores held), an
    accelerator anyrec's Triton kernels; `backend.attention_kernel` names another."""
    def planned(*overrides: str) -> tuple[str, str]:
        _, cfg = compose_config(["model=dlrmv4_small", "topology.world_size=2", *overrides])
        lines: list[str] = []
        result = run(cfg, print_fn=lines.append)
        return result.workload.options.attention_impl, "\n".join(lines)

    impl, text = planned("hardware=cpu")
    assert impl == "torch" and "(torch, 10% of peak, assumed)" in text
    assert planned("hardware=h100")[0] == "triton"
    assert planned("hardware=cpu", "backend.attention_kernel=triton")[0] == "triton"
