"""TritonTableBatchedEmbedding's torch execution path against the reference and FBGEMM's CPU TBE.

The Triton kernels themselves are checked in test_kernels_triton_interpret.py (interpreter, in a
subprocess). Shapes are tiny on purpose: the CI machine has two cores.
"""

from __future__ import annotations

import pytest
import torch

from anyrec.kernels import reference as R
from anyrec.kernels.layout import BoundsCheckMode
from anyrec.kernels.optimizers import OptimizerConfig, OptimizerKind, state_bytes_per_row
from anyrec.kernels.tbe import TritonTableBatchedEmbedding
from anyrec.kernels.torch_tbe import stochastic_round_torch

# dims 4/36/100/260, a one-row table, and a table read by two features
SPECS = [(6, 4), (1, 36), (9, 100), (5, 260), (7, 4)]
FTM = [0, 1, 2, 3, 4, 0]
# every dim within one 128-wide tile (the Triton kernel's one-pass row-wise Adagrad)
SPECS_ONE_TILE = [(6, 4), (1, 36), (9, 100), (7, 4)]
FTM_ONE_TILE = [0, 1, 2, 3, 0]
ALL_OPTS = [
    OptimizerConfig("sgd", lr=0.1),
    OptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6),
    OptimizerConfig("adagrad", lr=0.1, eps=1e-6),
    OptimizerConfig("adam", lr=0.05, eps=1e-6, beta1=0.8, beta2=0.95),
    OptimizerConfig("adam", lr=0.05, eps=1e-6, beta1=0.8, beta2=0.95, weight_decay=0.5),
]


def make_batch(specs, ftm, batch, seed, index_dtype=torch.int64, psw=False):
    """KJT values/offsets with empty bags, mixed pooling, duplicates in and across bags, last rows."""
    g = torch.Generator().manual_seed(seed)
    lengths, ids = [], []
    for f, t in enumerate(ftm):
        rows = specs[t][0]
        for b in range(batch):
            n = [0, 1, 3, 5, 2][(f + b) % 5]
            # draw from a few rows so ids repeat within and across bags; include the last row
            x = torch.randint(0, min(rows, 3), (n,), generator=g) + max(rows - 3, 0)
            lengths.append(n)
            ids.append(x)
    offsets = torch.zeros(len(lengths) + 1, dtype=index_dtype)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    indices = torch.cat(ids).to(index_dtype)
    weights = torch.rand(indices.numel(), generator=g) + 0.5 if psw else None
    return indices, offsets, weights


def reference_steps(tables, ftm, batches, opt, pooling="sum"):
    """Weights (fp32) and states after applying the reference update once per batch."""
    tables = [w.float().clone() for w in tables]
    states = [R.init_state_ref(opt.kind, *w.shape) for w in tables]
    for step, (ids, off, psw, g) in enumerate(batches, start=1):
        grads, touched = R.row_gradients_ref(tables, ftm, ids, off, g, psw, pooling)
        tables = [R.apply_optimizer_ref(w, s, gr, tc, opt, step)
                  for w, s, gr, tc in zip(tables, states, grads, touched, strict=True)]
    return tables, states


def train(module, batches):
    for ids, off, psw, g in batches:
        module(ids, off, psw).backward(g)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("psw", [False, True])
def test_forward_matches_reference(pooling, index_dtype, psw):
    m = TritonTableBatchedEmbedding(SPECS, FTM, pooling=pooling, execution="torch")
    ids, off, w = make_batch(SPECS, FTM, 4, seed=1, index_dtype=index_dtype, psw=psw)
    out = m(ids, off, w)
    ref = R.pooled_forward_ref(m.split_embedding_weights(), FTM, ids, off, w, pooling)
    assert out.shape == (4, sum(SPECS[t][1] for t in FTM))
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weights_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("output_dtype", [torch.float32, torch.bfloat16])
def test_forward_low_precision_weights(weights_dtype, output_dtype):
    m = TritonTableBatchedEmbedding(SPECS, FTM, weights_dtype=weights_dtype, output_dtype=output_dtype,
                                    execution="torch")
    ids, off, _ = make_batch(SPECS, FTM, 3, seed=2)
    out = m(ids, off)
    assert out.dtype == output_dtype
    ref = R.pooled_forward_ref(m.split_embedding_weights(), FTM, ids, off)  # fp32 accumulation
    torch.testing.assert_close(out.float(), ref, rtol=1e-2 if output_dtype == torch.bfloat16 else 1e-6,
                               atol=1e-2 if output_dtype == torch.bfloat16 else 1e-6)


