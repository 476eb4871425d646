"""DLRMv4's export signature (`anyrec.models.scoring.ExportSignature`): a trained DLRMv4 as a plain-torch
scoring module over jagged inputs, and the checks and batch conversion around it.

    logits_G = program(ids, bags, actions_T, timestamps_T, num_targets_B)

- `ids`: one int64 tensor per feature, in `FEATURES` order: item_id, artist_id, album_id at every
  sequence position ([T] each: each sample's history, then its targets, samples back to back), then the
  8 contextual features, one id per sample ([B] each);
- `bags`: the sequence's positions per sample, shared by the three sequence features: B + 1 int64 offsets
  (or B lengths, `export.id_layout=lengths`);
- `actions_T`: int64 action bits per position (1 listen_plus, 2 like, 4 skip; a target's is not read);
  `timestamps_T`: int64 seconds per position; `num_targets_B`: the last num_targets_B[b] positions of
  sample b are its targets (0: a padding sample);
- out: float32 logits [G], one per target, sample by sample (G = the sum of num_targets_B).

The module is the trained model's dense part, its STU layers calling the traceable form of the attention
(`anyrec.kernels.hstu.hstu_attention_traceable`: one padded chunk, the same numbers as the torch version
on a batch it runs as one chunk), after one row lookup per id in the serving layer's tables.

Legend: B samples, T sequence positions of all samples, C contextual features, E table dim, G targets.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.export import Dim
from torch.nn import functional as F

from anyrec.config import IdLayout, ModelConfig
from anyrec.kernels.hstu import hstu_attention_traceable
from anyrec.models.dlrmv4 import DLRMv4Train, dlrmv4_config
from anyrec.models.hstu import CONTEXTUAL_FEATURES, SEQUENCE_FEATURES
from anyrec.models.scoring import ExportSignature, ScoringArgs, TableStage

FEATURES = SEQUENCE_FEATURES + CONTEXTUAL_FEATURES
S, C = len(SEQUENCE_FEATURES), len(CONTEXTUAL_FEATURES)


class DLRMv4Scoring(nn.Module):
    """A trained DLRMv4 for scoring: `forward(ids, bags, actions_T, timestamps_T, num_targets_B) ->
    logits_G` (the module doc), tables looked up by the serving layer's `tables` stage."""

    def __init__(self, train: nn.Module, tables: TableStage) -> None:
        super().__init__()
        assert isinstance(train, DLRMv4Train)
        ec = train.sparse_arch
        self.tables = tables.rows([ec.embeddings[f].weight for f in FEATURES])
        self.lengths_in = tables.id_layout == IdLayout.lengths
        # a copy: the trained module keeps its own attention
        self.dense_arch = copy.deepcopy(train.dense_arch)
        for layer in self.dense_arch.layers:
            layer.attention = hstu_attention_traceable

    def forward(self, ids: list[torch.Tensor], bags: torch.Tensor, actions_T: torch.Tensor,
                timestamps_T: torch.Tensor, num_targets_B: torch.Tensor) -> torch.Tensor:
        rows = self.tables(ids)
        lengths_B = bags if self.lengths_in else torch.diff(bags)
        G = num_targets_B.sum().item()
        torch._check(G >= 0)
        contextual_BCE = torch.stack(rows[S:], dim=1)
        return self.dense_arch.logits(rows[0], rows[1], rows[2], contextual_BCE, lengths_B, actions_T,
                                      timestamps_T, num_targets_B, G)


def scoring_part(train: nn.Module) -> nn.Module:
    """A trained DLRMv4Train without its loss is what an artifact holds: its tables and dense part."""
    assert isinstance(train, DLRMv4Train)
    return train


def _bags(lengths_B: torch.Tensor, id_layout: IdLayout) -> torch.Tensor:
    return lengths_B if id_layout == IdLayout.lengths else F.pad(lengths_B.cumsum(0), (1, 0))


