"""DLRM's export signature (`anyrec.models.scoring.ExportSignature`): a trained DLRM as a plain-torch
scoring module, `forward(dense_BI, ids, bags) -> logits_B`, ids and bags one tensor per feature in the
model's feature order (no torchrec type anywhere), and the checks and batch conversion around it.

Legend: B batch, I dense features, F sparse features, D embedding dim, f = F + 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.export import Dim
from torch.nn import functional as F
from torchrec.datasets.utils import Batch

from anyrec.config import IdLayout, ModelConfig
from anyrec.models.dlrm import DLRM, DLRMTrain
from anyrec.models.interaction import CrossInteraction, DotInteraction
from anyrec.models.scoring import ExportSignature, ScoringArgs, TableStage
from anyrec.schema import sparse_features


class DotPairs(nn.Module):
    """DLRM's dot interaction as `DotInteraction` computes its forward (the dense vector, then the upper
    triangle of the gram of dense and pooled vectors), in plain ops."""

    def __init__(self, source: DotInteraction) -> None:
        super().__init__()
        self.register_buffer("pairs", source._pairs.clone())

    def forward(self, dense_BD: torch.Tensor, sparse_BFD: torch.Tensor) -> torch.Tensor:
        feats_BfD = torch.cat([dense_BD.unsqueeze(1), sparse_BFD], dim=1)
        gram_Bff = torch.bmm(feats_BfD, feats_BfD.transpose(1, 2))
        return torch.cat([dense_BD, gram_Bff.flatten(1).index_select(1, self.pairs)], dim=1)


class CrossNet(nn.Module):
    """DLRMv2's interaction as `CrossInteraction` computes it: dense and pooled vectors side by side, then
    its cross net's layers x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l. One cat of [B, 1, D] and [B, F, D]
    (the pooled vectors arrive as a transposed view), so the flattening is a view: flattening the view
    itself makes `torch.export` assume a batch above one."""

    def __init__(self, source: CrossInteraction) -> None:
        super().__init__()
        self.cross = source.cross

    def forward(self, dense_BD: torch.Tensor, sparse_BFD: torch.Tensor) -> torch.Tensor:
        x0_BN = torch.cat([dense_BD.unsqueeze(1), sparse_BFD], dim=1).flatten(1)
        x_BN = x0_BN
        for v, u in zip(self.cross.V, self.cross.U, strict=True):
            # the product and sum in place, in the trained net's order (the same roundings): two [B, N]
            # buffers fewer per layer to allocate and fill (scoring keeps no activations for a backward)
            x_BN = F.linear(F.linear(x_BN, v.weight), u.weight, u.bias).mul_(x0_BN).add_(x_BN)
        return x_BN


class DLRMScoring(nn.Module):
    """A trained DLRM for scoring: `forward(dense_BI, ids, bags) -> logits_B`, its tables pooled by the
    serving layer's `tables` stage (at the artifact's precision)."""

    def __init__(self, model: DLRM, tables: TableStage) -> None:
        super().__init__()
        ebc = model.sparse_arch
        self.tables = tables.pooled([ebc.embedding_bags[c.name].weight for c in ebc.embedding_bag_configs()])
        self.dense_arch = model.dense_arch
        if isinstance(model.interaction, DotInteraction):
            self.interaction: nn.Module = DotPairs(model.interaction)
        elif isinstance(model.interaction, CrossInteraction):
            self.interaction = CrossNet(model.interaction)
        else:
            raise ValueError(f"no serving form for the interaction {type(model.interaction).__name__}")
        self.over_arch = model.over_arch

    def forward(self, dense_BI: torch.Tensor, ids: list[torch.Tensor],
                bags: list[torch.Tensor]) -> torch.Tensor:
        dense_BD = self.dense_arch(dense_BI)
        sparse_BFD = self.tables(ids, bags)
        return self.over_arch(self.interaction(dense_BD, sparse_BFD)).squeeze(-1)


@dataclass(frozen=True)
class ScoringInputs:
    """One batch as a DLRM scoring call takes it."""

    dense_BI: torch.Tensor
    ids: list[torch.Tensor]
    bags: list[torch.Tensor]

    def args(self) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        return self.dense_BI, self.ids, self.bags


def scoring_part(train: nn.Module) -> nn.Module:
    """The DLRM inside a trained DLRMTrain: what a scoring artifact holds (no loss)."""
    assert isinstance(train, DLRMTrain)
    return train.model


def example_inputs(model: ModelConfig, id_layout: IdLayout, batch: int = 3) -> ScoringInputs:
    """A small batch of `model`'s shape (two ids per bag: no id count equal to the batch, which `torch.export`
    would take for a relation)."""
    feats = sparse_features(model)
    ids = [torch.arange(2 * batch, dtype=torch.int64) % f.num_rows for f in feats]
    if id_layout == IdLayout.lengths:
        bags = [torch.full((batch,), 2, dtype=torch.int64) for _ in feats]
    else:
        bags = [torch.arange(0, 2 * batch + 1, 2, dtype=torch.int64) for _ in feats]
    return ScoringInputs(torch.zeros(batch, model.num_dense_features), ids, bags)


def dynamic_shapes(model: ModelConfig, id_layout: IdLayout) -> tuple[Any, ...]:
    """The batch and every feature's id count dynamic; bags of batch lengths or batch + 1 offsets."""
    num_features = len(sparse_features(model))
    batch = Dim("batch", min=1)
    ids = [{0: Dim(f"ids_{i}", min=0)} for i in range(num_features)]
    bags = [{0: batch if id_layout == IdLayout.lengths else batch + 1} for _ in range(num_features)]
    return {0: batch}, ids, bags


