"""DLRM (dot interaction) and DLRMv2 (DCNv2 cross interaction) over a torchrec EmbeddingBagCollection.

Legend: B batch, F sparse features, D embedding dim, I dense features.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec.backends.dispatch import Impl
from anyrec.config import ModelConfig
from anyrec.models.interaction import CrossInteraction, dot_interaction_module
from anyrec.models.mlp import MLP
from anyrec.schema import feature_names, sparse_features

__all__ = ["DLRM", "build_model", "feature_names", "table_configs"]


def table_configs(cfg: ModelConfig) -> list[EmbeddingBagConfig]:
    """One sum-pooled table per sparse feature, named as the schema names them (`t_cat_<i>`)."""
    return [EmbeddingBagConfig(name=f.table, embedding_dim=cfg.embedding_dim, num_embeddings=f.num_rows,
                               feature_names=[f.name], pooling=PoolingType.SUM)
            for f in sparse_features(cfg)]


class DLRM(nn.Module):
    """Bottom MLP on dense features, pooled embeddings, an interaction, and a top MLP to one logit.
    `kernels`: the backend's Impl record per op (`Backend.select_kernels`); its `interaction` entry builds
    the dot interaction's module, `dcn_cross` the cross net's (torch's where absent)."""

    def __init__(self, cfg: ModelConfig, ebc: EmbeddingBagCollection, device: torch.device | None = None,
                 kernels: Mapping[str, Impl] | None = None):
        super().__init__()
        kernels = kernels or {}
        num_sparse = len(ebc.embedding_bag_configs())
        dim = cfg.embedding_dim
        if not cfg.bottom_mlp or cfg.bottom_mlp[-1] != dim:
            raise ValueError(f"model {cfg.name}: bottom_mlp must end in embedding_dim={dim}, "
                             f"got {cfg.bottom_mlp}")
        if not cfg.top_mlp or cfg.top_mlp[-1] != 1:
            raise ValueError(f"model {cfg.name}: top_mlp must end in 1, got {cfg.top_mlp}")
        self.sparse_arch = ebc
        self.feature_names = [f for c in ebc.embedding_bag_configs() for f in c.feature_names]
        with torch.device(device or torch.device("cpu")):
            self.dense_arch = MLP(cfg.num_dense_features, cfg.bottom_mlp)
            if cfg.interaction == "dot":
                self.interaction: nn.Module = dot_interaction_module(num_sparse, kernels.get("interaction"))
                top_in = dim + self.interaction.out_features_extra
            elif cfg.interaction == "dcn":
                self.interaction = CrossInteraction(num_sparse, dim, cfg.dcn_num_layers, cfg.dcn_low_rank,
                                                    impl=kernels.get("dcn_cross"))
                top_in = self.interaction.out_features
            else:
                raise ValueError(f"model {cfg.name}: unknown interaction {cfg.interaction!r} (dot|dcn)")
            self.over_arch = MLP(top_in, cfg.top_mlp, final_activation=False)

    def forward(self, dense_BI: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        # Sharded, the lookups run and their all-to-all starts here, and the result is awaited only at
        # `to_dict()`: the bottom MLP runs while the embeddings travel. In the backward the same order
        # lets the bottom MLP's gradient run between sending the embeddings' gradient and waiting for it
        # (the engine runs later-created nodes first). Same ops on the same values as dense-first:
        # bit-identical results.
        pooled = self.sparse_arch(sparse)
        dense_BD = self.dense_arch(dense_BI)
        # One split of the pooled [B, F*D] output (its backward is one cat); indexing it by key
        # would narrow it F times, and each narrow's backward zero-fills a whole [B, F*D] gradient.
        by_key = pooled.to_dict()
        sparse_BFD = torch.stack([by_key[f] for f in self.feature_names], dim=1)
        return self.over_arch(self.interaction(dense_BD, sparse_BFD)).squeeze(-1)


def build_model(cfg: ModelConfig, device: torch.device, ebc_device: torch.device | None = None,
                kernels: Mapping[str, Impl] | None = None) -> DLRM:
    """The DLRM for `cfg`; tables on `ebc_device` (meta: let DistributedModelParallel allocate shards);
    `kernels`: the backend's implementation per op (see `DLRM`)."""
    ebc = EmbeddingBagCollection(table_configs(cfg), device=ebc_device or device)
    return DLRM(cfg, ebc, device=device, kernels=kernels)