def example(model: ModelConfig, id_layout: IdLayout) -> ScoringArgs:
    """Three samples of 5, 2 and 4 positions, one target each (no size equal to another, which torch.export
    would take for a relation)."""
    rows = dlrmv4_config(model).table_rows
    lengths_B = torch.tensor([5, 2, 4])
    T, B = int(lengths_B.sum()), lengths_B.numel()
    ids = [torch.arange(T) % rows[f] for f in SEQUENCE_FEATURES] + [torch.arange(B) % rows[f]
                                                                   for f in CONTEXTUAL_FEATURES]
    timestamps_T = 1_700_000_000 + 3600 * torch.arange(T)
    num_targets_B = torch.ones(B, dtype=torch.int64)
    return ids, _bags(lengths_B, id_layout), torch.arange(T) % 8, timestamps_T, num_targets_B


def dynamic_shapes(model: ModelConfig, id_layout: IdLayout) -> tuple[Any, ...]:
    """The samples and the positions dynamic (a batch of padding samples alone: no position)."""
    batch, positions = Dim("batch", min=1), Dim("positions", min=0)
    ids = [{0: positions}] * S + [{0: batch}] * C
    bags = {0: batch if id_layout == IdLayout.lengths else batch + 1}
    return ids, bags, {0: positions}, {0: positions}, {0: batch}


def _shape(t: Any) -> str:
    return f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def checker(model: ModelConfig, id_layout: IdLayout) -> Callable[[ScoringArgs], None]:
    """The check of a call's inputs, shapes then values in one device-to-host copy: ValueError in one line
    for anything the graph would misread (ids outside their tables, bags that do not add up to the
    positions, targets beyond a sample's positions, a sequence longer than the model's max_seq_len)."""
    m = dlrmv4_config(model)
    rows = [m.table_rows[f] for f in FEATURES]
    room = m.max_seq_len - C

    def check(args: ScoringArgs) -> None:
        if len(args) != 5:
            raise ValueError(f"inputs: {len(args)} arguments, the program takes 5 (ids, bags, actions, "
                             "timestamps, num_targets)")
        ids, bags, actions_T, timestamps_T, num_targets_B = args
        if not isinstance(ids, list | tuple) or len(ids) != len(FEATURES):
            got = f"{len(ids)}" if isinstance(ids, list | tuple) else _shape(ids)
            raise ValueError(f"inputs: ids must be a list of {len(FEATURES)} tensors "
                             f"({', '.join(FEATURES)}), got {got}")
        tensors = {**dict(zip(FEATURES, ids, strict=True)), "bags": bags, "actions": actions_T,
                   "timestamps": timestamps_T, "num_targets": num_targets_B}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
                raise ValueError(f"inputs: {name} is {_shape(t)}; the program takes 1-D int64 tensors")
        T, B = ids[0].shape[0], num_targets_B.shape[0]
        if B < 1:
            raise ValueError("inputs: an empty batch (num_targets has no sample)")
        want = {**{f: T for f in FEATURES[:S]}, **{f: B for f in FEATURES[S:]}, "actions": T, "timestamps": T,
                "bags": B + (id_layout == IdLayout.offsets)}
        for name, n in want.items():
            if tensors[name].shape[0] != n:
                raise ValueError(f"inputs: {name} has {tensors[name].shape[0]} entries; a batch of {B} "
                                 f"samples and {T} sequence positions (item_id's) takes {n} ({id_layout} "
                                 "for bags)")
        lengths_B = bags if id_layout == IdLayout.lengths else torch.diff(bags)
        start = bags[0] if id_layout == IdLayout.offsets else bags.new_zeros(())
        zero = bags.new_zeros(())
        lows = [t.min() if t.numel() else zero for t in ids]
        highs = [t.max() if t.numel() else zero for t in ids]
        stats = torch.stack([start, lengths_B.min(), lengths_B.sum(), lengths_B.max(), num_targets_B.min(),
                             (num_targets_B > lengths_B).sum(), *lows, *highs]).tolist()
        first, shortest, total, longest, fewest, too_many = stats[:6]
        if first != 0 or shortest < 0:
            raise ValueError(f"inputs: bags must be {id_layout} of non-negative lengths"
                             + (" rising from 0" if id_layout == IdLayout.offsets else ""))
        if total != T:
            raise ValueError(f"inputs: bags add up to {total} positions, the sequence features have {T} "
                             "values each")
        if fewest < 0 or too_many:
            raise ValueError("inputs: every sample needs between 0 (a padding sample) and its positions of "
                             "targets (num_targets)")
        if longest > room:
            raise ValueError(f"inputs: a sequence of {longest} positions plus {C} contextual tokens exceeds "
                             f"the model's max_seq_len={m.max_seq_len}")
        for f, n, lo, hi in zip(FEATURES, rows, stats[6:6 + len(FEATURES)], stats[6 + len(FEATURES):],
                                strict=True):
            if lo < 0 or hi >= n:
                raise ValueError(f"inputs: feature {f}: id {lo if lo < 0 else hi} out of range for its table "
                                 f"of {n} rows (ids must be in [0, {n}))")
    return check