def batch_inputs(batch: Batch, id_layout: IdLayout, device: torch.device) -> ScoringInputs:
    """A Batch's features as a scoring call takes them: dense, and per feature its ids and its bags (B + 1
    offsets or B lengths), read from the KeyedJaggedTensor's key-major layout without torchrec's ops."""
    kjt = batch.sparse_features
    num_features, size = len(kjt.keys()), batch.dense_features.shape[0]
    lengths_FB = kjt.lengths().long().view(num_features, size)
    ids = list(torch.split(kjt.values().long(), lengths_FB.sum(dim=1).tolist()))
    if id_layout == IdLayout.lengths:
        bags = list(lengths_FB.unbind(0))
    else:
        offsets_FB1 = torch.cat([lengths_FB.new_zeros(num_features, 1), lengths_FB.cumsum(dim=1)], dim=1)
        bags = list(offsets_FB1.unbind(0))
    return ScoringInputs(batch.dense_features.to(device).float(), [v.to(device) for v in ids],
                         [b.to(device) for b in bags])


def batch_args(batch: Batch, id_layout: IdLayout, device: torch.device) -> tuple[ScoringArgs, torch.Tensor]:
    """(the scoring call's arguments, the labels) of a Batch."""
    return batch_inputs(batch, id_layout, device).args(), batch.labels


def checker(model: ModelConfig, id_layout: IdLayout) -> Callable[[ScoringArgs], None]:
    """The O(F) check of a call's inputs: a [B, I] float32 dense tensor, and per feature a 1-D int64 ids
    tensor and an int64 bags tensor of B + 1 offsets (or B lengths); ValueError in one line otherwise.
    Ids within their tables are the data's checks (the trainer's InputValidator)."""
    f, num_dense = len(sparse_features(model)), model.num_dense_features

    def check(args: ScoringArgs) -> None:
        dense_BI, ids, bags = args
        if len(ids) != f or len(bags) != f:
            raise ValueError(f"inputs: {len(ids)} ids and {len(bags)} bags tensors, the program has {f} "
                             "sparse features")
        if dense_BI.dim() != 2 or dense_BI.shape[1] != num_dense or dense_BI.dtype != torch.float32:
            raise ValueError(f"inputs: dense is {dense_BI.dtype} {list(dense_BI.shape)}, the program takes "
                             f"float32 [batch, {num_dense}]")
        bag_shape = (dense_BI.shape[0] + (id_layout == IdLayout.offsets),)
        for i, (ids_N, bags_X) in enumerate(zip(ids, bags, strict=True)):
            if ids_N.dtype != torch.int64 or ids_N.dim() != 1 or bags_X.dtype != torch.int64 \
                    or bags_X.shape != bag_shape:
                raise ValueError(f"inputs: feature {i}: ids {ids_N.dtype} {list(ids_N.shape)} and bags "
                                 f"{bags_X.dtype} {list(bags_X.shape)}; the program takes 1-D int64 ids and "
                                 f"int64 bags of {bag_shape[0]} {id_layout} for a batch of "
                                 f"{dense_BI.shape[0]}")
    return check


def describe(model: ModelConfig, id_layout: IdLayout) -> dict[str, Any]:
    """The manifest's `inputs`, `output` and `features` of a DLRM artifact."""
    return {
        "inputs": {"dense": f"float32 [batch, {model.num_dense_features}]",
                   "ids": "one int64 tensor per feature, in `features` order",
                   "bags": ("one int64 tensor of batch + 1 offsets per feature"
                            if id_layout == IdLayout.offsets
                            else "one int64 tensor of batch lengths per feature")},
        "output": "float32 [batch] logits (sigmoid: click probability)",
        "features": [{"name": f.name, "table": f.table, "rows": f.num_rows,
                      "ids_per_sample": f.ids_per_sample} for f in sparse_features(model)],
    }


DLRM_EXPORT = ExportSignature(
    part=scoring_part,
    build=DLRMScoring,
    example=lambda model, layout: example_inputs(model, layout).args(),
    dynamic_shapes=dynamic_shapes,
    check=checker,
    batch_args=batch_args,
    describe=describe,
    load_kernels={},
)