def check_fused_update(execution, opt, pooling, batch, specs=SPECS, ftm=FTM):
    """Three fused steps (one with per-sample weights) match the reference weights and state."""
    m = TritonTableBatchedEmbedding(specs, ftm, optimizer=opt, pooling=pooling, execution=execution)
    tables0 = [w.clone() for w in m.split_embedding_weights()]
    batches = []
    for s in range(3):
        ids, off, psw = make_batch(specs, ftm, batch, seed=10 + s, psw=s == 1)
        batches.append((ids, off, psw, torch.randn(batch, m.layout.output_dim)))
    train(m, batches)
    want_w, want_s = reference_steps(tables0, ftm, batches, opt, pooling)
    for t, (w, s) in enumerate(zip(m.split_embedding_weights(), m.get_optimizer_state(), strict=True)):
        torch.testing.assert_close(w, want_w[t], rtol=1e-5, atol=1e-6, msg=f"table {t} weights")
        for k, v in s.items():
            torch.testing.assert_close(v, want_s[t][k], rtol=1e-5, atol=1e-6, msg=f"table {t} {k}")
    return m


@pytest.mark.parametrize("opt", ALL_OPTS, ids=lambda o: o.kind.value)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_fused_update_matches_reference(opt, pooling):
    m = check_fused_update("torch", opt, pooling, batch=4)
    assert float(m.step) == 3


# Every rule with L2 weight decay large enough to move each row well past the tolerance.
WD_OPTS = [OptimizerConfig(o.kind, lr=o.lr, eps=o.eps, beta1=o.beta1, beta2=o.beta2, weight_decay=0.5)
           for o in ALL_OPTS]


@pytest.mark.parametrize("opt", WD_OPTS, ids=lambda o: o.kind.value)
def test_fused_update_with_weight_decay(opt):
    check_fused_update("torch", opt, "sum", batch=4)


def check_pooling_by_hand(execution, pooling, with_psw):
    """Pooled outputs and one SGD step worked out by hand for three bags ([0, 1, 1], [], [2]).

    Independent of `reference`, whose bag scaling the torch path shares: dropping the mean's
    division or the per-sample weights in either fails here.
    """
    w0_RD = torch.arange(1.0, 13.0).view(3, 4)
    m = TritonTableBatchedEmbedding([(3, 4)], optimizer=OptimizerConfig("sgd", lr=1.0), pooling=pooling,
                                    execution=execution)
    with torch.no_grad():
        m.weight.copy_(w0_RD.reshape(-1))
    ids, off = torch.tensor([0, 1, 1, 2]), torch.tensor([0, 3, 3, 4])
    psw = torch.tensor([2.0, 3.0, 0.5, 4.0]) if with_psw else None
    s0, s1, s2 = (2.0, 3.5, 4.0) if with_psw else (1.0, 2.0, 1.0)  # each row's factor in its bag
    n0, n2 = (3.0, 1.0) if pooling == "mean" else (1.0, 1.0)  # ids per bag divide under mean
    want = torch.stack([(s0 * w0_RD[0] + s1 * w0_RD[1]) / n0, torch.zeros(4), s2 * w0_RD[2] / n2])
    out = m(ids, off, psw)
    torch.testing.assert_close(out, want)
    g_BD = torch.tensor([[1.0, -1.0, 2.0, 0.5], [9.0, 9.0, 9.0, 9.0], [-2.0, 1.0, 0.25, 3.0]])
    out.backward(g_BD)
    want_w = torch.stack([w0_RD[0] - s0 / n0 * g_BD[0], w0_RD[1] - s1 / n0 * g_BD[0],
                          w0_RD[2] - s2 / n2 * g_BD[2]])
    torch.testing.assert_close(m.split_embedding_weights()[0], want_w)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("with_psw", [False, True], ids=["no_psw", "psw"])
