"""DLRMv4 as a model family's parts: its sizes from the job's model config, its training module with the
backend's attention, its batch schema and what the planner needs of it (see `anyrec.models.family`).

Legend: S tokens per sample through the STU stack (history, contextual tokens and the candidate).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig

from anyrec.backends.dispatch import Impl
from anyrec.config import ModelConfig, parse_stu_recompute
from anyrec.models import hstu
from anyrec.models.hstu import (
    ACTION_BITS,
    CONTEXTUAL_FEATURES,
    REFERENCE_TABLE_ROWS,
    SEQUENCE_FEATURES,
    DLRMv4Config,
)
from anyrec.schema import BatchSchema, HSTUShape, WorkloadFacts

ATTENTION_OP = "hstu_attention"  # the backend's op whose implementation the STU layers call
# model.hstu's keys for the planner only: the data's mean tokens per sample and the root mean square of
# its lengths (contextual tokens and the candidate included), given together; absent: every sample at
# max_seq_len. LONGEST_KEY (optional): the data's longest sample (what a padding attention pads to).
LENGTH_KEYS = ("mean_seq_len", "rms_seq_len")
LONGEST_KEY = "longest_seq_len"


def dlrmv4_config(cfg: ModelConfig) -> DLRMv4Config:
    """The DLRMv4 sizes of a job's model config: `model.hstu`'s DLRMv4Config fields over the reference's,
    `model.embedding_dim` the tables' width, `model.hstu.table_scale` (default 1) every table's rows x that
    (rounded up, at least 2); ValueError naming a field DLRMv4 does not have, or a bad value."""
    fields = dict(cfg.hstu)
    scale = float(fields.pop("table_scale", 1.0))
    for planning_only in (*LENGTH_KEYS, LONGEST_KEY):  # the lengths the planner costs (workload_facts)
        fields.pop(planning_only, None)
    if not 0 < scale <= 1:
        raise ValueError(f"model.hstu.table_scale must be in (0, 1], got {scale}")
    known = {f.name for f in dataclasses.fields(DLRMv4Config)} - {"name", "table_rows", "table_dim"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"model {cfg.name}: model.hstu has no field {unknown[0]!r}; known: table_scale, "
                         f"{', '.join(sorted(known))}")
    if "stu_recompute" in fields:
        fields["stu_recompute"] = parse_stu_recompute(fields["stu_recompute"])
    rows = {f: max(2, math.ceil(r * scale)) for f, r in REFERENCE_TABLE_ROWS.items()}
    out = DLRMv4Config(name=cfg.name, table_rows=rows, table_dim=cfg.embedding_dim, **fields)
    hstu.check_config(out)
    return out


def table_configs(cfg: ModelConfig) -> list[EmbeddingConfig]:
    """One unpooled table per feature (sequence features first), named as the feature."""
    return hstu.table_configs(dlrmv4_config(cfg))


class TargetLoss(nn.Module):
    """The masked BCE of the target positions (`hstu.masked_bce`), their logits checked against the labels:
    a module of its own, so torchrec's pipeline, which traces the training module's forward to find the
    embedding collection's input, never traces this check's control flow."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, logits_G: torch.Tensor, labels_G: torch.Tensor) -> torch.Tensor:
        if logits_G.shape != labels_G.shape:
            raise ValueError(f"labels have shape {tuple(labels_G.shape)} for {logits_G.numel()} targets")
        return hstu.masked_bce(logits_G, labels_G, self.scale)


class DLRMv4Train(nn.Module):
    """DLRMv4's embedding collection and dense part (`hstu.DLRMv4`'s, the same parameter names) with its
    loss: (loss, (logits, labels)) of a whole sequence batch, as the trainer's pipelines expect."""

    def __init__(self, model: hstu.DLRMv4) -> None:
        super().__init__()
        self.sparse_arch = model.sparse_arch
        self.dense_arch = model.dense_arch
        self.loss_fn = TargetLoss(model.loss_scale)

    def forward(self, batch: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        embeddings = self.sparse_arch(batch.sparse_features)
        logits_G = self.dense_arch(embeddings, batch.actions, batch.timestamps, batch.num_targets)
        return self.loss_fn(logits_G, batch.labels), (logits_G.detach(), batch.labels)


def build_train(cfg: ModelConfig, device: torch.device, table_device: torch.device,
                kernels: Mapping[str, Impl]) -> DLRMv4Train:
    """DLRMv4 with its loss, the STU layers calling the backend's `hstu_attention` implementation (its
    Impl in `kernels`, resolved once by `Backend.select_kernels`); tables on `table_device`."""
    impl = kernels.get(ATTENTION_OP)
    if impl is None:
        raise ValueError(f"model.family=dlrmv4 needs the backend's {ATTENTION_OP} implementation "
                         f"(backend.attention_kernel)")
    return DLRMv4Train(hstu.build_dlrmv4(dlrmv4_config(cfg), device, impl.build(), ec_device=table_device))


def batch_schema(cfg: ModelConfig) -> BatchSchema:
    """Eleven features in key order (three sequences, eight contextual ids), no dense inputs."""
    rows = dlrmv4_config(cfg).table_rows
    features = SEQUENCE_FEATURES + CONTEXTUAL_FEATURES
    return BatchSchema(features, tuple(rows[f] for f in features), sequence=True)


def workload_facts(cfg: ModelConfig) -> WorkloadFacts:
    """Ids per sample (every sequence feature: its mean positions; each contextual feature: 1), the dense
    part's FLOPs per sample (the GEMMs over the mean tokens, the attention over the mean of the squared
    lengths) and its HSTU shape with the lengths the data gives (`model.hstu.mean_seq_len` and
    `rms_seq_len`, absent: every sample at `max_seq_len`, the bound; `longest_seq_len`, absent:
    `max_seq_len`). Its activations are the planner's (anyrec.planner.sequence), not stated here."""
    m = dlrmv4_config(cfg)
    lengths = {k: float(cfg.hstu[k]) for k in LENGTH_KEYS if cfg.hstu.get(k) is not None}
    if lengths and len(lengths) != len(LENGTH_KEYS):
        raise ValueError(f"model {cfg.name}: give model.hstu.{' and model.hstu.'.join(LENGTH_KEYS)} together")
    longest = None if cfg.hstu.get(LONGEST_KEY) is None else int(cfg.hstu[LONGEST_KEY])
    C = len(CONTEXTUAL_FEATURES)
    shape = HSTUShape(m.max_seq_len, m.num_layers, m.model_dim, m.num_heads, m.qk_dim, m.v_dim,
                      contextual=C, targets=1, preprocessor_in_dim=len(SEQUENCE_FEATURES) * m.table_dim,
                      preprocessor_hidden_dim=m.preprocessor_hidden_dim,
                      preprocessor_action_dim=len(ACTION_BITS) * m.action_dim, input_dropout=m.input_dropout,
                      stu_dropout=m.stu_dropout, mean_seq_len=lengths.get("mean_seq_len"),
                      rms_seq_len=lengths.get("rms_seq_len"), longest_seq_len=longest,
                      stu_recompute=m.stu_recompute)
    lookups = {f: shape.mean_tokens - C for f in SEQUENCE_FEATURES} | {f: 1.0 for f in CONTEXTUAL_FEATURES}
    at_mean = hstu.dlrmv4_flops_per_sample(m, shape.mean_tokens)
    at_rms = hstu.dlrmv4_flops_per_sample(m, shape.rms_tokens)
    flops = at_mean.total - at_mean.attention + at_rms.attention
    return WorkloadFacts(lookups, dense_flops_per_sample=flops, hstu=shape)
