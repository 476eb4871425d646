"""DLRMv4 (MLPerf Training v6.1): HSTU over each user's time-ordered history, one or more candidates last.

The sparse part is a torchrec `EmbeddingCollection` (unpooled: one vector per position), the dense part
`HSTUDense`: the contextual preprocessor, the positional encoder, input dropout, a stack of STU layers, the
timestamp layer-norm postprocessor at each candidate, an item MLP on the candidate's ids, and a head on
user x item. `DLRMv4` joins them with the loss, BCE on the candidates' labels scaled as the reference does.

Legend: B samples, T sequence positions of all samples (jagged: history then targets), C contextual tokens
per sample, N = T + B * C tokens through the STU stack, E table dim, D model dim, G targets of all samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from anyrec.config import STURecompute
from anyrec.models.hstu_layers import (
    ACTION_BITS,
    ContextualPreprocessor,
    PositionalEncoder,
    TimestampLayerNormPostprocessor,
    positions,
    swish_head,
)
from anyrec.models.stu import HSTUAttention, STULayer, norm_mlp

# Per position: the listened item and its artist and album (history, then the candidates).
SEQUENCE_FEATURES = ("item_id", "artist_id", "album_id")
# One id per sample each; they become the C contextual tokens at the head of every sequence, in this order.
CONTEXTUAL_FEATURES = ("uid", "user_x_artist", "user_x_album", "user_x_hour", "item_x_hour", "artist_x_hour",
                       "user_x_is_organic", "user_x_artist_x_hour")
# The reference's tables (rows), one per feature, named as the feature.
REFERENCE_TABLE_ROWS = {
    "item_id": 9_390_624, "artist_id": 1_293_395, "album_id": 3_367_692, "uid": 1_000_001,
    "user_x_artist": 100_000_000, "user_x_album": 40_000_000, "user_x_hour": 24_000_000,
    "item_x_hour": 40_000_000, "artist_x_hour": 32_000_000, "user_x_is_organic": 2_000_000,
    "user_x_artist_x_hour": 40_000_000,
}


@dataclass
class DLRMv4Config:
    """DLRMv4's sizes; the defaults are the MLPerf reference's."""

    name: str = "dlrmv4"
    table_rows: dict[str, int] = field(default_factory=lambda: dict(REFERENCE_TABLE_ROWS))
    table_dim: int = 512  # E, every table
    model_dim: int = 512  # D, through the STU stack
    preprocessor_hidden_dim: int = 256
    action_dim: int = 8  # per action bit
    num_layers: int = 3
    num_heads: int = 4
    qk_dim: int = 128  # per head
    v_dim: int = 128  # U and V, per head
    input_dropout: float = 0.2
    stu_dropout: float = 0.1
    position_buckets: int = 8192
    time_buckets: int = 2048
    item_hidden_dim: int = 512
    head_hidden_dim: int = 512
    loss_scale: float = 0.2
    max_seq_len: int = 4096  # tokens per sample through the STU stack, contextual ones included
    # The reference's STU layers attend causally over [contextual, history, targets]: every token sees the
    # contextual tokens before it. True also lets the contextual tokens see the whole history (generative-
    # recommenders' `contextual_seq_len`), which, over several layers, carries later history into earlier
    # positions.
    contextual_sees_history: bool = False
    # What each STU layer's backward recomputes rather than keeps (the reference's: selective); the numbers
    # are the same either way
    stu_recompute: STURecompute = STURecompute.selective


def check_config(cfg: DLRMv4Config) -> None:
    """ValueError naming the first field that cannot build a model."""
    features = set(SEQUENCE_FEATURES + CONTEXTUAL_FEATURES)
    if set(cfg.table_rows) != features:
        raise ValueError(f"model {cfg.name}: table_rows must name exactly {sorted(features)}, "
                         f"got {sorted(cfg.table_rows)}")
    for name, rows in cfg.table_rows.items():
        if rows < 1:
            raise ValueError(f"model {cfg.name}: table {name} needs at least one row, got {rows}")
    for name in ("table_dim", "model_dim", "preprocessor_hidden_dim", "action_dim", "num_layers", "num_heads",
                 "qk_dim", "v_dim", "position_buckets", "time_buckets", "item_hidden_dim", "head_hidden_dim"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"model {cfg.name}: {name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("input_dropout", "stu_dropout"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ValueError(f"model {cfg.name}: {name} must be in [0, 1), got {getattr(cfg, name)}")
    if cfg.max_seq_len < len(CONTEXTUAL_FEATURES) + 1:
        raise ValueError(f"model {cfg.name}: max_seq_len {cfg.max_seq_len} leaves no room after the "
                         f"{len(CONTEXTUAL_FEATURES)} contextual tokens")


def table_configs(cfg: DLRMv4Config) -> list[EmbeddingConfig]:
    """One unpooled table per feature, named as the feature, sequence features first."""
    return [EmbeddingConfig(name=f, embedding_dim=cfg.table_dim, num_embeddings=cfg.table_rows[f],
                            feature_names=[f])
            for f in SEQUENCE_FEATURES + CONTEXTUAL_FEATURES]


class HSTUDense(nn.Module):
    """Everything of DLRMv4 after the embedding lookup: a logit per target position."""

    def __init__(self, cfg: DLRMv4Config, attention: HSTUAttention) -> None:
        super().__init__()
        check_config(cfg)
        self.num_contextual = len(CONTEXTUAL_FEATURES)
        self.attention_contextual = self.num_contextual if cfg.contextual_sees_history else 0
        self.max_seq_len = cfg.max_seq_len
        self.input_dropout = cfg.input_dropout
        D = cfg.model_dim
        self.preprocessor = ContextualPreprocessor(cfg.table_dim, cfg.preprocessor_hidden_dim, D,
                                                   cfg.action_dim, self.num_contextual)
        self.positional = PositionalEncoder(cfg.position_buckets, cfg.time_buckets, D)
        self.layers = nn.ModuleList(
            STULayer(D, cfg.num_heads, cfg.qk_dim, cfg.v_dim, cfg.stu_dropout, attention,
                     selective_recompute=cfg.stu_recompute == STURecompute.selective)
            for _ in range(cfg.num_layers))
        self.postprocessor = TimestampLayerNormPostprocessor(D)
        self.item_mlp = norm_mlp(len(SEQUENCE_FEATURES) * cfg.table_dim, cfg.item_hidden_dim, D,
                                 normal_init=False)
        self.head = swish_head(D, cfg.head_hidden_dim)

    def forward(self, embeddings: Mapping[str, JaggedTensor], actions_T: torch.Tensor,
                timestamps_T: torch.Tensor, num_targets_B: torch.Tensor) -> torch.Tensor:
        """Logits [G] (fp32), sample by sample and in order within each. `embeddings`: the collection's
        output (sequence features: [T, E] with the same lengths; contextual: [B, E]); `actions_T`: int64
        bitmasks (1 listen_plus, 2 like, 4 skip; the targets' are never read); `timestamps_T`: int64
        seconds; `num_targets_B`: the last num_targets_B[b] positions of sample b are its targets (0: a
        padding sample, no logit)."""
        item_TE, artist_TE, album_TE = (embeddings[f].values() for f in SEQUENCE_FEATURES)
        lengths_B = embeddings["item_id"].lengths().long()
        B, T = lengths_B.numel(), item_TE.shape[0]
        contextual_BCE = torch.stack([self._contextual(embeddings, f, B) for f in CONTEXTUAL_FEATURES], dim=1)
        self._check_shapes(artist_TE, album_TE, actions_T, timestamps_T, num_targets_B, B, T)
        _, G = self._check_lengths(embeddings, lengths_B, num_targets_B)
        return self.logits(item_TE, artist_TE, album_TE, contextual_BCE, lengths_B, actions_T, timestamps_T,
                           num_targets_B, G)

    def logits(self, item_TE: torch.Tensor, artist_TE: torch.Tensor, album_TE: torch.Tensor,
               contextual_BCE: torch.Tensor, lengths_B: torch.Tensor, actions_T: torch.Tensor,
               timestamps_T: torch.Tensor, num_targets_B: torch.Tensor, G: int) -> torch.Tensor:
        """`forward`'s logits [G] from plain tensors already checked (`forward` checks them; a scoring
        artifact's caller does): the sequence features' rows, the contextual rows [B, C, E], int64 lengths
        and targets per sample, `G` their sum of targets (a host int; a traced size under torch.export)."""
        C = self.num_contextual
        B, T = lengths_B.numel(), item_TE.shape[0]
        dev = lengths_B.device
        arange_B = torch.arange(B, device=dev)

        offsets_B1 = F.pad(torch.cumsum(lengths_B, 0), (1, 0))
        seq_T = torch.repeat_interleave(arange_B, lengths_B, output_size=T)
        is_target_T = torch.arange(T, device=dev) - offsets_B1[seq_T] >= (lengths_B - num_targets_B)[seq_T]
        seq_TD, contextual_KD = self.preprocessor(item_TE, artist_TE, album_TE, actions_T, is_target_T,
                                                  contextual_BCE)

        # Each sample laid out [contextual, history, targets]; every token's source row in
        # cat([contextual (C * B rows, feature-major), sequence (T rows)]).
        full_len_B = lengths_B + C
        full_offsets_B1 = F.pad(torch.cumsum(full_len_B, 0), (1, 0))
        N = T + B * C
        arange_N = torch.arange(N, device=dev)
        seq_N = torch.repeat_interleave(arange_B, full_len_B, output_size=N)
        pos_N = arange_N - full_offsets_B1[seq_N]
        src_N = torch.where(pos_N < C, pos_N * B + seq_N, B * C + arange_N - C * (seq_N + 1))
        x_ND = torch.cat([contextual_KD, seq_TD]).index_select(0, src_N)  # cat promotes mixed dtypes
        # contextual tokens carry time 0, as in the reference (the last time bucket, for real clocks)
        timestamps_N = torch.cat([timestamps_T.new_zeros(B * C), timestamps_T]).index_select(0, src_N)
        # a sample's query time is its last position's; a padding sample (no positions) gets 0
        query_time_B = F.pad(timestamps_T, (1, 0))[torch.where(lengths_B > 0, offsets_B1[1:], 0)]
        position_N = positions(pos_N, full_len_B[seq_N], num_targets_B[seq_N], C)
        x_ND = self.positional(x_ND, position_N, timestamps_N, query_time_B[seq_N])
        x_ND = F.dropout(x_ND, p=self.input_dropout, training=self.training)
        # Scores are divided by the configured longest sequence, not the batch's (the reference's
        # padded length): a sample's output then does not depend on what else is in its batch, so the
        # numbers are the same whatever the world size, batch split or serving batch.
        for layer in self.layers:
            x_ND = layer(x_ND, full_offsets_B1, self.max_seq_len, num_targets_B, self.attention_contextual)

        # target g of sample b sits from_end_G[g] tokens before the end of b's sequence
        seq_G = torch.repeat_interleave(arange_B, num_targets_B, output_size=G)
        target_offsets_B1 = F.pad(torch.cumsum(num_targets_B, 0), (1, 0))
        from_end_G = num_targets_B[seq_G] - (torch.arange(G, device=dev) - target_offsets_B1[seq_G])
        user_GD = x_ND[full_offsets_B1[seq_G + 1] - from_end_G]
        at_G = offsets_B1[seq_G + 1] - from_end_G
        user_GD = self.postprocessor(user_GD, timestamps_T[at_G])
        item_GD = self.item_mlp(torch.cat([item_TE[at_G], artist_TE[at_G], album_TE[at_G]], dim=-1))
        return self.head(user_GD * item_GD.to(user_GD.dtype)).squeeze(-1).float()

    @staticmethod
    def _contextual(embeddings: Mapping[str, JaggedTensor], feature: str, B: int) -> torch.Tensor:
        values = embeddings[feature].values()
        if values.shape[0] != B:
            raise ValueError(f"contextual feature {feature} has {values.shape[0]} ids for {B} samples "
                             "(one per sample expected)")
        return values

    @staticmethod
    def _check_shapes(artist_TE: torch.Tensor, album_TE: torch.Tensor, actions_T: torch.Tensor,
                      timestamps_T: torch.Tensor, num_targets_B: torch.Tensor, B: int, T: int) -> None:
        for name, t, shape in (("artist_id", artist_TE, T), ("album_id", album_TE, T),
                               ("actions", actions_T, (T,)), ("timestamps", timestamps_T, (T,)),
                               ("num_targets", num_targets_B, (B,))):
            got = t.shape[0] if isinstance(shape, int) else tuple(t.shape)
            if got != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; the batch has {B} samples and "
                                 f"{T} sequence positions")

    def _check_lengths(self, embeddings: Mapping[str, JaggedTensor], lengths_B: torch.Tensor,
                       num_targets_B: torch.Tensor) -> tuple[int, int]:
        """(longest sequence, targets in all) read in one device sync, with the checks that need values."""
        if lengths_B.numel() == 0:
            raise ValueError("an empty batch (no samples)")
        mismatched = sum(((embeddings[f].lengths() != lengths_B).sum() for f in SEQUENCE_FEATURES[1:]),
                         torch.zeros((), dtype=torch.int64, device=lengths_B.device))
        longest, targets, fewest, too_many, mismatched = torch.stack(
            [lengths_B.max(), num_targets_B.sum(), num_targets_B.min(), (num_targets_B > lengths_B).sum(),
             mismatched]).tolist()
        if mismatched:
            raise ValueError("item_id, artist_id and album_id must have the same length in every sample")
        if fewest < 0 or too_many:
            raise ValueError("every sample needs between 0 (a padding sample) and its sequence length of "
                             "targets (num_targets)")
        if longest + self.num_contextual > self.max_seq_len:
            raise ValueError(f"a sequence of {longest} positions plus {self.num_contextual} contextual "
                             f"tokens exceeds max_seq_len={self.max_seq_len}")
        return longest, targets


class SequenceBatch(Protocol):
    """What `DLRMv4.forward` reads of a batch."""

    sparse_features: KeyedJaggedTensor  # SEQUENCE_FEATURES (lengths L_b) and CONTEXTUAL_FEATURES (1 each)
    actions: torch.Tensor  # int64 [T] action bitmask per position
    timestamps: torch.Tensor  # int64 [T] seconds
    num_targets: torch.Tensor  # int64 [B]: the last num_targets[b] positions of sample b are candidates
    labels: torch.Tensor  # float32 [G]: listen_plus of each candidate, in order


def masked_bce(logits_G: torch.Tensor, labels_G: torch.Tensor, scale: float) -> torch.Tensor:
    """`scale` x the mean BCE over the target positions (the only ones with a label; history positions are
    masked out), 0 for none: the reference's sum / max(count, 1) x 0.2."""
    losses_G = F.binary_cross_entropy_with_logits(logits_G.float(), labels_G.float(), reduction="none")
    return losses_G.sum() / max(labels_G.numel(), 1) * scale


class DLRMv4(nn.Module):
    """The embedding collection (the sparse arch torchrec shards) and HSTUDense, with the loss: takes a
    whole batch, returns (loss, (logits, labels)) as the trainer's pipelines expect."""

    def __init__(self, sparse: EmbeddingCollection, dense: HSTUDense, loss_scale: float) -> None:
        super().__init__()
        self.sparse_arch = sparse
        self.dense_arch = dense
        self.loss_scale = loss_scale

    def forward(self, batch: SequenceBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        embeddings = self.sparse_arch(batch.sparse_features)
        logits_G = self.dense_arch(embeddings, batch.actions, batch.timestamps, batch.num_targets)
        if logits_G.shape != batch.labels.shape:
            raise ValueError(f"labels have shape {tuple(batch.labels.shape)} for {logits_G.numel()} targets")
        loss = masked_bce(logits_G, batch.labels, self.loss_scale)
        return loss, (logits_G.detach(), batch.labels)


def build_dlrmv4(cfg: DLRMv4Config, device: torch.device, attention: HSTUAttention,
                 ec_device: torch.device | None = None) -> DLRMv4:
    """DLRMv4 for `cfg` with the backend's `attention`; tables on `ec_device` (meta: let
    DistributedModelParallel allocate the shards). Plan-invariant weights: `anyrec.models.init.init_model(
    model, table_configs(cfg), seed, "sparse_arch", collection="embeddings")`."""
    check_config(cfg)
    ec = EmbeddingCollection(table_configs(cfg), device=ec_device or device)
    with torch.device(device):
        dense = HSTUDense(cfg, attention)
    return DLRMv4(ec, dense, cfg.loss_scale)


@dataclass(frozen=True)
class DLRMv4Flops:
    """Forward + backward FLOP of one sample, by part. `stu` is the part the reference counts."""

    attention: float
    uvqk: float
    output: float
    other: float  # preprocessor, contextual projections, postprocessor, item MLP, head

    @property
    def stu(self) -> float:
        return self.attention + self.uvqk + self.output

    @property
    def total(self) -> float:
        return self.stu + self.other


def dlrmv4_flops_per_sample(cfg: DLRMv4Config, seq_len: int, num_targets: int = 1) -> DLRMv4Flops:
    """FLOP of one sample of `seq_len` tokens through the STU stack (contextual ones included), the
    reference's convention: 2 FLOP per multiply-add; a matmul's backward twice its forward (3x in all);
    the attention over half the S x S scores (causal) for QK^T and AV, its backward 2.5x its forward
    (it recomputes the scores, FlashAttention's count: 3.5x in all). Elementwise work is not counted."""
    S, L, D, H, E = seq_len, cfg.num_layers, cfg.model_dim, cfg.num_heads, cfg.table_dim
    C = len(CONTEXTUAL_FEATURES)
    matmul = 2 * 3  # FLOP per MAC, forward + backward
    uvqk = L * matmul * S * D * 2 * H * (cfg.qk_dim + cfg.v_dim)
    output = L * matmul * S * 3 * H * cfg.v_dim * D
    attention = L * 2 * 3.5 * (S * S / 2) * H * (cfg.qk_dim + cfg.v_dim)
    hidden = cfg.preprocessor_hidden_dim
    actions = len(ACTION_BITS) * cfg.action_dim
    per_position = (E + 2 * E + actions) * hidden + 3 * hidden * D  # content, artist+album, action MLPs
    per_target = ((D + 4) * D + len(SEQUENCE_FEATURES) * E * cfg.item_hidden_dim + cfg.item_hidden_dim * D
                  + D * cfg.head_hidden_dim + cfg.head_hidden_dim)
    other = matmul * ((S - C) * per_position + C * E * D + num_targets * per_target)
    return DLRMv4Flops(attention=float(attention), uvqk=float(uvqk), output=float(output), other=float(other))