def batch_args(batch: Any, id_layout: IdLayout, device: torch.device) -> tuple[ScoringArgs, torch.Tensor]:
    """(the scoring call's arguments, the labels) of a SequenceBatch (anyrec.data.sequences): ValueError
    in one line where its features are not the model's or its sequence features' lengths differ."""
    kjt = batch.sparse_features
    if list(kjt.keys()) != list(FEATURES):
        raise ValueError(f"the batch's features {kjt.keys()} are not the model's {list(FEATURES)}")
    B = batch.num_targets.numel()
    lengths_KB = kjt.lengths().long().view(len(FEATURES), B)
    if not bool((lengths_KB[1:S] == lengths_KB[0]).all()) or not bool((lengths_KB[S:] == 1).all()):
        raise ValueError("the batch's item_id, artist_id and album_id must have the same lengths in every "
                         "sample and each contextual feature one id per sample")
    ids = [v.to(device) for v in torch.split(kjt.values().long(), lengths_KB.sum(dim=1).tolist())]
    args = (ids, _bags(lengths_KB[0], id_layout).to(device), batch.actions.to(device),
            batch.timestamps.to(device), batch.num_targets.to(device))
    return args, batch.labels


def describe(model: ModelConfig, id_layout: IdLayout) -> dict[str, Any]:
    """The manifest's `inputs`, `output` and `features` of a DLRMv4 artifact."""
    rows = dlrmv4_config(model).table_rows
    return {
        "inputs": {"ids": "one int64 tensor per feature, in `features` order: a sequence feature's id at "
                          "every position [positions], a contextual feature's one per sample [batch]",
                   "bags": ("int64 [batch + 1] offsets" if id_layout == IdLayout.offsets else "int64 [batch] "
                            "lengths") + " of each sample's positions (history then targets), shared by the "
                            "sequence features",
                   "actions": "int64 [positions] action bits (1 listen_plus, 2 like, 4 skip)",
                   "timestamps": "int64 [positions] seconds",
                   "num_targets": "int64 [batch]: the last num_targets[b] positions of sample b are targets"},
        "output": "float32 [sum(num_targets)] logits, one per target in sample order (sigmoid: listen_plus "
                  "probability)",
        "features": [{"name": f, "table": f, "rows": rows[f],
                      "kind": "sequence" if f in SEQUENCE_FEATURES else "contextual"} for f in FEATURES],
    }


DLRMV4_EXPORT = ExportSignature(
    part=scoring_part,
    build=DLRMv4Scoring,
    example=example,
    dynamic_shapes=dynamic_shapes,
    check=checker,
    batch_args=batch_args,
    describe=describe,
    load_kernels={"hstu_attention": "torch"},
)
