"""Unpooled (sequence) lookups of TritonTableBatchedEmbedding, torch execution, against a float64 reference:
the forward's rows and the fused backward + optimizer on ragged tiny batches (empty sequences, repeated
ids within and across sequences and features, a table read by two features). The Triton execution runs the
same checks under the interpreter (test_kernels_triton_interpret.py)."""

from __future__ import annotations

import pytest
import torch

from anyrec.kernels.optimizers import OptimizerConfig, OptimizerKind
from anyrec.kernels.tbe import TritonTableBatchedEmbedding

D = 8
SPECS = [(6, D), (1, D), (9, D)]  # a one-row table
FTM = [0, 1, 2, 0]  # table 0 read by two features
OPTS = [
    OptimizerConfig("sgd", lr=0.1),
    OptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6),
    OptimizerConfig("adagrad", lr=0.1, eps=1e-6),
    OptimizerConfig("adam", lr=0.05, eps=1e-6, beta1=0.8, beta2=0.95),
    OptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6, weight_decay=0.3),
    OptimizerConfig("adam", lr=0.05, eps=1e-6, beta1=0.8, beta2=0.95, weight_decay=0.5),
]


def sequence_batch(batch: int, seed: int, index_dtype=torch.int64, specs=SPECS, ftm=FTM):
    """KJT values and offsets: sequences of 0-4 ids (empty ones included), drawn from each table's last
    three rows so ids repeat within and across sequences."""
    g = torch.Generator().manual_seed(seed)
    lengths, ids = [], []
    for f, t in enumerate(ftm):
        rows = specs[t][0]
        for b in range(batch):
            n = [0, 4, 1, 3, 2][(f + b + seed) % 5]
            lengths.append(n)
            ids.append(torch.randint(0, min(rows, 3), (n,), generator=g) + max(rows - 3, 0))
    offsets = torch.zeros(len(lengths) + 1, dtype=index_dtype)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    return torch.cat(ids).to(index_dtype), offsets


