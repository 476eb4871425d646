"""A replicated (data-parallel) table trained by its dense gradient follows the fused TBE's rule exactly."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from anyrec.kernels.optimizers import OptimizerConfig
from anyrec.kernels.replicated import ReplicatedTableOptimizer
from anyrec.kernels.tbe import TritonTableBatchedEmbedding

from .test_kernels_tbe import ALL_OPTS

ROWS, DIM, BATCH = 11, 6, 4


def _batches(n: int):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 4, (BATCH,), generator=g)
        ids = torch.randint(0, 5, (int(lengths.sum()),), generator=g)  # rows 5.. are never read
        offsets = torch.zeros(BATCH + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        out.append((ids, offsets, torch.randn(BATCH, DIM, generator=g)))
    return out


@pytest.mark.parametrize("opt", [*ALL_OPTS, OptimizerConfig("adagrad", lr=0.1, weight_decay=0.2)],
                         ids=lambda o: f"{o.kind.value}-wd{o.weight_decay}")
def test_dense_gradient_table_matches_the_fused_update(opt):
    fused = TritonTableBatchedEmbedding([(ROWS, DIM)], [0], optimizer=opt, execution="torch")
    table = torch.nn.Parameter(fused.split_embedding_weights()[0].clone())
    replicated = ReplicatedTableOptimizer([table], opt)
    lrs = [opt.lr, opt.lr * 0.5, opt.lr * 2]  # a schedule: the param group's lr is the one used
    for lr, (ids, offsets, g_BD) in zip(lrs, _batches(3), strict=True):
        fused.learning_rate = lr
        fused(ids, offsets).backward(g_BD)
        replicated.param_groups[0]["lr"] = lr
        replicated.zero_grad()
        F.embedding_bag(ids, table, offsets[:-1], mode="sum").backward(g_BD)
        replicated.step()
    torch.testing.assert_close(table.detach(), fused.split_embedding_weights()[0], rtol=0, atol=1e-7)
    # lazy: the rows never read kept their initial values, state included
    assert torch.equal(table.detach()[5:], fused.split_embedding_weights()[0][5:])
    state = replicated.state[table]
    names = [k for k in ("momentum1", "momentum2") if hasattr(fused, k)]
    assert sorted(names) == sorted(k for k in state if k != "step")
    for k in names:
        torch.testing.assert_close(state[k], getattr(fused, k), rtol=0, atol=1e-7, msg=k)
    assert float(state["step"]) == float(fused.step) == 3


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_sgd_and_adagrad_bit_for_bit_with_the_fused_update(kind):
    """FBGEMM's rounding (`anyrec.kernels.optimizers`) in both: same bits, gradients over eight decades."""
    opt = OptimizerConfig(kind, lr=0.05, eps=1e-8)
    fused = TritonTableBatchedEmbedding([(ROWS, DIM)], [0], optimizer=opt, execution="torch")
    table = torch.nn.Parameter(fused.split_embedding_weights()[0].clone())
    w0 = table.detach().clone()
    replicated = ReplicatedTableOptimizer([table], opt)
    gen = torch.Generator().manual_seed(9)
    for ids, offsets, g_BD in _batches(3):
        g_BD = g_BD * 10.0 ** torch.randint(-8, 0, (BATCH, 1), generator=gen).float()
        fused(ids, offsets).backward(g_BD)
        replicated.zero_grad()
        F.embedding_bag(ids, table, offsets[:-1], mode="sum").backward(g_BD)
        replicated.step()
    assert int((table.detach() != w0).sum()) >= 4 * DIM
    assert torch.equal(table.detach(), fused.split_embedding_weights()[0])
    if kind == "adagrad":
        assert torch.equal(replicated.state[table]["momentum1"], fused.momentum1)


def test_rejects_a_non_table_parameter():
    with pytest.raises(ValueError, match="rows, dim"):
        ReplicatedTableOptimizer([torch.nn.Parameter(torch.zeros(3))], OptimizerConfig("sgd"))
