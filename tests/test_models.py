"""Model recipes: DLRMv2 (MLPerf DCNv2), its CPU scale-down, DLRM Kaggle, and the experiments."""

from __future__ import annotations

import pytest
import torch

from anyrec.config import DataConfig
from anyrec.data.synthetic import SyntheticCriteo
from anyrec.models.dlrm import build_model
from anyrec.planner.job import dense_parameters
from anyrec.planner.workloads import DLRMV2_DENSE_PARAMS, dlrmv2_tables
from anyrec.schema import load_model_config

from .conftest import OpRecorder, compose_config


def test_dlrmv2_is_the_mlperf_model():
    """configs/model/dlrmv2.yaml is the one copy of the MLPerf table list: checked here against the
    reference's totals (204.2 M rows, 214 lookups per sample, five 40 M-row tables) and a few entries."""
    _, cfg = compose_config(["model=dlrmv2"])
    m = cfg.model
    assert len(m.table_rows) == 26 and sum(m.table_rows) == 204_184_588
    assert m.table_rows.count(40_000_000) == 5 and m.table_rows[10] == 3_067_956 and m.table_rows[-1] == 36
    assert len(m.multi_hot) == 26 and sum(m.multi_hot) == 214 and m.multi_hot[20] == 100
    assert load_model_config("dlrmv2") == m
    assert [t.num_rows for t in dlrmv2_tables()] == m.table_rows
    assert [t.pooling_factor for t in dlrmv2_tables()] == m.multi_hot
    assert (m.embedding_dim, m.bottom_mlp, m.top_mlp) == (128, [512, 256, 128], [1024, 1024, 512, 256, 1])
    assert (m.interaction, m.dcn_num_layers, m.dcn_low_rank) == ("dcn", 3, 512)
    model = build_model(m, torch.device("meta"))
    x = model.interaction.cross
    assert len(x.V) == 3 and x.V[0].weight.shape == (512, 27 * 128) and x.U[0].weight.shape == (27 * 128, 512)
    assert model.over_arch.layers[0].in_features == 27 * 128
    dense = dense_parameters(model, model.sparse_arch)
    assert sum(p.numel() for p in dense) == DLRMV2_DENSE_PARAMS > 10_000_000


def test_mlperf_experiment_hyperparameters():
    _, cfg = compose_config(["+experiment=dlrmv2_mlperf", "data.path=/data/criteo"])
    assert cfg.model.name == "dlrmv2" and cfg.data.name == "criteo_multihot"
    assert cfg.optim.name == "adagrad" and cfg.optim.embedding_lr == 0.005 and cfg.optim.dense_lr == 0.005
    assert cfg.optim.eps == 1e-8 and cfg.data.global_batch_size == 65536
    assert cfg.data.eval_files == ["day_23"] and len(cfg.data.train_files) == 23


def test_cpu_variant_and_kaggle_dlrm():
    _, cfg = compose_config(["+experiment=dlrmv2_cpu"])
    assert cfg.model.name == "dlrmv2_small" and cfg.model.multi_hot == load_model_config("dlrmv2").multi_hot
    assert cfg.model.interaction == "dcn" and max(cfg.model.table_rows) <= 20000
    assert cfg.optim.warmup_steps > 0 and cfg.optim.decay_steps > 0
    build_model(cfg.model, torch.device("cpu"))  # small enough to allocate here
    _, cfg = compose_config(["model=dlrm"])
    assert cfg.model.interaction == "dot" and cfg.model.embedding_dim == 16
    assert len(cfg.model.table_rows) == 26
    model = build_model(cfg.model, torch.device("meta"))
    assert model.over_arch.layers[0].in_features == 16 + 27 * 26 // 2


def test_model_builds_the_dispatched_dense_modules():
    """`kernels` (Backend.select_kernels' answer) picks each dense op's module; parameters are the same,
    so a checkpoint loads into either. Numerics: tests/test_kernels_interaction.py (Triton interpreter)."""
    from anyrec.backends.dispatch import FBGEMM_EMBEDDING, get_impl
    from anyrec.models.interaction import (
        DotInteraction,
        LowRankCrossNet,
        TritonDotInteraction,
        TritonLowRankCrossNet,
    )

    meta = torch.device("meta")
    _, cfg = compose_config(["model=dlrm"])
    assert type(build_model(cfg.model, meta).interaction) is DotInteraction
    triton_dot = build_model(cfg.model, meta, kernels={"embedding": FBGEMM_EMBEDDING,
                                                       "interaction": get_impl("interaction", "triton")})
    assert type(triton_dot.interaction) is TritonDotInteraction
    _, cfg = compose_config(["model=dlrmv2"])
    torch_dcn = build_model(cfg.model, meta, kernels={"interaction": get_impl("interaction", "triton"),
                                                      "dcn_cross": get_impl("dcn_cross", "torch")})
    assert type(torch_dcn.interaction.cross) is LowRankCrossNet
    triton_dcn = build_model(cfg.model, meta, kernels={"dcn_cross": get_impl("dcn_cross", "triton")})
    assert type(triton_dcn.interaction.cross) is TritonLowRankCrossNet
    assert {k: v.shape for k, v in triton_dcn.state_dict().items()} == {
        k: v.shape for k, v in torch_dcn.state_dict().items()}
    with pytest.raises(ValueError, match="unknown dcn_cross implementation 'cutlass'; known: triton, torch"):
        get_impl("dcn_cross", "cutlass")


