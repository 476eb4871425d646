"""DLRMv4's layers around the STU stack: the contextual preprocessor (content, actions, contextual tokens),
the positional encoder, and the timestamp layer-norm postprocessor, each as the MLPerf reference builds it.

Legend: T sequence positions of all samples (history then targets, jagged), B samples, C contextual
tokens per sample, N = T + B * C tokens, E table dim, D model dim, G targets of all samples.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from anyrec.models.stu import SwishLayerNorm, XavierLinear, XavierNormalLinear, norm_mlp

# The action bits of a position (1 listen_plus, 2 like, 4 skip), one embedding each.
ACTION_BITS = (1, 2, 4)
SECONDS_PER_HOUR = 3600
SECONDS_PER_DAY = 86400


class ActionEncoder(nn.Module):
    """Each history position's action bits as [T, bits * dim]: the embedding of every bit that is set,
    zeros for the others; every target position gets one learnt vector instead (its action is the label)."""

    def __init__(self, dim: int, init_std: float = 0.1) -> None:
        super().__init__()
        self.dim = dim
        self.init_std = init_std
        self.register_buffer("bits", torch.tensor(ACTION_BITS, dtype=torch.int64), persistent=False)
        self.action_table = nn.Parameter(torch.empty(len(ACTION_BITS), dim))
        self.target_action = nn.Parameter(torch.empty(1, len(ACTION_BITS) * dim))
        self.reset_parameters()

    @property
    def out_features(self) -> int:
        return len(ACTION_BITS) * self.dim

    def reset_parameters(self) -> None:
        nn.init.normal_(self.action_table, std=self.init_std)
        nn.init.normal_(self.target_action, std=self.init_std)

    def forward(self, actions_T: torch.Tensor, is_target_T: torch.Tensor) -> torch.Tensor:
        set_TK = torch.bitwise_and(actions_T.unsqueeze(-1), self.bits) > 0
        emb_TA = (set_TK.unsqueeze(-1) * self.action_table).flatten(1)
        return torch.where(is_target_T.unsqueeze(-1), self.target_action, emb_TA)


class ContextualPreprocessor(nn.Module):
    """Sequence tokens from the item embedding (content MLP), the artist and album embeddings (a second MLP,
    added) and the action bits (action MLP, added); contextual tokens from one linear map per contextual
    feature, E -> D."""

    def __init__(self, table_dim: int, hidden_dim: int, model_dim: int, action_dim: int,
                 num_contextual: int) -> None:
        super().__init__()
        self.num_contextual = num_contextual
        self.content_mlp = norm_mlp(table_dim, hidden_dim, model_dim, normal_init=True)
        self.extra_mlp = norm_mlp(2 * table_dim, hidden_dim, model_dim, normal_init=True)
        self.action_encoder = ActionEncoder(action_dim)
        self.action_mlp = norm_mlp(self.action_encoder.out_features, hidden_dim, model_dim, normal_init=True)
        self.contextual = ContextualProjection(num_contextual, table_dim, model_dim)

    def forward(self, item_TE: torch.Tensor, artist_TE: torch.Tensor, album_TE: torch.Tensor,
                actions_T: torch.Tensor, is_target_T: torch.Tensor,
                contextual_BCE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence tokens [T, D], contextual tokens [C * B, D], row c * B + b for feature c of sample b:
        the projection's own layout, flattened as a view whatever B, which torch.export traces for any
        batch of a scoring artifact, where a transposed copy's would assume B > 1)."""
        seq_TD = self.content_mlp(item_TE) + self.extra_mlp(torch.cat([artist_TE, album_TE], dim=-1))
        seq_TD = seq_TD + self.action_mlp(self.action_encoder(actions_T, is_target_T))
        return seq_TD, self.contextual(contextual_BCE).flatten(0, 1)