def test_pooling_and_per_sample_weights_by_hand(pooling, with_psw):
    check_pooling_by_hand("torch", pooling, with_psw)


def test_weight_decay_and_lr_change():
    opt = OptimizerConfig("rowwise_adagrad", lr=0.1, weight_decay=0.01)
    m = TritonTableBatchedEmbedding(SPECS, FTM, optimizer=opt, execution="torch")
    tables0 = [w.clone() for w in m.split_embedding_weights()]
    ids, off, _ = make_batch(SPECS, FTM, 2, seed=3)
    g = torch.randn(2, m.layout.output_dim)
    m.learning_rate = 0.2
    train(m, [(ids, off, None, g)])
    want, _ = reference_steps(tables0, FTM, [(ids, off, None, g)], OptimizerConfig(
        "rowwise_adagrad", lr=0.2, weight_decay=0.01))
    for w, r in zip(m.split_embedding_weights(), want, strict=True):
        torch.testing.assert_close(w, r, rtol=1e-5, atol=1e-6)


def test_adam_weight_decay_is_decoupled():
    """FBGEMM's rule: w -= lr * (m1_hat / (sqrt(m2_hat) + eps) + wd * w); the decay stays out of m1/m2."""
    lr, wd, eps = 0.1, 0.5, 1e-8
    m = TritonTableBatchedEmbedding([(5, 4)], [0], optimizer=OptimizerConfig(
        "adam", lr=lr, eps=eps, weight_decay=wd), execution="torch")
    w0 = m.split_embedding_weights()[0].clone()
    g = torch.tensor([[0.5, -2.0, 1e-3, 3.0], [-1.0, 0.25, 4.0, -0.5]])
    train(m, [(torch.tensor([1, 3]), torch.tensor([0, 1, 2]), None, g)])
    want = w0.clone()
    # first step: both bias-corrected moments are exactly g and g^2
    want[[1, 3]] = w0[[1, 3]] - lr * (g / (g.abs() + eps) + wd * w0[[1, 3]])
    torch.testing.assert_close(m.split_embedding_weights()[0], want, rtol=0, atol=1e-6)
    exp_avg = m.get_optimizer_state()[0]["exp_avg"].view(5, 4)
    torch.testing.assert_close(exp_avg[[1, 3]], 0.1 * g, rtol=1e-6, atol=0)  # (1 - beta1) g, no decay


def test_eval_mode_does_not_update():
    m = TritonTableBatchedEmbedding(SPECS, FTM, execution="torch").eval()
    ids, off, _ = make_batch(SPECS, FTM, 2, seed=4)
    before = m.weight.clone()
    out = m(ids, off)
    assert not out.requires_grad
    assert torch.equal(m.weight, before)


@pytest.mark.parametrize("bad_id", [-1, 6])
def test_bounds_check_names_feature_and_id(bad_id):
    m = TritonTableBatchedEmbedding(SPECS, FTM, feature_names=[f"cat_{i}" for i in range(len(FTM))],
                                    execution="torch")
    ids, off, _ = make_batch(SPECS, FTM, 2, seed=5)
    first_of_last_feature = int(off[(len(FTM) - 1) * 2])  # feature 5 reads table 0 (6 rows)
    ids = ids.clone()
    ids[first_of_last_feature] = bad_id
    with pytest.raises(ValueError, match=rf"cat_5 \(table 0, 6 rows\): id {bad_id} "):
        m(ids, off)