def test_pooled_embeddings_reach_the_interaction_without_a_gradient_per_feature():
    """The backward of the per-feature view of the pooled embeddings is one op, not a zero-filled
    [B, F*D] gradient per feature (which costs F times the output's size in the backward)."""
    _, cfg = compose_config(["model=dlrm_tiny"])
    cfg = cfg.model
    model = build_model(cfg, torch.device("cpu"))
    B, F = 8, len(cfg.table_rows)
    batch = SyntheticCriteo(cfg, DataConfig(batch_size=B), seed=0).batch(0)
    loss = model(batch.dense_features, batch.sparse_features).sum()
    with OpRecorder() as rec:
        loss.backward()
    assert not [op for op in rec.ops if "slice_backward" in op or "narrow" in op]
    full = [op for op in rec.ops if op.startswith(("aten.zeros", "aten.new_zeros", "aten.fill_"))]
    assert len(full) < F, full


def test_bottom_mlp_runs_while_the_embeddings_travel():
    """Sharded, calling the sparse arch runs the lookups and starts their all-to-all; the awaitable it
    returns is waited on at first use. The model calls it before the bottom MLP and uses it after, so the
    bottom MLP (and, in the backward, its gradient) overlaps the all-to-all."""
    from torchrec.distributed.types import LazyAwaitable

    order: list[str] = []

    class Travelling(LazyAwaitable):
        def __init__(self, result):
            super().__init__()
            self._kt = result

        def _wait_impl(self):
            order.append("wait")
            return self._kt

    _, cfg = compose_config(["model=dlrm_tiny"])
    model = build_model(cfg.model, torch.device("cpu"))
    model.sparse_arch.register_forward_pre_hook(lambda *_: order.append("sparse"))
    model.sparse_arch.register_forward_hook(lambda _m, _i, out: Travelling(out))
    model.dense_arch.register_forward_pre_hook(lambda *_: order.append("dense"))
    batch = SyntheticCriteo(cfg.model, DataConfig(batch_size=4), seed=0).batch(0)
    model(batch.dense_features, batch.sparse_features)
    assert order == ["sparse", "dense", "wait"]


def test_dot_interaction_is_the_upper_triangle_and_backward_fills_nothing():
    """DotInteraction (the Triton kernel's oracle) against explicit dot products, pairs (i, j), i < j,
    in row-major order after the dense vector; after the first backward, a backward writes only the
    triangle's gradients into its kept buffer: no zero-fill, no index_put/index_add accumulate."""
    from anyrec.models.interaction import DotInteraction

    g = torch.Generator().manual_seed(3)
    B, F, D = 4, 5, 6
    dense = torch.randn(B, D, generator=g, requires_grad=True)
    sparse = torch.randn(B, F, D, generator=g, requires_grad=True)
    module = DotInteraction(F)
    out = module(dense, sparse)
    feats = [dense] + [sparse[:, k] for k in range(F)]
    want = torch.cat([dense] + [(feats[i] * feats[j]).sum(1, keepdim=True)
                                for i in range(F + 1) for j in range(i + 1, F + 1)], dim=1)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (dense, sparse), grad, retain_graph=True)
    ref = torch.autograd.grad(want, (dense, sparse), grad)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with OpRecorder() as rec:
        out.backward(grad)
    assert any("scatter" in op for op in rec.ops), rec.ops
    assert not [op for op in rec.ops if any(k in op for k in ("zero", "fill", "index_put", "index_add"))], \
        rec.ops


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("batches", [(64, 64), (64, 17, 64)])
def test_dot_interaction_gradient_is_bit_identical_to_autograds(autocast, batches):
    """The hand-written backward against autograd's graph of the same forward (bmm, flat index_select),
    bit for bit, in fp32 and under bf16 autocast, over several steps and a batch-size change (the kept
    buffer must stay zero off the triangle)."""
    from anyrec.models.interaction import DotInteraction

    F, D = 26, 16
    module = DotInteraction(F)
    g = torch.Generator().manual_seed(5)
    for B in batches:
        dense = torch.randn(B, D, generator=g, requires_grad=True)
        sparse = torch.randn(B, F, D, generator=g, requires_grad=True)
        grad = torch.randn(B, D + F * (F + 1) // 2, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = module(dense, sparse)
            feats = torch.cat([dense.unsqueeze(1), sparse], dim=1)
            gram = torch.bmm(feats, feats.transpose(1, 2))
            want = torch.cat([dense, gram.flatten(1).index_select(1, module._pairs)], dim=1)
        assert torch.equal(out, want)
        got = torch.autograd.grad(out, (dense, sparse), grad)
        ref = torch.autograd.grad(want, (dense, sparse), grad)
        for a, b in zip(got, ref, strict=True):
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)


