"""The tables of a scoring artifact: a trained model's tables in one pure-torch embedding stage at a
serving precision, so that `torch.export` traces the family's scoring module (anyrec.models.scoring) to aten
ops only and the exported program loads and runs with torch alone. `TableStages` is what a family's
scoring module asks for its tables: pooled (`PooledTables`, DLRM's bags) or one row per id (`RowTables`,
DLRMv4's sequence and contextual features).

Tables are concatenated into one [R, D] buffer (`R` = the sum of the table sizes), each feature's ids
offset by its table's first row, so a batch takes one lookup whatever the number of features:

- fp32: `embedding_bag` over the fp32 rows;
- fp16: rows stored in fp16, gathered, widened to fp32 and summed in fp32;
- int8: row-wise quantized as FBGEMM's 8-bit tables are (each row's min as bias, (max - min) / 255 as
  scale, an unsigned byte per value, scale and bias in fp32). Two kernels: `fbgemm`, the 8-bit row-wise
  lookup torch itself ships (`quantized::embedding_bag_byte_rowwise_offsets`, FBGEMM's kernel, CPU only;
  its own prepack quantizes); `torch`, plain ops on any device (gathered, dequantized, summed in fp32).

A row lookup (`RowTables`) gathers the rows at the same precision (fp32: `embedding`; int8 `fbgemm`: the
same op with a bag per id).

Legend: B batch, F sparse features, D embedding dim, R rows of all tables, N ids of a batch (all features).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from anyrec.config import IdLayout, Int8Kernel, TablePrecision
from anyrec.models.dlrm import DLRM
from anyrec.models.dlrm_scoring import DLRMScoring

__all__ = ["IdLayout", "PackedTables", "PooledTables", "RowTables", "ScoringModel", "TablePrecision",
           "TableStages", "quantize_rowwise_int8"]

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


class PackedTables(nn.Module):
    """Every feature's table (one [rows, D] weight each) in one buffer at `precision`: `weight` (the tables
    one after another), `scale_bias` (int8 with the torch kernel) and each table's first row."""

    def __init__(self, weights: list[torch.Tensor], precision: TablePrecision,
                 int8_kernel: Int8Kernel = Int8Kernel.torch) -> None:
        super().__init__()
        if int8_kernel == Int8Kernel.auto:
            raise ValueError("int8_kernel: resolve auto first (resolve_int8_kernel)")
        self.int8_kernel = int8_kernel
        dims = {w.shape[1] for w in weights}
        if len(dims) != 1:
            raise ValueError(f"all tables must share one embedding dim, got {sorted(dims)}")
        self.precision = TablePrecision(precision)
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

    def gathered_rows(self, ids_N: torch.Tensor) -> torch.Tensor:
        """The rows of the packed ids `ids_N` in fp32 [N, D], gathered with plain ops (any device): int8 rows
        dequantized with their scale and bias, fp16 rows widened."""
        # index_select, not advanced indexing: several times faster on a CPU for row gathers
        rows_ND = self.weight.index_select(0, ids_N)
        return (dequantize_rowwise_int8(rows_ND, self.scale_bias.index_select(0, ids_N))
                if self.precision == TablePrecision.int8 else rows_ND.float())


class PooledTables(PackedTables):
    """Sum-pooled lookups of every feature in its own table, all tables in one buffer at one precision."""

    def __init__(self, weights: list[torch.Tensor], precision: TablePrecision, id_layout: IdLayout,
                 int8_kernel: Int8Kernel = Int8Kernel.torch) -> None:
        super().__init__(weights, precision, int8_kernel)
        self.id_layout = IdLayout(id_layout)

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
            rows_ND = self.gathered_rows(ids_N)
            # the gathered rows summed per bag in fp32 (an fp16 sum would round at every add)
            positions_N = torch.arange(ids_N.shape[0], device=ids_N.device)
            pooled_FBD = F.embedding_bag(positions_N, rows_ND, offsets_FB1, mode="sum",
                                         include_last_offset=True)
        return pooled_FBD.view(self.num_features, -1, self.dim).transpose(0, 1)


class RowTables(PackedTables):
    """One row per id of every feature (unpooled: sequence embeddings), each feature in its own table, all
    tables in one buffer at one precision; the rows come back in fp32."""

    def forward(self, ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per feature, its ids' rows [N_f, D]."""
        # each id offset by its table's first row (a constant per feature), then one lookup for all
        ids_N = torch.cat([ids_n + first for ids_n, first in zip(ids, self.first_rows, strict=True)])
        if self.precision == TablePrecision.fp32:
            rows_ND = F.embedding(ids_N, self.weight)
        elif self.precision == TablePrecision.int8 and self.int8_kernel == Int8Kernel.fbgemm:
            offsets_N1 = torch.arange(ids_N.shape[0] + 1, device=ids_N.device)  # a bag per id
            rows_ND = torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
                self.weight, ids_N, offsets_N1, False, 0, False, None, None, True)
        else:
            rows_ND = self.gathered_rows(ids_N)
        return list(torch.split(rows_ND, [ids_n.shape[0] for ids_n in ids]))


@dataclass(frozen=True)
class TableStages:
    """The table lookups a family's scoring module asks for (anyrec.models.scoring.TableStage), at one
    precision, id layout and int8 kernel."""

    precision: TablePrecision
    id_layout: IdLayout
    int8_kernel: Int8Kernel

    def pooled(self, weights: list[torch.Tensor]) -> PooledTables:
        return PooledTables(weights, self.precision, self.id_layout, self.int8_kernel)

    def rows(self, weights: list[torch.Tensor]) -> RowTables:
        return RowTables(weights, self.precision, self.int8_kernel)


class ScoringModel(DLRMScoring):
    """A trained DLRM's scoring module with its tables at `precision` (the dlrm family's export signature
    built on `TableStages`)."""

    def __init__(self, model: DLRM, precision: TablePrecision, id_layout: IdLayout,
                 int8_kernel: Int8Kernel = Int8Kernel.torch) -> None:
        super().__init__(model, TableStages(TablePrecision(precision), IdLayout(id_layout), int8_kernel))