def test_skip_mode_drops_bad_ids():
    m = TritonTableBatchedEmbedding(SPECS, FTM, bounds_check="skip", execution="torch")
    assert m.bounds_check == BoundsCheckMode.SKIP
    ids, off, _ = make_batch(SPECS, FTM, 2, seed=6)
    bad = ids.clone()
    bad[0] = 10**6
    ref_psw = torch.ones(ids.numel())
    ref_psw[0] = 0.0  # the skipped lookup contributes nothing
    ref = R.pooled_forward_ref(m.split_embedding_weights(), FTM, ids, off, ref_psw)
    torch.testing.assert_close(m(bad, off), ref)


def test_bad_configuration_raises():
    with pytest.raises(ValueError, match="pooling"):
        TritonTableBatchedEmbedding(SPECS, FTM, pooling="max")
    with pytest.raises(ValueError, match="optimizer"):
        OptimizerConfig("lion")
    with pytest.raises(ValueError, match="feature_table_map"):
        TritonTableBatchedEmbedding(SPECS, [0, 9])
    m = TritonTableBatchedEmbedding(SPECS, FTM, execution="torch")
    ids, off, _ = make_batch(SPECS, FTM, 2, seed=7)
    with pytest.raises(ValueError, match="F\\*B\\+1"):
        m(ids, off[:-1])


def test_state_dict_carries_optimizer_state():
    opt = OptimizerConfig("adam", lr=0.01)
    m = TritonTableBatchedEmbedding(SPECS, FTM, optimizer=opt, execution="torch")
    ids, off, _ = make_batch(SPECS, FTM, 2, seed=8)
    train(m, [(ids, off, None, torch.randn(2, m.layout.output_dim))])
    sd = m.state_dict()
    assert set(sd) == {"weight", "momentum1", "momentum2", "step"}
    m2 = TritonTableBatchedEmbedding(SPECS, FTM, optimizer=opt, execution="torch")
    m2.load_state_dict(sd)
    for k in sd:
        assert torch.equal(getattr(m2, k), getattr(m, k))


def test_state_bytes_per_row():
    assert state_bytes_per_row("sgd", 128) == 0
    assert state_bytes_per_row(OptimizerKind.ROWWISE_ADAGRAD, 128) == 4
    assert state_bytes_per_row("adagrad", 128) == 512  # fp32 state whatever the weights' dtype
    assert state_bytes_per_row("adam", 128) == 1024


def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        lo = torch.tensor(1.0)
        hi = torch.nextafter(torch.tensor(1.0, dtype=dtype), torch.tensor(2.0, dtype=dtype)).float()
        x = torch.full((20000,), float(lo + 0.3 * (hi - lo)))
        y = stochastic_round_torch(x, dtype).float()
        assert bool(((y == lo) | (y == hi)).all())
        frac_up = float((y == hi).float().mean())
        assert abs(frac_up - 0.3) < 0.02, (dtype, frac_up)


def check_stochastic_rounding_in_update(execution, weights_dtype):
    """An SGD step of 0.3 ulp on weights of 1.0: stochastic rounding moves about 30% of the elements
    up one ulp and leaves the rest (round-to-nearest would move none)."""
    torch.manual_seed(0)
    rows, dim = 128, 16
    m = TritonTableBatchedEmbedding([(rows, dim)], optimizer=OptimizerConfig("sgd", lr=1.0),
                                    weights_dtype=weights_dtype, execution=execution)
    with torch.no_grad():
        m.weight.fill_(1.0)
    ulp = torch.finfo(weights_dtype).eps  # the spacing just above 1.0
    ids, off = torch.arange(rows), torch.arange(rows + 1)  # each row alone in its bag
    train(m, [(ids, off, None, torch.full((rows, dim), -0.3 * ulp))])
    w = m.weight.float()
    up = w == 1.0 + ulp
    assert bool((up | (w == 1.0)).all())
    assert 0.2 < float(up.float().mean()) < 0.4, float(up.float().mean())


