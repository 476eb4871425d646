"""DLRM (dot interaction) and DLRMv2 (DCNv2 cross interaction) over a torchrec EmbeddingBagCollection.

Legend: B batch, F sparse features, D embedding dim, I dense features.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec.backends.dispatch import Impl
from anyrec.config import ModelConfig
from anyrec.models.interaction import CrossInteraction, dot_interaction_module
from anyrec.models.mlp import MLP
from anyrec.schema import BatchSchema, WorkloadFacts, feature_names, sparse_features

__all__ = ["DLRM", "DLRMTrain", "batch_schema", "build_model", "build_train", "feature_names",
           "table_configs", "workload_facts"]


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


class DLRMTrain(nn.Module):
    """A DLRM plus its loss, taking a whole Batch (the shape torchrec's train pipelines expect)."""

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(loss, (logits, labels)) of a torchrec `Batch` (dense_features, sparse_features, labels)."""
        logits_B = self.model(batch.dense_features, batch.sparse_features)
        loss = self.loss_fn(logits_B.float(), batch.labels)
        return loss, (logits_B.detach(), batch.labels)


def build_train(cfg: ModelConfig, device: torch.device, table_device: torch.device,
                kernels: Mapping[str, Impl]) -> DLRMTrain:
    """The training module (DLRM and its loss); tables on `table_device` (meta: DistributedModelParallel
    allocates the shards)."""
    return DLRMTrain(build_model(cfg, device, ebc_device=table_device, kernels=kernels))


def build_train_around(cfg: ModelConfig, tables: nn.Module, device: torch.device,
                       kernels: Mapping[str, Impl]) -> DLRMTrain:
    """The training module around an already built EmbeddingBagCollection (one device, no sharding)."""
    return DLRMTrain(DLRM(cfg, tables, device=device, kernels=kernels))


def batch_schema(cfg: ModelConfig) -> BatchSchema:
    """What a DLRM reads of a batch: dense features, and one bag of ids per sparse feature."""
    features = sparse_features(cfg)
    return BatchSchema(tuple(f.name for f in features), tuple(f.num_rows for f in features),
                       cfg.num_dense_features)


def interaction_pairs(model: ModelConfig) -> int:
    """Entries of the pairwise interaction per sample: (features + 1)^2 for the dot interaction (the
    dense vector and each table's pooled embedding), 0 for DCN (its cost is GEMMs, in the FLOPs)."""
    return (len(model.table_rows) + 1) ** 2 if model.interaction == "dot" else 0


def dense_memory_per_sample(model: ModelConfig) -> tuple[int, int, int]:
    """fp32 bytes per sample of the dense part's tensors alive (1) while the embeddings are looked up: the
    bottom MLP's outputs (and the dot interaction's gradient buffer, (features + 1)^2, kept between
    steps); (2) at the end of the interaction: those, its input ((features + 1) x dim), output and (dot)
    its (features + 1)^2 matrix, or (DCN) each cross layer's input, low-rank projection and output;
    (3) while the backward reaches the embeddings: the bottom MLP's outputs and the kept buffer."""
    f1, dim = len(model.table_rows) + 1, model.embedding_dim
    bottom = sum(model.bottom_mlp)
    kept = f1 * f1 if model.interaction == "dot" else 0
    if model.interaction == "dot":
        interaction = f1 * dim + f1 * f1 + f1 * (f1 - 1) // 2
    else:
        width = f1 * dim
        interaction = width + model.dcn_num_layers * (2 * width + model.dcn_low_rank)
    return 4 * (bottom + kept), 4 * (bottom + kept + interaction), 4 * (bottom + kept)


def workload_facts(cfg: ModelConfig) -> WorkloadFacts:
    """What the planner needs of a DLRM besides its tables: each feature's ids per sample (multi-hot), the
    interaction's entries and the dense part's activation bytes per sample."""
    lookup, forward, backward = dense_memory_per_sample(cfg)
    return WorkloadFacts({f.name: float(f.ids_per_sample) for f in sparse_features(cfg)},
                         interaction_pairs(cfg), lookup, forward, backward, cfg.num_dense_features)
