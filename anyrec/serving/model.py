"""The scoring model an artifact holds: a DLRM's dense towers and interaction with its tables in one
pure-torch embedding stage at a serving precision, so that `torch.export` traces it to aten ops only and
the exported program loads and runs with torch alone.

Tables are concatenated into one [R, D] buffer (`R` = the sum of the table sizes), each feature's ids
offset by its table's first row, so a batch takes one lookup whatever the number of features:

- fp32: `embedding_bag` over the fp32 rows;
- fp16: rows stored in fp16, gathered, widened to fp32 and summed in fp32;
- int8: row-wise quantized as FBGEMM's 8-bit tables are (each row's min as bias, (max - min) / 255 as
  scale, an unsigned byte per value, scale and bias in fp32). Two kernels: `fbgemm`, the 8-bit row-wise
  lookup torch itself ships (`quantized::embedding_bag_byte_rowwise_offsets`, FBGEMM's kernel, CPU only;
  its own prepack quantizes); `torch`, plain ops on any device (gathered, dequantized, summed in fp32).

Legend: B batch, I dense features, F sparse features, D embedding dim, R rows of all tables, N ids of a
batch (all features), f = F + 1, P pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from anyrec.config import IdLayout, Int8Kernel, TablePrecision
from anyrec.models.dlrm import DLRM
from anyrec.models.interaction import CrossInteraction, DotInteraction

__all__ = ["IdLayout", "PooledTables", "ScoringModel", "TablePrecision", "quantize_rowwise_int8"]

BYTES_PER_VALUE = {TablePrecision.fp32: 4, TablePrecision.fp16: 2, TablePrecision.int8: 1}
INT8_ROW_EXTRA_BYTES = 8  # the fp32 scale and bias of an int8 row


def resolve_int8_kernel(kernel: Int8Kernel) -> Int8Kernel:
    """`auto`: fbgemm where this torch build has its quantized CPU engine, torch otherwise."""
    if kernel != Int8Kernel.auto:
        return kernel
    return Int8Kernel.fbgemm if {"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines) \
        else Int8Kernel.torch


def table_bytes(rows: int, dim: int, precision: TablePrecision) -> int:
    """Bytes a table of `rows` x `dim` takes at `precision` (int8: its per-row scale and bias included)."""
    extra = INT8_ROW_EXTRA_BYTES if precision == TablePrecision.int8 else 0
    return rows * (dim * BYTES_PER_VALUE[precision] + extra)


def quantize_rowwise_int8(weight_RD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise 8-bit quantization (FBGEMM's scheme): uint8 values and an fp32 [R, 2] (scale, bias), such
    that value * scale + bias is within scale / 2 of each weight. A constant row gets scale 1, exact."""
    w_RD = weight_RD.float()
    lo_R, hi_R = w_RD.min(dim=1).values, w_RD.max(dim=1).values
    span_R = hi_R - lo_R
    scale_R = torch.where(span_R > 0, span_R / 255.0, torch.ones_like(span_R))
    q_RD = torch.round((w_RD - lo_R[:, None]) / scale_R[:, None]).clamp_(0, 255).to(torch.uint8)
    return q_RD, torch.stack([scale_R, lo_R], dim=1)


def dequantize_rowwise_int8(q_ND: torch.Tensor, scale_bias_N2: torch.Tensor) -> torch.Tensor:
    """fp32 rows from `quantize_rowwise_int8`'s values and (scale, bias): value * scale + bias, the product
    and sum in place in the widened copy (no [N, D] temporaries)."""
    return q_ND.to(torch.float32, copy=True).mul_(scale_bias_N2[:, :1]).add_(scale_bias_N2[:, 1:])