@pytest.mark.parametrize("weights_dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_in_update(weights_dtype):
    check_stochastic_rounding_in_update("torch", weights_dtype)


def test_fp16_training_with_stochastic_rounding_tracks_fp32():
    opt = OptimizerConfig("sgd", lr=0.01)
    m16 = TritonTableBatchedEmbedding(SPECS, FTM, optimizer=opt, weights_dtype=torch.float16,
                                      execution="torch")
    tables0 = [w.float() for w in m16.split_embedding_weights()]
    ids, off, _ = make_batch(SPECS, FTM, 4, seed=9)
    batches = [(ids, off, None, torch.randn(4, m16.layout.output_dim)) for _ in range(3)]
    train(m16, batches)
    want, _ = reference_steps(tables0, FTM, batches, opt)
    for w, r in zip(m16.split_embedding_weights(), want, strict=True):
        torch.testing.assert_close(w.float(), r, rtol=0, atol=4e-3)


# ---- FBGEMM's CPU TBE with the same hyperparameters ------------------------------------------------

FBGEMM_OPTS = {
    "sgd": "EXACT_SGD",
    "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
    "adagrad": "EXACT_ADAGRAD",
}  # FBGEMM's CPU TBE refuses ADAM ("not supported in CPU mode"); Adam is checked against the reference


@pytest.mark.parametrize("kind", sorted(FBGEMM_OPTS))
def test_matches_fbgemm_cpu_tbe(kind):
    fb = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode

    # FBGEMM's CPU row-wise Adagrad rejects a table read by two features, so none is shared here
    specs, ftm = [(6, 4), (1, 36), (9, 100), (5, 260)], [0, 1, 2, 3]
    opt = OptimizerConfig(kind, lr=0.1, eps=1e-4)
    ours = TritonTableBatchedEmbedding(specs, ftm, optimizer=opt, execution="torch")
    theirs = fb.SplitTableBatchedEmbeddingBagsCodegen(
        [(r, d, EmbeddingLocation.HOST, fb.ComputeDevice.CPU) for r, d in specs],
        feature_table_map=ftm, optimizer=getattr(EmbOptimType, FBGEMM_OPTS[kind]), learning_rate=opt.lr,
        eps=opt.eps, beta1=opt.beta1, beta2=opt.beta2, pooling_mode=PoolingMode.SUM,
    )
    with torch.no_grad():
        for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
            a.copy_(b)
    for s in range(3):
        ids, off, _ = make_batch(specs, ftm, 3, seed=20 + s)
        g = torch.randn(3, ours.layout.output_dim)
        out_o, out_t = ours(ids, off), theirs(ids, off)
        torch.testing.assert_close(out_o, out_t, rtol=1e-5, atol=1e-6)
        out_o.backward(g)
        out_t.backward(g)
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(theirs.get_optimizer_state(), ours.get_optimizer_state(), strict=False):
        for k in b:
            torch.testing.assert_close(b[k], a[k].view(b[k].shape), rtol=1e-5, atol=1e-7, msg=k)


def _fbgemm_pair(kind, specs, ftm, opt):
    """anyrec's torch TBE and FBGEMM's CPU TBE with the same tables and hyperparameters."""
    fb = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode

    ours = TritonTableBatchedEmbedding(specs, ftm, optimizer=opt, execution="torch")
    theirs = fb.SplitTableBatchedEmbeddingBagsCodegen(
        [(r, d, EmbeddingLocation.HOST, fb.ComputeDevice.CPU) for r, d in specs],
        feature_table_map=ftm, optimizer=getattr(EmbOptimType, FBGEMM_OPTS[kind]), learning_rate=opt.lr,
        eps=opt.eps, pooling_mode=PoolingMode.SUM,
    )
    with torch.no_grad():
        for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
            a.copy_(b)
    return ours, theirs


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
@pytest.mark.parametrize("eps", [1e-8, 1e-4])
def test_sgd_and_adagrad_are_fbgemm_cpu_bit_for_bit(kind, eps):
    """Same summed gradient, same rounding (fma; Adagrad's step in fp64): identical weights and state.

    Gradients span eight decades, where Adagrad's g / (sqrt(g^2) + eps) is most sensitive to rounding.
    """
    specs, ftm = [(6, 4), (1, 36), (9, 100), (5, 260)], [0, 1, 2, 3]
    ours, theirs = _fbgemm_pair(kind, specs, ftm, OptimizerConfig(kind, lr=0.05, eps=eps))
    gen = torch.Generator().manual_seed(3)
    for s in range(4):
        ids, off, _ = make_batch(specs, ftm, 6, seed=40 + s)
        scale = 10.0 ** torch.randint(-8, 0, (6, 1), generator=gen).float()
        g = torch.randn(6, ours.layout.output_dim, generator=gen) * scale
        ours(ids, off).backward(g)
        theirs(ids, off).backward(g)
    moved = 0
    for a, b, w0 in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(),
                        TritonTableBatchedEmbedding(specs, ftm).split_embedding_weights(), strict=True):
        assert torch.equal(b, a), f"{int((a != b).sum())} of {a.numel()} weights differ"
        moved += int((b != w0).sum())
    assert moved > 100, moved  # the batches did update many elements
    for a, b in zip(theirs.get_optimizer_state(), ours.get_optimizer_state(), strict=False):
        for k in b:
            assert torch.equal(b[k], a[k].view(b[k].shape)), k


