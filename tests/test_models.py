"""Model recipes: DLRMv2 (MLPerf DCNv2), its CPU scale-down, DLRM Kaggle, and the experiments."""

from __future__ import annotations

import pytest
import torch

from anyrec.models.dlrm import build_model, dense_param_count

from .conftest import compose_config

MLPERF_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
               2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
MLPERF_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]


def test_dlrmv2_is_the_mlperf_model():
    _, cfg = compose_config(["model=dlrmv2"])
    m = cfg.model
    assert m.table_rows == MLPERF_ROWS and sum(m.table_rows) == 204_184_588
    assert m.multi_hot == MLPERF_HOT and sum(m.multi_hot) == 214
    assert (m.embedding_dim, m.bottom_mlp, m.top_mlp) == (128, [512, 256, 128], [1024, 1024, 512, 256, 1])
    assert (m.interaction, m.dcn_num_layers, m.dcn_low_rank) == ("dcn", 3, 512)
    model = build_model(m, torch.device("meta"))
    x = model.interaction.cross
    assert len(x.V) == 3 and x.V[0].weight.shape == (512, 27 * 128) and x.U[0].weight.shape == (27 * 128, 512)
    assert model.over_arch.layers[0].in_features == 27 * 128
    assert dense_param_count(m) > 10_000_000


def test_mlperf_experiment_hyperparameters():
    _, cfg = compose_config(["+experiment=dlrmv2_mlperf", "data.path=/data/criteo"])
    assert cfg.model.name == "dlrmv2" and cfg.data.name == "criteo_multihot"
    assert cfg.optim.name == "adagrad" and cfg.optim.embedding_lr == 0.005 and cfg.optim.dense_lr == 0.005
    assert cfg.optim.eps == 1e-8 and cfg.data.global_batch_size == 65536
    assert cfg.data.eval_files == ["day_23"] and len(cfg.data.train_files) == 23


def test_cpu_variant_and_kaggle_dlrm():
    _, cfg = compose_config(["+experiment=dlrmv2_cpu"])
    assert cfg.model.name == "dlrmv2_small" and cfg.model.multi_hot == MLPERF_HOT
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
    from anyrec.models.interaction import (
        DotInteraction,
        LowRankCrossNet,
        TritonDotInteraction,
        TritonLowRankCrossNet,
    )

    meta = torch.device("meta")
    _, cfg = compose_config(["model=dlrm"])
    assert type(build_model(cfg.model, meta).interaction) is DotInteraction
    triton_dot = build_model(cfg.model, meta, kernels={"embedding": "fbgemm", "interaction": "triton"})
    assert type(triton_dot.interaction) is TritonDotInteraction
    _, cfg = compose_config(["model=dlrmv2"])
    torch_dcn = build_model(cfg.model, meta, kernels={"interaction": "triton", "dcn_cross": "torch"})
    assert type(torch_dcn.interaction.cross) is LowRankCrossNet
    triton_dcn = build_model(cfg.model, meta, kernels={"dcn_cross": "triton"})
    assert type(triton_dcn.interaction.cross) is TritonLowRankCrossNet
    assert {k: v.shape for k, v in triton_dcn.state_dict().items()} == {
        k: v.shape for k, v in torch_dcn.state_dict().items()}
    with pytest.raises(ValueError, match="no dcn_cross module for implementation 'cutlass'; known: torch"):
        build_model(cfg.model, meta, kernels={"dcn_cross": "cutlass"})
