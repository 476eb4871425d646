"""Feature interactions: DLRM's pairwise dot products and DCNv2's low-rank cross network. Each op has a
torch module (the oracle) and a Triton-backed subclass with the same parameters, so checkpoints move
between them; each is the builder of its op's `Impl` record (`anyrec.backends.dispatch`).

Legend: B batch, F sparse features, f = F + 1, D embedding dim, N = f * D, P pairs.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from anyrec.backends.dispatch import Impl
from anyrec.kernels.dcn import cross_epilogue
from anyrec.kernels.interaction import dot_interaction


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype the torch module would compute in: autocast's, else the promoted input dtype."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))


class _TrianglePairs(torch.autograd.Function):
    """The upper triangle of feats feats^T, flat: forward one bmm and one index_select; backward without the
    [B, f, f] zero-fill index_select's backward makes every step. It scatters the pair gradients into the
    module's [B, f, f] buffer (zeroed once, off-triangle entries never written), then runs autograd's two
    products for bmm(x, x^T), G @ x and (x^T @ G)^T, the second as G^T @ x: contiguous (the transposed one
    made the sum a slow strided add) and bit-identical with torch's CPU BLAS (tests/test_models.py)."""

    @staticmethod
    def forward(ctx, feats_BfD: torch.Tensor, pairs_P: torch.Tensor, owner: DotInteraction) -> torch.Tensor:
        x_BfD = feats_BfD.to(_compute_dtype(feats_BfD))  # what autocast's bmm would multiply
        gram_Bff = torch.bmm(x_BfD, x_BfD.transpose(1, 2))
        ctx.save_for_backward(x_BfD)
        ctx.pairs_P, ctx.owner, ctx.in_dtype = pairs_P, owner, feats_BfD.dtype
        return gram_Bff.flatten(1).index_select(1, pairs_P)

    @staticmethod
    def backward(ctx, grad_BP: torch.Tensor):
        (x_BfD,) = ctx.saved_tensors
        batch, n = x_BfD.shape[:2]
        grad_BP = grad_BP.to(x_BfD.dtype)
        grad_Bff = ctx.owner._grad_buffer(grad_BP, n)
        grad_Bff.view(batch, n * n).scatter_(1, ctx.pairs_P.expand(batch, -1), grad_BP)
        # autograd's bmm backward: d(x) = G @ x and d(x^T) = x^T @ G, each cast back, then summed
        first_BfD = torch.bmm(grad_Bff, x_BfD).to(ctx.in_dtype)
        second_BfD = torch.bmm(grad_Bff.transpose(1, 2), x_BfD).to(ctx.in_dtype)
        return first_BfD + second_BfD, None, None


class DotInteraction(nn.Module):
    """Pairwise dot products of the dense vector and every pooled embedding (upper triangle)."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        n = num_sparse_features + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        # Flat positions of the upper triangle in a row-major f x f gram: one index_select forward
        # (gram[:, rows, cols] took twice as long forward + backward on a CPU, through index_put's
        # accumulate path; the same values either way); the backward is `_TrianglePairs`'.
        self.register_buffer("_pairs", rows * n + cols, persistent=False)
        self.out_features_extra = n * (n - 1) // 2
        self._grad_Bff: torch.Tensor | None = None  # zero off the triangle, reused by every backward

    def _grad_buffer(self, like_BP: torch.Tensor, n: int) -> torch.Tensor:
        """The [B, n, n] pair-gradient buffer for `like_BP`'s batch, dtype and device (zeroed when made)."""
        buf = self._grad_Bff
        shape = (like_BP.shape[0], n, n)
        if buf is None or buf.shape != shape or buf.dtype != like_BP.dtype or buf.device != like_BP.device:
            buf = self._grad_Bff = like_BP.new_zeros(shape)
        return buf

    def forward(self, dense_BD: torch.Tensor, sparse_BFD: torch.Tensor) -> torch.Tensor:
        feats_BfD = torch.cat([dense_BD.unsqueeze(1), sparse_BFD], dim=1)
        pairs_BP = _TrianglePairs.apply(feats_BfD, self._pairs, self)
        return torch.cat([dense_BD, pairs_BP], dim=1)


class TritonDotInteraction(DotInteraction):
    """DotInteraction in one Triton kernel per direction (`anyrec.kernels.interaction`)."""

    def forward(self, dense_BD: torch.Tensor, sparse_BFD: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(dense_BD, sparse_BFD)
        return dot_interaction(dense_BD.to(dtype), sparse_BFD.to(dtype))


class LowRankCrossNet(nn.Module):
    """DCNv2 cross layers x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l with rank-r factors."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int) -> None:
        super().__init__()
        if num_layers < 1 or low_rank < 1:
            raise ValueError(f"DCN needs num_layers >= 1 and low_rank >= 1, got {num_layers}, {low_rank}")
        self.V = nn.ModuleList(nn.Linear(in_features, low_rank, bias=False) for _ in range(num_layers))
        self.U = nn.ModuleList(nn.Linear(low_rank, in_features, bias=True) for _ in range(num_layers))

    def forward(self, x0_BN: torch.Tensor) -> torch.Tensor:
        x_BN = x0_BN
        for v, u in zip(self.V, self.U, strict=True):
            x_BN = x0_BN * u(v(x_BN)) + x_BN
        return x_BN


class TritonLowRankCrossNet(LowRankCrossNet):
    """LowRankCrossNet: V and U on cuBLAS/hipBLASLt, the epilogue fused in Triton (`anyrec.kernels.dcn`)."""

    def forward(self, x0_BN: torch.Tensor) -> torch.Tensor:
        x_BN = x0_BN
        for v, u in zip(self.V, self.U, strict=True):
            y_BN = F.linear(F.linear(x_BN, v.weight), u.weight)
            x_BN = cross_epilogue(x0_BN, y_BN, u.bias, x_BN)
        return x_BN


class CrossInteraction(nn.Module):
    """DLRMv2's interaction: concatenate dense and pooled embeddings, then a low-rank cross net."""

    def __init__(self, num_sparse_features: int, embedding_dim: int, num_layers: int, low_rank: int,
                 impl: Impl | None = None):
        super().__init__()
        self.out_features = (num_sparse_features + 1) * embedding_dim
        cross = impl.build if impl is not None else LowRankCrossNet  # the `dcn_cross` op's record, or torch
        self.cross = cross(self.out_features, num_layers, low_rank)

    def forward(self, dense_BD: torch.Tensor, sparse_BFD: torch.Tensor) -> torch.Tensor:
        x_BN = torch.cat([dense_BD, sparse_BFD.flatten(1)], dim=1)
        return self.cross(x_BN)


def dot_interaction_module(num_sparse_features: int, impl: Impl | None = None) -> DotInteraction:
    """The dot interaction for the dispatch choice `impl` (its Impl's builder), torch's without one."""
    return impl.build(num_sparse_features) if impl is not None else DotInteraction(num_sparse_features)
