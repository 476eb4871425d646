"""Jagged HSTU attention: the torch version and the Triton kernels against a float64 reference written here
from the generative-recommenders semantics (anyrec/kernels/hstu.py), forward and backward, on ragged
batches (an empty sequence, length 1, the maximum length, targets, contextual tokens, combinations).

The Triton tests run under TRITON_INTERPRET=1 in a child pytest (it must be set before triton is imported,
as in tests/test_kernels_triton_interpret.py); the torch version, the mask, the input checks and the
registry run in this process.
Tolerances, normwise (max |got - ref| <= tol * max |ref|, per output and per gradient): fp32 2e-6 (seen:
3e-7); bf16 3e-2 against the reference run on the bf16-rounded inputs (seen: 3.4e-3 torch, which rounds
only its outputs, 1.0e-2 Triton, which also rounds the scores to bf16 before the value products).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from anyrec.backends.cpu import CPUBackend
from anyrec.config import BackendConfig
from anyrec.kernels import hstu
from anyrec.kernels.hstu import HstuInputError, hstu_attention_torch, valid_mask

from .conftest import run_under_triton_interpreter

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
in_parent = pytest.mark.skipif(IN_INTERPRETER, reason="runs in the parent process")
HEADS, DQ, DV = 2, 8, 12  # dv not a power of two: the kernels' padded head dims are masked
TOL = {torch.float32: 2e-6, torch.bfloat16: 3e-2}

# name -> (lengths, num_targets, num_contextual, max_len)
CASES = {
    "ragged": ([0, 1, 37, 20, 5], None, 0, 40),
    "targets": ([0, 1, 37, 20, 5], [0, 1, 3, 2, 0], 0, 40),
    "contextual": ([0, 2, 37, 9], None, 3, 37),  # 37 = max_len; a sequence shorter than the context
    "contextual_targets": ([0, 1, 37, 9, 4], [0, 1, 4, 2, 0], 2, 37),
    "one_sequence_all_targets": ([6], [5], 1, 8),
}


def make_case(name: str, dtype: torch.dtype, seed: int = 0):
    lengths, targets, ctx, max_len = CASES[name]
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    q, k = (torch.randn(tokens, HEADS, DQ, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(tokens, HEADS, DV, generator=g).to(dtype)
    grad = torch.randn(tokens, HEADS, DV, generator=g).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    nt = None if targets is None else torch.tensor(targets)
    return q, k, v, grad, offsets, max_len, nt, ctx


def reference_f64(q, k, v, offsets, max_len, num_heads, num_targets, ctx):
    """Per sequence, the dense float64 attention with the mask built entry by entry from the rule."""
    assert q.shape[1] == num_heads
    outs = []
    for b in range(offsets.numel() - 1):
        s, e = int(offsets[b]), int(offsets[b + 1])
        n = e - s
        ids = [max(p - ctx + 1, 0) if ctx > 0 else p for p in range(n)]
        top = (n - ctx + 1 if ctx > 0 else n) - (int(num_targets[b]) if num_targets is not None else 0)
        if num_targets is not None:
            ids = [min(i, top) for i in ids]
        mask = torch.tensor([[i == j or ids[i] > ids[j] or (ctx > 0 and ids[i] == 0 and ids[j] < top)
                              for j in range(n)] for i in range(n)], dtype=torch.float64)
        scores = torch.einsum("ihd,jhd->hij", q[s:e], k[s:e]) / math.sqrt(q.shape[2])
        outs.append(torch.einsum("hij,jhv->ihv", F.silu(scores) / max_len * mask, v[s:e]))
    return torch.cat(outs) if outs else v[:0]


def run(fn, q, k, v, grad, offsets, max_len, nt, ctx):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, offsets, max_len, HEADS, nt, ctx)
    return (out, *torch.autograd.grad(out, leaves, grad))


def check_against_reference(fn, name: str, dtype: torch.dtype) -> None:
    q, k, v, grad, offsets, max_len, nt, ctx = make_case(name, dtype)
    got = run(fn, q, k, v, grad, offsets, max_len, nt, ctx)
    want = run(reference_f64, q.double(), k.double(), v.double(), grad.double(), offsets, max_len, nt, ctx)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == dtype and a.shape == b.shape
        a, b = a.detach(), b.detach()
        err, scale = float((a.double() - b).abs().max()), float(b.abs().max())
        assert scale > 0, (name, what)  # every case has work to check
        assert err <= TOL[dtype] * scale, f"{name} {dtype} {what}: max error {err:.2e} of {scale:.2e}"


def visibility(fn, n: int, ctx: int, targets: int | None) -> torch.Tensor:
    """Which columns each row of one sequence reads: with q = k = 1 every score is the same positive
    number, and v = the one-hot of the column makes out[i, j] proportional to valid[i, j]."""
    ones = torch.ones(n, 1, 16)
    v = torch.eye(n)[:, None, :].repeat(1, 1, 1)
    nt = None if targets is None else torch.tensor([targets])
    out = fn(ones, ones, v, torch.tensor([0, n]), n, 1, nt, ctx)
    return (out[:, 0, :] > 0).int()


# contextual 0-1, history 2-3, targets 4-5: history is causal over context and history, a target sees those
# and itself, a contextual row sees every non-target column
EXPECTED_6_CTX2_TGT2 = [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0],
                        [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]]


@in_parent
def test_mask_by_hand():
    assert visibility(hstu_attention_torch, 6, 2, 2).tolist() == EXPECTED_6_CTX2_TGT2
    causal = torch.tril(torch.ones(4, 4)).int().tolist()
    assert visibility(hstu_attention_torch, 4, 0, None).tolist() == causal
    mask = valid_mask(torch.tensor([6, 3]), torch.tensor([2, 0]), 2, 6)
    assert mask[0].int().tolist() == EXPECTED_6_CTX2_TGT2


@in_parent
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_torch_matches_float64(name, dtype):
    check_against_reference(hstu_attention_torch, name, dtype)


@in_parent
def test_chunked_equals_whole(monkeypatch):
    """Long batches run as several padded chunks, checkpointed: the same numbers as one chunk."""
    q, k, v, grad, offsets, max_len, nt, ctx = make_case("contextual_targets", torch.float32)
    whole = run(hstu_attention_torch, q, k, v, grad, offsets, max_len, nt, ctx)
    monkeypatch.setattr(hstu, "CHUNK_SCORE_ELEMENTS", HEADS * 37 * 37)
    assert len(hstu._chunks(CASES["contextual_targets"][0], HEADS)) == 3
    chunked = run(hstu_attention_torch, q, k, v, grad, offsets, max_len, nt, ctx)
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@in_parent
@pytest.mark.parametrize("name", list(CASES))
def test_the_traceable_form_is_the_torch_version_bit_for_bit(name):
    """`hstu_attention_traceable` (what a scoring artifact runs): the torch version's numbers on a batch
    that runs as one chunk, forward and backward."""
    q, k, v, grad, offsets, max_len, nt, ctx = make_case(name, torch.float32)
    want = run(hstu_attention_torch, q, k, v, grad, offsets, max_len, nt, ctx)
    got = run(hstu.hstu_attention_traceable, q, k, v, grad, offsets, max_len, nt, ctx)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@in_parent
def test_autocast_leaves_it_in_fp32():
    q, k, v, _, offsets, max_len, nt, ctx = make_case("targets", torch.float32)
    plain = hstu_attention_torch(q, k, v, offsets, max_len, HEADS, nt, ctx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = hstu_attention_torch(q, k, v, offsets, max_len, HEADS, nt, ctx)
    assert under.dtype == torch.float32 and torch.equal(plain, under)


@in_parent
def test_empty_batch():
    q = torch.zeros(0, HEADS, DQ, requires_grad=True)
    offsets = torch.zeros(3, dtype=torch.int64)  # two empty sequences
    out = hstu_attention_torch(q, q, torch.zeros(0, HEADS, DV), offsets, 4, HEADS, None, 0)
    assert out.shape == (0, HEADS, DV)


@in_parent
def test_input_errors():
    q, k, v, _, offsets, max_len, nt, ctx = make_case("targets", torch.float32)
    cases = [
        ((q[:, :, :4], k, v, offsets, max_len, HEADS, nt, ctx), r"q, k \[T, H, dq\] and v \[T, H, dv\]"),
        ((q, k, v, offsets, max_len, 3, nt, ctx), "num_heads=3 but q has 2 heads"),
        ((q, k, v.half(), offsets, max_len, HEADS, nt, ctx), "one dtype"),
        ((q, k, v, offsets.float(), max_len, HEADS, nt, ctx), "offsets must be a 1-D int64/int32"),
        ((q, k, v, offsets[:-1], max_len, HEADS, nt[:-1], ctx), "offsets must rise from 0 to T=63"),
        ((q, k, v, offsets, 30, HEADS, nt, ctx), "length 37 exceeds max_len=30"),
        ((q, k, v, offsets, max_len, HEADS, nt[:-1], ctx), r"num_targets must be an integer tensor \[B=5\]"),
        ((q, k, v, offsets, max_len, HEADS, torch.tensor([0, 2, 0, 0, 0]), ctx),
         "sequence 1 has 2 targets but length 1"),
        ((q, k, v, offsets, max_len, HEADS, nt, -1), "num_contextual must be an int >= 0"),
        ((q, k, v, offsets, 0, HEADS, nt, ctx), "max_len must be an int >= 1"),
    ]
    for args, match in cases:
        with pytest.raises(HstuInputError, match=match):
            hstu_attention_torch(*args)
    assert issubclass(HstuInputError, ValueError)


@in_parent
def test_registry_selects_and_builds(monkeypatch, fresh_impls):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    b = CPUBackend()
    impl = b.select_kernels(BackendConfig())["hstu_attention"]
    assert impl.name == "torch" and impl.build() is hstu_attention_torch
    assert b.select_kernels(BackendConfig(attention_kernel="torch"))["hstu_attention"].name == "torch"
    with pytest.raises(ValueError, match="backend.attention_kernel=triton is not available on cpu: triton"):
        b.select_kernels(BackendConfig(attention_kernel="triton"))

    class Older(CPUBackend):  # a plugin backend whose kernel_order predates the op: the torch version
        name = "older_test"
        kernel_order = {k: v for k, v in CPUBackend.kernel_order.items() if k != "hstu_attention"}

    assert Older().select_kernels()["hstu_attention"].name == "torch"


if not IN_INTERPRETER:

    @pytest.mark.integration  # a child pytest
    def test_triton_kernels_under_interpreter():
        """Run this module's Triton tests in a child process with TRITON_INTERPRET=1."""
        pytest.importorskip("triton")
        run_under_triton_interpreter(__file__)