def lookup_tables(offsets: torch.Tensor, n: int, ftm=FTM) -> torch.Tensor:
    """The table each lookup reads (its feature's), in value order."""
    F = len(ftm)
    B = (offsets.numel() - 1) // F
    lengths = (offsets[1:] - offsets[:-1]).long()
    feature = torch.repeat_interleave(torch.arange(F * B) // B, lengths, output_size=n)
    return torch.tensor(ftm)[feature]


def reference_step(tables, states, ids, offsets, grad_ND, opt: OptimizerConfig, step: int) -> None:
    """One fused step in float64, in place: every row's gradient summed over its lookups, then the rule."""
    table_N = lookup_tables(offsets, ids.numel())
    for t, w in enumerate(tables):
        sel = table_N == t
        g = torch.zeros_like(w).index_add_(0, ids[sel].long(), grad_ND[sel].double())
        rows = ids[sel].long().unique()
        gr, wr = g[rows], w[rows]
        if opt.weight_decay and opt.kind != OptimizerKind.ADAM:
            gr = gr + opt.weight_decay * wr
        s = states[t]
        if opt.kind == OptimizerKind.SGD:
            wr = wr - opt.lr * gr
        elif opt.kind == OptimizerKind.ROWWISE_ADAGRAD:
            s["m"][rows] += (gr * gr).mean(1)
            wr = wr - opt.lr * gr / (s["m"][rows].sqrt() + opt.eps)[:, None]
        elif opt.kind == OptimizerKind.ADAGRAD:
            s["m"][rows] += gr * gr
            wr = wr - opt.lr * gr / (s["m"][rows].sqrt() + opt.eps)
        else:
            s["m"][rows] = opt.beta1 * s["m"][rows] + (1 - opt.beta1) * gr
            s["v"][rows] = opt.beta2 * s["v"][rows] + (1 - opt.beta2) * gr * gr
            m_hat = s["m"][rows] / (1 - opt.beta1 ** step)
            v_hat = s["v"][rows] / (1 - opt.beta2 ** step)
            wr = wr - opt.lr * (m_hat / (v_hat.sqrt() + opt.eps) + opt.weight_decay * wr)
        w[rows] = wr


def reference_states(tables, opt: OptimizerConfig) -> list[dict[str, torch.Tensor]]:
    if opt.kind == OptimizerKind.ROWWISE_ADAGRAD:
        return [{"m": torch.zeros(w.shape[0], dtype=torch.float64)} for w in tables]
    return [{"m": torch.zeros_like(w), "v": torch.zeros_like(w)} for w in tables]


def check_forward(execution: str, index_dtype=torch.int64) -> None:
    """Rows of every lookup equal the float64 reference's, in value order, [N, D]."""
    m = TritonTableBatchedEmbedding(SPECS, FTM, pooling="none", execution=execution)
    tables = [w.double() for w in m.split_embedding_weights()]
    ids, offsets = sequence_batch(3, 0, index_dtype)
    out = m(ids, offsets)
    table_N = lookup_tables(offsets, ids.numel())
    want = torch.stack([tables[t][i] for t, i in zip(table_N.tolist(), ids.long().tolist(), strict=True)])
    assert out.shape == (ids.numel(), D) and ids.numel() > 0
    torch.testing.assert_close(out.double(), want, rtol=0, atol=0)


def check_fused_update(execution: str, opt: OptimizerConfig, steps: int = 2) -> TritonTableBatchedEmbedding:
    """`steps` training steps of the module against the float64 reference: weights and state agree to fp32
    rounding, and the rows no id touched are untouched."""
    m = TritonTableBatchedEmbedding(SPECS, FTM, optimizer=opt, pooling="none", execution=execution)
    tables = [w.detach().double().clone() for w in m.split_embedding_weights()]
    start = [t.clone() for t in tables]
    states = reference_states(tables, opt)
    g = torch.Generator().manual_seed(7)
    touched = [torch.zeros(r, dtype=torch.bool) for r, _ in SPECS]
    for step in range(1, steps + 1):
        ids, offsets = sequence_batch(3, step)
        out = m(ids, offsets)
        grad = torch.randn(out.shape, generator=g)
        out.backward(grad)
        reference_step(tables, states, ids, offsets, grad, opt, step)
        for t, i in zip(lookup_tables(offsets, ids.numel()).tolist(), ids.tolist(), strict=True):
            touched[t][i] = True
    for t, (got, want) in enumerate(zip(m.split_embedding_weights(), tables, strict=True)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        assert torch.equal(got.double()[~touched[t]], start[t][~touched[t]])
    assert sum(int(t.sum()) for t in touched) > 0 and any(bool((~t).any()) for t in touched)
    if opt.kind == OptimizerKind.ROWWISE_ADAGRAD:
        want_m = torch.cat([s["m"] for s in states])
        torch.testing.assert_close(m.momentum1.double(), want_m, rtol=1e-5, atol=0)
    return m


def test_forward_rows_match_the_reference():
    check_forward("torch", torch.int64)
    check_forward("torch", torch.int32)


def opt_id(opt: OptimizerConfig) -> str:
    return f"{opt.kind.value}{'_wd' if opt.weight_decay else ''}"


@pytest.mark.parametrize("opt", OPTS, ids=opt_id)
def test_fused_update_matches_the_float64_reference(opt):
    check_fused_update("torch", opt)


def check_empty_and_skipped(execution: str) -> None:
    """No ids at all: [0, D] and no update. Under bounds_check=skip an id outside its table reads zeros and
    updates nothing; the ids beside it train as usual."""
    m = TritonTableBatchedEmbedding(SPECS, FTM, optimizer=OptimizerConfig("sgd", lr=1.0), pooling="none",
                                    bounds_check="skip", execution=execution)
    before = m.weight.clone()
    empty = m(torch.zeros(0, dtype=torch.int64), torch.zeros(len(FTM) * 2 + 1, dtype=torch.int64))
    assert empty.shape == (0, D)
    empty.sum().backward()
    assert torch.equal(m.weight, before)
    ids = torch.tensor([5, 9, 0, 1])  # feature 0 (table 0, 6 rows): 5 and 9 (out of range); 1, 2, 3: one each
    offsets = torch.tensor([0, 2, 3, 4, 4])
    out = m(ids, offsets)
    assert torch.equal(out[1], torch.zeros(D)) and torch.equal(out[0], before[5 * D: 6 * D])
    out.backward(torch.ones_like(out))
    changed = (m.weight != before).view(-1, D).any(1).nonzero().squeeze(1).tolist()
    assert changed == [5, 6, 8]  # global rows: table 0 row 5, table 1 row 0, table 2 row 1


def test_empty_batch_and_out_of_range_ids_under_skip():
    check_empty_and_skipped("torch")


def test_bad_configuration_is_one_line():
    with pytest.raises(ValueError, match="one embedding dim for every table"):
        TritonTableBatchedEmbedding([(4, 8), (4, 16)], pooling="none")
    m = TritonTableBatchedEmbedding(SPECS, FTM, pooling="none")
    ids, offsets = sequence_batch(2, 0)
    with pytest.raises(ValueError, match="no per_sample_weights"):
        m(ids, offsets, torch.ones(ids.numel()))
