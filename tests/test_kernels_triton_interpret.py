"""The Triton TBE kernels under TRITON_INTERPRET=1 (CPU), against the reference.

TRITON_INTERPRET must be set before triton is imported, and pytest imports every test module into
one process, so this file re-runs itself in a child pytest with the variable set; the kernel tests
only run in that child (or when the whole suite was started with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import pytest
import torch

from .conftest import run_under_triton_interpreter

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
triton = pytest.importorskip("triton")

if not IN_INTERPRETER:

    @pytest.mark.integration  # a child pytest
    def test_triton_kernels_under_interpreter():
        """Run this module's kernel tests in a child process with TRITON_INTERPRET=1."""
        run_under_triton_interpreter(__file__)

else:
    from anyrec.kernels import reference as R
    from anyrec.kernels.optimizers import OptimizerConfig
    from anyrec.kernels.tbe import TritonTableBatchedEmbedding
    from tests.test_kernels_sequence import OPTS as SEQUENCE_OPTS
    from tests.test_kernels_sequence import check_empty_and_skipped, opt_id
    from tests.test_kernels_sequence import check_forward as check_sequence_forward
    from tests.test_kernels_sequence import check_fused_update as check_sequence_update
    from tests.test_kernels_tbe import (
        ALL_OPTS,
        FTM,
        FTM_ONE_TILE,
        SPECS,
        SPECS_ONE_TILE,
        WD_OPTS,
        check_fused_update,
        check_pooling_by_hand,
        check_stochastic_rounding_in_update,
        make_batch,
        reference_steps,
        train,
    )

    def both(**kw):
        """The same module twice: Triton execution and torch execution, with equal weights."""
        t = TritonTableBatchedEmbedding(SPECS, FTM, execution="triton", **kw)
        p = TritonTableBatchedEmbedding(SPECS, FTM, execution="torch", **kw)
        p.load_state_dict(t.state_dict())
        return t, p

    @pytest.mark.parametrize("pooling", ["sum", "mean"])
    @pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
    def test_forward(pooling, index_dtype):
        m = TritonTableBatchedEmbedding(SPECS, FTM, pooling=pooling, execution="triton")
        ids, off, psw = make_batch(SPECS, FTM, 3, seed=1, index_dtype=index_dtype, psw=True)
        for w in (None, psw):
            ref = R.pooled_forward_ref(m.split_embedding_weights(), FTM, ids, off, w, pooling)
            torch.testing.assert_close(m(ids, off, w), ref, rtol=1e-6, atol=1e-6)

    @pytest.mark.parametrize("weights_dtype", [torch.float16, torch.bfloat16])
    def test_forward_low_precision(weights_dtype):
        m = TritonTableBatchedEmbedding(SPECS, FTM, weights_dtype=weights_dtype, output_dtype=torch.bfloat16,
                                        execution="triton")
        ids, off, _ = make_batch(SPECS, FTM, 2, seed=2)
        out = m(ids, off)
        assert out.dtype == torch.bfloat16
        ref = R.pooled_forward_ref(m.split_embedding_weights(), FTM, ids, off)
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)

    @pytest.mark.parametrize("long_segment", [32, 2, 0], ids=["blocked", "mixed", "all-long"])
    @pytest.mark.parametrize("opt", ALL_OPTS, ids=lambda o: o.kind.value)
    def test_fused_update(opt, long_segment, monkeypatch):
        """Blocked short segments, hot rows one at a time, and both in one program; dims up to 260
        (two D tiles: row-wise Adagrad's two-pass path)."""
        from anyrec.kernels import triton_tbe_backward

        monkeypatch.setattr(triton_tbe_backward, "LONG_SEGMENT", long_segment)
        pooling = "mean" if opt.kind.value == "adagrad" else "sum"
        check_fused_update("triton", opt, pooling, batch=3)

    @pytest.mark.parametrize("kind", ["sgd", "adagrad"])
    def test_sgd_and_adagrad_bit_for_bit_with_torch_execution(kind):
        """FBGEMM's rounding on both paths (fma; Adagrad's step in fp64): identical weights and state.

        Short segments (summed one lookup at a time, in the torch path's order); gradients span eight
        decades, where Adagrad is most sensitive to rounding.
        """
        t, p = both(optimizer=OptimizerConfig(kind, lr=0.05, eps=1e-8))
        w0 = t.weight.detach().clone()
        gen = torch.Generator().manual_seed(4)
        for s in range(3):
            ids, off, _ = make_batch(SPECS, FTM, 4, seed=30 + s)
            g = torch.randn(4, t.layout.output_dim, generator=gen)
            g = g * 10.0 ** torch.randint(-8, 0, (4, 1), generator=gen).float()
            train(t, [(ids, off, None, g)])
            train(p, [(ids, off, None, g)])
        assert int((t.weight != w0).sum()) > 100
        assert torch.equal(t.weight, p.weight), int((t.weight != p.weight).sum())
        if kind == "adagrad":
            assert torch.equal(t.momentum1, p.momentum1)

    @pytest.mark.parametrize("opt", WD_OPTS, ids=lambda o: o.kind.value)
    def test_fused_update_with_weight_decay(opt):
        check_fused_update("triton", opt, "sum", batch=3)

    @pytest.mark.parametrize("opt", ALL_OPTS, ids=lambda o: o.kind.value)
    def test_fused_update_one_tile(opt):
        """Dims that fit one tile: row-wise Adagrad's one-pass path (SPECS' 260 needs two tiles)."""
        check_fused_update("triton", opt, "sum", batch=3, specs=SPECS_ONE_TILE, ftm=FTM_ONE_TILE)

    @pytest.mark.parametrize("pooling", ["sum", "mean"])
    @pytest.mark.parametrize("with_psw", [False, True], ids=["no_psw", "psw"])
    def test_pooling_and_per_sample_weights_by_hand(pooling, with_psw):
        check_pooling_by_hand("triton", pooling, with_psw)

    @pytest.mark.parametrize("weights_dtype", [torch.float16, torch.bfloat16])
    def test_stochastic_rounding_in_update(weights_dtype):
        check_stochastic_rounding_in_update("triton", weights_dtype)

    def test_skip_mode_masks_out_of_range_ids():
        t, p = both(bounds_check="skip", optimizer=OptimizerConfig("rowwise_adagrad", lr=0.1))
        ids, off, _ = make_batch(SPECS, FTM, 2, seed=6)
        ids = ids.clone()
        ids[0], ids[-1] = -3, 10**6
        g = torch.randn(2, t.layout.output_dim)
        torch.testing.assert_close(t(ids, off), p(ids, off))
        train(t, [(ids, off, None, g)])
        train(p, [(ids, off, None, g)])
        torch.testing.assert_close(t.weight, p.weight, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(t.momentum1, p.momentum1, rtol=1e-5, atol=1e-7)

    @pytest.mark.parametrize(("opt", "long_segment"), [(o, 32) for o in SEQUENCE_OPTS]
                             + [(o, 0) for o in SEQUENCE_OPTS if o.kind.value in ("rowwise_adagrad", "adam")
                                and o.weight_decay], ids=lambda v: opt_id(v) if not isinstance(v, int)
                             else ("blocked" if v else "all-long"))
    def test_sequence_lookups(opt, long_segment, monkeypatch):
        """Unpooled lookups (the pooled kernels on a per-lookup view) against the float64 reference: rows,
        fused update (short segments, and every row the one-at-a-time path), empty and skipped ids."""
        from anyrec.kernels import triton_tbe_backward

        monkeypatch.setattr(triton_tbe_backward, "LONG_SEGMENT", long_segment)
        check_sequence_update("triton", opt)
        if opt is SEQUENCE_OPTS[0] and long_segment:
            check_sequence_forward("triton", torch.int32)
            check_empty_and_skipped("triton")

    def test_bounds_error_under_triton():
        m = TritonTableBatchedEmbedding(SPECS, FTM, execution="triton")
        ids, off, _ = make_batch(SPECS, FTM, 2, seed=5)
        ids = ids.clone()
        ids[0] = 99
        with pytest.raises(ValueError, match="feature 0 .*id 99"):
            m(ids, off)

    @pytest.mark.parametrize("weights_dtype", [torch.float16, torch.bfloat16])
    def test_stochastic_rounding_update(weights_dtype):
        opt = OptimizerConfig("sgd", lr=0.01)
        m = TritonTableBatchedEmbedding(SPECS, FTM, optimizer=opt, weights_dtype=weights_dtype,
                                        execution="triton")
        tables0 = [w.float() for w in m.split_embedding_weights()]
        ids, off, _ = make_batch(SPECS, FTM, 2, seed=9)
        batches = [(ids, off, None, torch.randn(2, m.layout.output_dim))]
        train(m, batches)
        want, _ = reference_steps(tables0, FTM, batches, opt)
        for w, r in zip(m.split_embedding_weights(), want, strict=True):
            # stochastic rounding lands on one of the two neighbours of the fp32 result
            lo = r.to(weights_dtype).float()
            ulp = (torch.nextafter(r.abs().to(weights_dtype), torch.tensor(float("inf"), dtype=weights_dtype))
                   .float() - r.abs().to(weights_dtype).float())
            assert bool(((w.float() - r).abs() <= ulp + 1e-12).all()), (w.float() - lo).abs().max()

    def test_embedding_bag_collection_under_triton():
        """TritonEmbeddingBagCollection on the Triton kernels == on torch ops (KJT keys out of order)."""
        from anyrec.kernels.ebc import TritonEmbeddingBagCollection
        from tests.test_kernels_ebc import OPTS, make_kjt, tables

        t = TritonEmbeddingBagCollection(tables(), OPTS[0], execution="triton")
        p = TritonEmbeddingBagCollection(tables(), OPTS[0], execution="torch")
        p.load_state_dict(t.state_dict())
        for seed in (1, 2):
            kjt = make_kjt(seed)
            out_t, out_p = t(kjt).values(), p(kjt).values()
            torch.testing.assert_close(out_t, out_p, rtol=1e-6, atol=1e-6)
            g = torch.randn_like(out_t)
            out_t.backward(g)
            out_p.backward(g)
        for k, v in p.state_dict().items():
            torch.testing.assert_close(t.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)