else:
    from anyrec.backends.dispatch import get_impl
    from anyrec.kernels.triton_hstu import hstu_attention_triton

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("name", ["ragged", "contextual_targets"])
    def test_triton_matches_float64(name, dtype):
        check_against_reference(hstu_attention_triton, name, dtype)

    def test_triton_mask_by_hand():
        assert get_impl("hstu_attention", "triton").build() is hstu_attention_triton
        assert visibility(hstu_attention_triton, 6, 2, 2).tolist() == EXPECTED_6_CTX2_TGT2
        for n, ctx, targets in ((5, 2, None), (5, 0, 2), (18, 3, 1)):  # 18: rows and columns in two blocks
            want = visibility(hstu_attention_torch, n, ctx, targets)
            assert visibility(hstu_attention_triton, n, ctx, targets).tolist() == want.tolist()

    def test_triton_reads_strided_views_and_matches_torch():
        """q, k, v as views of one fused projection (token and head strides, no copy), ragged with every
        feature on: the Triton kernels and the torch version agree (fp32)."""
        q, k, v, grad, offsets, max_len, nt, ctx = make_case("ragged", torch.float32, seed=1)
        fused = torch.cat([q, k, v], dim=2)
        views = fused[:, :, :DQ], fused[:, :, DQ:2 * DQ], fused[:, :, 2 * DQ:]
        assert views[0].stride() == (HEADS * (2 * DQ + DV), 2 * DQ + DV, 1)
        nt = torch.tensor([0, 0, 5, 1, 2], dtype=torch.int32)
        got = run(hstu_attention_triton, *views, grad, offsets, max_len, nt, 2)
        want = run(hstu_attention_torch, *views, grad, offsets, max_len, nt, 2)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    def test_triton_rejects_fp16():
        q = torch.zeros(2, 1, 16, dtype=torch.float16)
        with pytest.raises(HstuInputError, match="one dtype among float32, bfloat16"):
            hstu_attention_triton(q, q, q, torch.tensor([0, 2]), 2, 1, None, 0)
