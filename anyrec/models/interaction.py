"""Feature interactions: DLRM's pairwise dot products and DCNv2's low-rank cross network.

Legend: B batch, F sparse features, D embedding dim, N = (F + 1) * D.
"""

from __future__ import annotations

import torch
from torch import nn


class DotInteraction(nn.Module):
    """Pairwise dot products of the dense vector and every pooled embedding (upper triangle)."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        n = num_sparse_features + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("_rows", rows, persistent=False)
        self.register_buffer("_cols", cols, persistent=False)
        self.out_features_extra = n * (n - 1) // 2

    def forward(self, dense_BD: torch.Tensor, sparse_BFD: torch.Tensor) -> torch.Tensor:
        feats_BfD = torch.cat([dense_BD.unsqueeze(1), sparse_BFD], dim=1)
        gram_Bff = torch.bmm(feats_BfD, feats_BfD.transpose(1, 2))
        pairs_BP = gram_Bff[:, self._rows, self._cols]
        return torch.cat([dense_BD, pairs_BP], dim=1)


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


class CrossInteraction(nn.Module):
    """DLRMv2's interaction: concatenate dense and pooled embeddings, then a low-rank cross net."""

    def __init__(self, num_sparse_features: int, embedding_dim: int, num_layers: int, low_rank: int):
        super().__init__()
        self.out_features = (num_sparse_features + 1) * embedding_dim
        self.cross = LowRankCrossNet(self.out_features, num_layers, low_rank)

    def forward(self, dense_BD: torch.Tensor, sparse_BFD: torch.Tensor) -> torch.Tensor:
        x_BN = torch.cat([dense_BD, sparse_BFD.flatten(1)], dim=1)
        return self.cross(x_BN)