def test_rowwise_adagrad_state_is_fbgemm_cpu_bit_for_bit():
    """mean_d(g^2) summed in FBGEMM's eight AVX2 lanes (dims 4, 36, 100, 260: masked and several
    chunks): the accumulators are identical; the weights are within one rounding of the step (FBGEMM's
    step differs by a unit in the last place on a few rows, cause not found)."""
    specs, ftm = [(6, 4), (1, 36), (9, 100), (5, 260)], [0, 1, 2, 3]
    ours, theirs = _fbgemm_pair("rowwise_adagrad", specs, ftm, OptimizerConfig("rowwise_adagrad", lr=0.05))
    gen = torch.Generator().manual_seed(5)
    for s in range(4):
        ids, off, _ = make_batch(specs, ftm, 6, seed=60 + s)
        g = torch.randn(6, ours.layout.output_dim, generator=gen)
        g = g * 10.0 ** torch.randint(-6, 0, (6, 1), generator=gen).float()
        ours(ids, off).backward(g)
        theirs(ids, off).backward(g)
    for a, b in zip(theirs.get_optimizer_state(), ours.get_optimizer_state(), strict=True):
        assert int((b["sum"] > 0).sum()) > 0
        assert torch.equal(b["sum"], a["sum"].view(b["sum"].shape))
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-7)


def test_rowwise_mean_sq_of_no_rows():
    """A rank whose shard saw no id this step updates no row (row-wise sharding does this)."""
    from anyrec.kernels.optimizers import rowwise_mean_sq

    assert rowwise_mean_sq(torch.zeros(0, 36)).shape == (0,)
    assert torch.equal(rowwise_mean_sq(torch.full((2, 12), 2.0)), torch.full((2,), 4.0))


def test_rowwise_step_is_one_rounded_division():
    """lr / (sqrt(m) + eps) rounded once, as FBGEMM divides (torch's number / tensor rounds twice)."""
    from anyrec.kernels.optimizers import f32, rowwise_step

    gen = torch.Generator().manual_seed(1)
    m = torch.rand(4000, generator=gen) * 10.0 ** torch.randint(-12, 0, (4000,), generator=gen).float()
    den = m.sqrt() + f32(1e-8)
    want = (f32(0.05) / den.double()).float()  # fp64 quotient of fp32 values, rounded: correctly rounded
    assert torch.equal(rowwise_step(m, 0.05, 1e-8), want)
    assert not torch.equal(0.05 / den, want)  # the case this guards against does occur


