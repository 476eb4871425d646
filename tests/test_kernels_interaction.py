"""The dense-op Triton kernels (dot interaction, DCN cross epilogue) under TRITON_INTERPRET=1 (CPU).

Oracles: `anyrec.models.interaction.DotInteraction` and `LowRankCrossNet` (plain torch). As in
tests/test_kernels_triton_interpret.py, TRITON_INTERPRET must be set before triton is imported, so
the kernel tests run in a child pytest with the variable set; input checks run in this process.
"""

from __future__ import annotations

import os

import pytest
import torch

from anyrec.backends.dispatch import get_impl
from anyrec.models.interaction import (
    DotInteraction,
    LowRankCrossNet,
    TritonDotInteraction,
    TritonLowRankCrossNet,
)

from .conftest import run_under_triton_interpreter

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
triton = pytest.importorskip("triton")

# (F sparse features, D dim): n = F + 1 from 4 (one 16-row tile, padded) to 27 (DLRM on Criteo);
# D below, at and above one 16-column tile, and not a power of two.
SHAPES = [(3, 4), (8, 12), (26, 16), (5, 40)]
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 5e-2}}


def test_input_checks():
    from anyrec.kernels.dcn import cross_epilogue
    from anyrec.kernels.interaction import dot_interaction

    with pytest.raises(ValueError, match="one dtype"):
        dot_interaction(torch.zeros(2, 4), torch.zeros(2, 3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"dense \(2, 5\) does not match sparse \(2, 3, 4\)"):
        dot_interaction(torch.zeros(2, 5), torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="cross epilogue: x0"):
        cross_epilogue(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(5), torch.zeros(2, 4))


if not IN_INTERPRETER:

    @pytest.mark.integration  # a child pytest
    def test_dense_kernels_under_interpreter():
        """Run this module's kernel tests in a child process with TRITON_INTERPRET=1."""
        run_under_triton_interpreter(__file__)

else:
    from torchrec import KeyedJaggedTensor

    from anyrec.config import ModelConfig
    from anyrec.kernels.dcn import cross_epilogue
    from anyrec.kernels.interaction import dot_interaction
    from anyrec.models.dlrm import build_model, feature_names

    def grads(out: torch.Tensor, inputs, g: torch.Tensor):
        return torch.autograd.grad(out, inputs, g)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize(("F", "D"), SHAPES)
    def test_dot_interaction(F, D, dtype):
        """Forward and both input gradients match the torch module (fp32 math on the same inputs)."""
        g = torch.Generator().manual_seed(F * 100 + D)
        dense_BD = torch.randn(5, D, generator=g).to(dtype).requires_grad_()
        sparse_BFD = torch.randn(5, F, D, generator=g).to(dtype).requires_grad_()
        out = dot_interaction(dense_BD, sparse_BFD)
        assert out.dtype == dtype and out.shape == (5, D + (F + 1) * F // 2)
        ref_d = dense_BD.detach().float().requires_grad_()
        ref_s = sparse_BFD.detach().float().requires_grad_()
        ref = DotInteraction(F)(ref_d, ref_s)
        torch.testing.assert_close(out.float(), ref, **TOL[dtype])
        grad_out = torch.randn(ref.shape, generator=g).to(dtype)
        got = grads(out, (dense_BD, sparse_BFD), grad_out)
        want = grads(ref, (ref_d, ref_s), grad_out.float())
        for name, a, b in zip(("dense", "sparse"), got, want, strict=True):
            assert a.dtype == dtype
            torch.testing.assert_close(a.float(), b, **TOL[dtype], msg=f"grad {name}")

    def test_dot_interaction_module_under_autocast():
        """Like the torch module under bf16 autocast: bf16 output, gradients in each input's dtype."""
        g = torch.Generator().manual_seed(3)
        dense_BD = torch.randn(5, 8, generator=g).bfloat16().requires_grad_()
        sparse_BFD = torch.randn(5, 4, 8, generator=g).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = TritonDotInteraction(4)(dense_BD, sparse_BFD)
            ref = DotInteraction(4)(dense_BD, sparse_BFD)
        assert out.dtype == ref.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
        out.float().sum().backward()
        assert dense_BD.grad.dtype == torch.bfloat16 and sparse_BFD.grad.dtype == torch.float32

    @pytest.mark.parametrize(("B", "N", "layers"), [(5, 4 * 4, 2), (5, 13 * 8, 3), (70, 200, 1)],
                             ids=["tiny", "one-tile", "row-splits"])
    def test_cross_net(B, N, layers):
        """TritonLowRankCrossNet == LowRankCrossNet in fp32: output, input and parameter gradients.

        B=70, N=200: two column tiles and several row splits of the bias-gradient reduction."""
        torch.manual_seed(N)
        ref_net = LowRankCrossNet(N, layers, 3)
        net = TritonLowRankCrossNet(N, layers, 3)
        net.load_state_dict(ref_net.state_dict())
        x0_BN = torch.randn(B, N, requires_grad=True)
        out, ref = net(x0_BN), ref_net(x0_BN)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])
        grad_out = torch.randn_like(ref)
        got = grads(out, [x0_BN, *net.parameters()], grad_out)
        want = grads(ref, [x0_BN, *ref_net.parameters()], grad_out)
        names = ["x0", *(n for n, _ in net.named_parameters())]
        for name, a, b in zip(names, got, want, strict=True):
            torch.testing.assert_close(a, b, **TOL[torch.float32], msg=f"grad {name}")

    def test_cross_epilogue_mixed_dtypes():
        """bf16 GEMM output with fp32 x0, b, x (autocast): fp32 out, each gradient in its input's dtype."""
        g = torch.Generator().manual_seed(7)
        x0_BN, x_BN = (torch.randn(5, 24, generator=g).requires_grad_() for _ in range(2))
        y_BN = torch.randn(5, 24, generator=g).bfloat16().requires_grad_()
        b_N = torch.randn(24, generator=g).requires_grad_()
        inputs = (x0_BN, y_BN, b_N, x_BN)
        out = cross_epilogue(*inputs)
        ref = x0_BN * (y_BN.float() + b_N) + x_BN
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, **TOL[torch.float32])
        grad_out = torch.randn(ref.shape, generator=g)
        got, want = grads(out, inputs, grad_out), grads(ref, inputs, grad_out)
        for name, a, b in zip(("x0", "y", "b", "x"), got, want, strict=True):
            assert a.dtype == b.dtype, name
            torch.testing.assert_close(a.float(), b.float(), **TOL[b.dtype], msg=f"grad {name}")

    @pytest.mark.parametrize("interaction", ["dot", "dcn"])
    def test_tiny_dlrm_on_triton_kernels(interaction):
        """A tiny DLRM with the dense op on Triton == the torch one: logits and every gradient."""
        cfg = ModelConfig(name="tiny", interaction=interaction, embedding_dim=8, num_dense_features=3,
                          table_rows=[10, 7, 5], bottom_mlp=[8], top_mlp=[4, 1], dcn_num_layers=2,
                          dcn_low_rank=4)
        op = "interaction" if interaction == "dot" else "dcn_cross"
        torch.manual_seed(0)
        ref_model = build_model(cfg, torch.device("cpu"))
        model = build_model(cfg, torch.device("cpu"), kernels={op: get_impl(op, "triton")})
        model.load_state_dict(ref_model.state_dict())
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(0, 3, (3 * 5,), generator=g)
        kjt = KeyedJaggedTensor(keys=feature_names(3), lengths=lengths,
                                values=torch.randint(0, 5, (int(lengths.sum()),), generator=g))
        dense_BI = torch.randn(5, 3, generator=g)
        out, ref = model(dense_BI, kjt), ref_model(dense_BI, kjt)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])
        out.square().sum().backward()
        ref.square().sum().backward()
        ref_params = dict(ref_model.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL[torch.float32], msg=name)