class PooledTables(nn.Module):
    """Sum-pooled lookups of every feature in its own table, all tables in one buffer at one precision."""

    def __init__(self, weights: list[torch.Tensor], precision: TablePrecision, id_layout: IdLayout,
                 int8_kernel: Int8Kernel = Int8Kernel.torch) -> None:
        super().__init__()
        if int8_kernel == Int8Kernel.auto:
            raise ValueError("int8_kernel: resolve auto first (resolve_int8_kernel)")
        self.int8_kernel = int8_kernel
        dims = {w.shape[1] for w in weights}
        if len(dims) != 1:
            raise ValueError(f"all tables must share one embedding dim, got {sorted(dims)}")
        self.precision, self.id_layout = TablePrecision(precision), IdLayout(id_layout)
        self.num_features, self.dim = len(weights), dims.pop()
        rows = [w.shape[0] for w in weights]
        self.first_rows = [sum(rows[:i]) for i in range(len(rows))]
        # a buffer, not a tensor made in forward: the exported graph would copy that constant every call
        self.register_buffer("first_row_F", torch.tensor(self.first_rows, dtype=torch.int64))
        weight_RD = torch.cat([w.detach().float() for w in weights])
        self.register_buffer("scale_bias", None)
        if self.precision == TablePrecision.int8 and int8_kernel == Int8Kernel.fbgemm:
            # [R, D + 8]: each row's bytes, then its fp32 scale and bias
            self.register_buffer("weight", torch.ops.quantized.embedding_bag_byte_prepack(weight_RD))
        elif self.precision == TablePrecision.int8:
            q_RD, scale_bias_R2 = quantize_rowwise_int8(weight_RD)
            self.register_buffer("weight", q_RD)
            self.register_buffer("scale_bias", scale_bias_R2)
        else:
            dtype = torch.float16 if self.precision == TablePrecision.fp16 else torch.float32
            self.register_buffer("weight", weight_RD.to(dtype))

    def forward(self, ids: list[torch.Tensor], bags: list[torch.Tensor]) -> torch.Tensor:
        """[B, F, D] sums of each feature's bags; `bags` are B + 1 offsets or B lengths per feature."""
        # A few whole-batch ops whatever F (a per-feature op each costs more than the lookup itself)
        bags_FX = torch.stack(bags)
        lengths_FB = bags_FX if self.id_layout == IdLayout.lengths else torch.diff(bags_FX, dim=1)
        ids_N = torch.cat(ids)
        # each id offset by its table's first row (the features' ids follow each other in ids_N)
        ids_N = ids_N + torch.repeat_interleave(self.first_row_F, lengths_FB.sum(dim=1),
                                                output_size=ids_N.shape[0])
        offsets_FB1 = F.pad(torch.cumsum(lengths_FB.flatten(), 0), (1, 0))
        if self.precision == TablePrecision.fp32:
            pooled_FBD = F.embedding_bag(ids_N, self.weight, offsets_FB1, mode="sum",
                                         include_last_offset=True)
        elif self.precision == TablePrecision.int8 and self.int8_kernel == Int8Kernel.fbgemm:
            pooled_FBD = torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
                self.weight, ids_N, offsets_FB1, False, 0, False, None, None, True)
        else:
            # index_select, not advanced indexing: several times faster on a CPU for row gathers
            rows_ND = self.weight.index_select(0, ids_N)
            rows_ND = (dequantize_rowwise_int8(rows_ND, self.scale_bias.index_select(0, ids_N))
                       if self.precision == TablePrecision.int8 else rows_ND.float())
            # the gathered rows summed per bag in fp32 (an fp16 sum would round at every add)
            positions_N = torch.arange(ids_N.shape[0], device=ids_N.device)
            pooled_FBD = F.embedding_bag(positions_N, rows_ND, offsets_FB1, mode="sum",
                                         include_last_offset=True)
        return pooled_FBD.view(self.num_features, -1, self.dim).transpose(0, 1)


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


class ScoringModel(nn.Module):
    """A trained DLRM for scoring: `forward(dense_BI, ids, bags) -> logits_B`, ids and bags one tensor
    per feature in the model's feature order (no torchrec type anywhere)."""

    def __init__(self, model: DLRM, precision: TablePrecision, id_layout: IdLayout,
                 int8_kernel: Int8Kernel = Int8Kernel.torch) -> None:
        super().__init__()
        ebc = model.sparse_arch
        weights = [ebc.embedding_bags[c.name].weight for c in ebc.embedding_bag_configs()]
        self.tables = PooledTables(weights, precision, id_layout, int8_kernel)
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
    """One batch as a scoring call takes it."""

    dense_BI: torch.Tensor
    ids: list[torch.Tensor]
    bags: list[torch.Tensor]

    def args(self) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        return self.dense_BI, self.ids, self.bags