def test_fma_f32_rounds_once():
    """a * b + c with one rounding; the first case is one where fp64 then fp32 rounds twice, wrongly."""
    from fractions import Fraction

    from anyrec.kernels.optimizers import fma_f32

    def exact_f32(a: float, b: float, c: float) -> float:
        x = Fraction(a) * Fraction(b) + Fraction(c)
        near = torch.tensor(float(x), dtype=torch.float32)
        cands = [near, *(torch.nextafter(near, torch.tensor(x)) for x in (-torch.inf, torch.inf))]
        best = min(abs(Fraction(float(v)) - x) for v in cands)
        ties = [v for v in cands if abs(Fraction(float(v)) - x) == best]
        return float(min(ties, key=lambda v: int(v.view(torch.int32)) & 1))  # ties to even

    a = [8392705 * 2.0**-47, 9010893 * 2.0**-47]  # a * b = 2^-24 + 2j * 2^-71: 1 + that is just past a tie
    b = [16769026 * 2.0**-24, 15618595 * 2.0**-24]
    c = [1.0, 1.0]
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(3, 300, generator=gen) * 10.0 ** torch.randint(-6, 6, (3, 300), generator=gen)
    a += r[0].tolist()
    b += r[1].tolist()
    c += (r[2] * 1e-3).tolist()
    ta, tb, tc = (torch.tensor(v, dtype=torch.float32) for v in (a, b, c))
    got = fma_f32(ta, tb, tc)
    want = torch.tensor([exact_f32(*v) for v in zip(ta.tolist(), tb.tolist(), tc.tolist(), strict=True)])
    assert torch.equal(got, want), int((got != want).sum())
    assert float(got[0]) == 1.0 + 2.0**-23 != float((ta[0].double() * tb[0] + tc[0]).float())


def test_dedupe_rows_segments_without_host_sync():
    """Segment starts sized by N (no unique count on the host); bad ids sort into a trailing sentinel."""
    from anyrec.kernels.triton_tbe_backward import dedupe_rows

    m = TritonTableBatchedEmbedding(SPECS, FTM, execution="torch")
    ids, off, _ = make_batch(SPECS, FTM, 3, seed=4)
    ids = ids.clone()
    ids[0] = -1
    seg = dedupe_rows(m.layout, m._layouts()[1], ids, off, 3)
    n = ids.numel()
    uniq, counts = torch.unique_consecutive(seg.sorted_rows_N, return_counts=True)
    u = uniq.numel()
    assert seg.segment_starts_N1.shape == (n + 1,)
    torch.testing.assert_close(seg.segment_starts_N1[:u], torch.cumsum(counts, 0) - counts)
    assert bool((seg.segment_starts_N1[u:] == n).all())
    assert int(seg.sorted_rows_N[-1]) == m.layout.total_rows  # the bad id, last
    torch.testing.assert_close(seg.sorted_rows_N, seg.sorted_rows_N.sort().values)


def test_bounds_check_off_is_the_skip_fast_path():
    assert BoundsCheckMode("off") is BoundsCheckMode.SKIP
    m = TritonTableBatchedEmbedding(SPECS, FTM, bounds_check="off", execution="torch")
    ids, off, _ = make_batch(SPECS, FTM, 2, seed=3)
    ids = ids.clone()
    ids[0] = 10**6
    assert m(ids, off).shape[0] == 2  # masked, no error


def test_update_with_a_strided_output_gradient():
    """Output fed to torch.cat: its gradient is a column slice (row stride > output dim)."""
    opt = OptimizerConfig("sgd", lr=0.1)
    m = TritonTableBatchedEmbedding(SPECS, FTM, optimizer=opt, execution="torch")
    tables0 = [w.clone() for w in m.split_embedding_weights()]
    ids, off, _ = make_batch(SPECS, FTM, 3, seed=8)
    g = torch.randn(3, m.layout.output_dim + 5)
    torch.cat([m(ids, off), torch.zeros(3, 5, requires_grad=True)], dim=1).backward(g)
    want, _ = reference_steps(tables0, FTM, [(ids, off, None, g[:, : m.layout.output_dim])], opt)
    for w, r in zip(m.split_embedding_weights(), want, strict=True):
        torch.testing.assert_close(w, r, rtol=1e-5, atol=1e-6)