class ContextualProjection(nn.Module):
    """One affine map E -> D per contextual feature (the reference's batched contextual linear): [B, C, E]
    in, [C, B, D] out."""

    def __init__(self, num_features: int, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_features, in_dim, out_dim))
        self.bias = nn.Parameter(torch.empty(num_features, out_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        in_dim, out_dim = self.weight.shape[1:]
        nn.init.normal_(self.weight, std=math.sqrt(2.0 / (in_dim + out_dim)))
        nn.init.zeros_(self.bias)

    def forward(self, x_BCE: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias.unsqueeze(1), x_BCE.transpose(0, 1), self.weight)


class PositionalEncoder(nn.Module):
    """x * sqrt(D) + a position embedding + a time embedding. Positions count back from the newest
    history event (targets share one position), after the contextual tokens' own positions 0..C-1; the
    time bucket of a token is floor(sqrt((query time - its time) / 60 s)), the query time being its
    sequence's last timestamp, capped at `time_buckets`."""

    def __init__(self, position_buckets: int, time_buckets: int, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.time_buckets = time_buckets
        self.position_table = nn.Parameter(torch.empty(position_buckets, dim))
        self.time_table = nn.Parameter(torch.empty(time_buckets + 1, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        p_bound = math.sqrt(1.0 / self.position_table.shape[0])
        t_bound = math.sqrt(1.0 / self.time_buckets)
        nn.init.uniform_(self.position_table, -p_bound, p_bound)
        nn.init.uniform_(self.time_table, -t_bound, t_bound)

    def forward(self, x_ND: torch.Tensor, position_N: torch.Tensor, timestamps_N: torch.Tensor,
                query_time_N: torch.Tensor) -> torch.Tensor:
        position_N = position_N.clamp(max=self.position_table.shape[0] - 1)
        # fp32 (any device has it): exact for differences under 2^24 s (194 days), within 16 s up to 8 years
        minutes_N = (query_time_N - timestamps_N).float().clamp(min=1e-6) / 60.0
        bucket_N = torch.sqrt(minutes_N).long().clamp(0, self.time_buckets)
        added_ND = self.time_table[bucket_N] + self.position_table[position_N]
        return x_ND * math.sqrt(self.dim) + added_ND.to(x_ND.dtype)


def positions(pos_in_seq_N: torch.Tensor, seq_len_N: torch.Tensor, num_targets_N: torch.Tensor,
              num_contextual: int) -> torch.Tensor:
    """Position ids of the tokens of sequences laid out [contextual, history, targets] (`seq_len_N`: the
    whole length of each token's sequence, contextual tokens included): contextual token c -> c; a history
    token -> C + its distance from the end of the history; every target -> C (the reference's rule)."""
    high_N = seq_len_N - num_targets_N
    pos_N = high_N - torch.minimum(pos_in_seq_N, high_N) + num_contextual
    return torch.where(pos_in_seq_N < num_contextual, pos_in_seq_N, pos_N)


class TimestampLayerNormPostprocessor(nn.Module):
    """The user vector at a target with its time of day and day of week (cos, sin of each), through
    Linear(D + 4, D) and a LayerNorm."""

    # (seconds per unit, units per period): hour of day, day of week
    PERIODS = ((SECONDS_PER_HOUR, 24), (SECONDS_PER_DAY, 7))

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.combine = XavierNormalLinear(dim + 2 * len(self.PERIODS), dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, user_GD: torch.Tensor, timestamps_G: torch.Tensor) -> torch.Tensor:
        angles = []
        for unit_s, per_period in self.PERIODS:
            units = torch.remainder(torch.div(timestamps_G, unit_s, rounding_mode="floor"), per_period)
            angles.append(units.float() * (2 * math.pi / per_period))
        angle_GP = torch.stack(angles, dim=-1)
        # [cos, sin] per period, in the periods' order
        time_GF = torch.stack([torch.cos(angle_GP), torch.sin(angle_GP)], dim=-1).flatten(1)
        return self.norm(self.combine(torch.cat([user_GD, time_GF.to(user_GD.dtype)], dim=-1)))


def swish_head(dim: int, hidden: int) -> nn.Sequential:
    """The reference's prediction head: Linear(D, hidden), SwishLayerNorm, Linear(hidden, 1)."""
    return nn.Sequential(XavierLinear(dim, hidden), SwishLayerNorm(hidden), XavierLinear(hidden, 1))

