"""The STU layer (HSTU's sequential transduction unit) over jagged sequences, and the layers it is built from.

The attention is handed in (`HSTUAttention`): the backend picks its implementation, the layer never does.

Legend: N tokens of all sequences together (jagged), B sequences, D model dim, H heads, A query/key dim per
head, V value (and U) dim per head.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from anyrec.models.recompute import recompute_saved, recomputed

# The reference's epsilon for the STU's two layer norms (its other layer norms use torch's 1e-5).
STU_NORM_EPS = 1e-6


class HSTUAttention(Protocol):
    """Jagged pointwise attention: out_NHV[i] = sum_j mask(i, j) * silu(q_i . k_j / sqrt(A)) / max_len * v_j
    within each sequence. The mask is causal and target-aware (the last `num_targets_B[b]` tokens of
    sequence b see the history and themselves, not one another; history never sees them); with
    `num_contextual` > 0 the first that many tokens of each sequence also see its whole history.
    `offsets_B1`: int64 [B + 1] token offsets; `max_len`: the longest sequence of the batch."""

    def __call__(self, q_NHA: torch.Tensor, k_NHA: torch.Tensor, v_NHV: torch.Tensor,
                 offsets_B1: torch.Tensor, max_len: int, num_heads: int, num_targets_B: torch.Tensor | None,
                 num_contextual: int) -> torch.Tensor: ...


class XavierLinear(nn.Linear):
    """nn.Linear drawn as the reference draws its MLPs: Xavier-uniform weight, zero bias."""

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class XavierNormalLinear(nn.Linear):
    """nn.Linear with a Xavier-normal weight and zero bias (the reference's pre/post-processor layers)."""

    def reset_parameters(self) -> None:
        nn.init.xavier_normal_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class SwishLayerNorm(nn.Module):
    """x * sigmoid(layer_norm(x)), the norm in fp32 (the reference's SwishLayerNorm)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = F.layer_norm(x32, (x32.shape[-1],), self.weight.float(), self.bias.float(), self.eps)
        return (x32 * torch.sigmoid(normed)).to(x.dtype)


def norm_mlp(in_features: int, hidden: int, out_features: int, normal_init: bool) -> nn.Sequential:
    """Linear -> SwishLayerNorm -> Linear -> LayerNorm, the reference's small MLP (preprocessor, item tower);
    `normal_init`: Xavier-normal weights (the preprocessor's) rather than Xavier-uniform."""
    linear = XavierNormalLinear if normal_init else XavierLinear
    return nn.Sequential(linear(in_features, hidden), SwishLayerNorm(hidden), linear(hidden, out_features),
                         nn.LayerNorm(out_features))


class STULayer(nn.Module):
    """One STU: layer norm, one UVQK projection (SiLU on U), jagged pointwise attention, then an output
    projection of [U, attention, U * layer_norm(attention)] (dropout first) added to the input.
    `selective_recompute`: the backward keeps the layer's input, U and the attention output only and
    recomputes the input norm, the UVQK projection (the attention's q, k, v) and the output GEMM's input,
    its dropout mask drawn again from the forward's generator states (`anyrec.models.recompute`), as the
    MLPerf reference's STU does; the numbers are the same either way."""

    def __init__(self, dim: int, num_heads: int, qk_dim: int, v_dim: int, dropout: float,
                 attention: HSTUAttention, selective_recompute: bool) -> None:
        super().__init__()
        self.dim, self.num_heads, self.qk_dim, self.v_dim = dim, num_heads, qk_dim, v_dim
        self.dropout = dropout
        self.selective_recompute = selective_recompute
        self.attention = attention
        uvqk = 2 * num_heads * (v_dim + qk_dim)
        self.uvqk_weight = nn.Parameter(torch.empty(dim, uvqk))
        self.uvqk_bias = nn.Parameter(torch.empty(uvqk))
        self.input_norm_weight = nn.Parameter(torch.empty(dim))
        self.input_norm_bias = nn.Parameter(torch.empty(dim))
        self.output_weight = nn.Parameter(torch.empty(3 * num_heads * v_dim, dim))
        self.output_norm_weight = nn.Parameter(torch.empty(num_heads * v_dim))
        self.output_norm_bias = nn.Parameter(torch.empty(num_heads * v_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.uvqk_weight)
        nn.init.zeros_(self.uvqk_bias)
        nn.init.ones_(self.input_norm_weight)
        nn.init.zeros_(self.input_norm_bias)
        nn.init.xavier_uniform_(self.output_weight)
        nn.init.ones_(self.output_norm_weight)
        nn.init.zeros_(self.output_norm_bias)

    def forward(self, x_ND: torch.Tensor, offsets_B1: torch.Tensor, max_len: int,
                num_targets_B: torch.Tensor, num_contextual: int) -> torch.Tensor:
        if self.selective_recompute and torch.is_grad_enabled():
            return self._forward_recomputing(x_ND, offsets_B1, max_len, num_targets_B, num_contextual)
        uvqk = self._uvqk(x_ND, self.input_norm_weight, self.input_norm_bias, self.uvqk_weight,
                          self.uvqk_bias)
        u_NU, attn_NU = self._attend(uvqk, offsets_B1, max_len, num_targets_B, num_contextual)
        y_N3U = self._gated(u_NU, attn_NU, self.output_norm_weight, self.output_norm_bias, x_ND.dtype,
                            self.training)
        return torch.addmm(x_ND, y_N3U, self.output_weight.to(x_ND.dtype))

    def _forward_recomputing(self, x_ND: torch.Tensor, offsets_B1: torch.Tensor, max_len: int,
                             num_targets_B: torch.Tensor, num_contextual: int) -> torch.Tensor:
        """The forward's numbers, keeping for the backward the input, U and the attention output only."""
        uvqk = recomputed(self._uvqk, x_ND, self.input_norm_weight, self.input_norm_bias, self.uvqk_weight,
                          self.uvqk_bias)
        with recompute_saved(uvqk):  # SiLU's input and the attention's q, k, v: views of uvqk
            u_NU, attn_NU = self._attend(uvqk, offsets_B1, max_len, num_targets_B, num_contextual)
        del uvqk
        # y in the output GEMM's dtype (autocast's where it is on, which would cast it to that): the GEMM then
        # saves y itself, a note, rather than a cast copy
        device = x_ND.device.type
        mm_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_ND.dtype
        gated = functools.partial(self._gated, dtype=mm_dtype, training=self.training)
        y_N3U = recomputed(gated, u_NU, attn_NU, self.output_norm_weight, self.output_norm_bias,
                           random=self.training and self.dropout > 0)
        with recompute_saved(y_N3U):
            return torch.addmm(x_ND, y_N3U, self.output_weight.to(x_ND.dtype))

    def _uvqk(self, x_ND: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor,
              weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """The UVQK projection of the normed input [N, 2 H (V + A)]."""
        normed_ND = F.layer_norm(x_ND, (self.dim,), norm_weight, norm_bias, STU_NORM_EPS)
        return torch.addmm(bias.to(normed_ND.dtype), normed_ND, weight.to(normed_ND.dtype))

    def _attend(self, uvqk: torch.Tensor, offsets_B1: torch.Tensor, max_len: int, num_targets_B: torch.Tensor,
                num_contextual: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(silu(U) [N, H V], the attention output [N, H V])."""
        H, A, V = self.num_heads, self.qk_dim, self.v_dim
        u, v, q, k = torch.split(uvqk, [H * V, H * V, H * A, H * A], dim=1)
        u_NU = F.silu(u)
        attn_NHV = self.attention(q.reshape(-1, H, A), k.reshape(-1, H, A), v.reshape(-1, H, V), offsets_B1,
                                  max_len, H, num_targets_B, num_contextual)
        return u_NU, attn_NHV.reshape(-1, H * V)

    def _gated(self, u_NU: torch.Tensor, attn_NU: torch.Tensor, norm_weight: torch.Tensor,
               norm_bias: torch.Tensor, dtype: torch.dtype, training: bool) -> torch.Tensor:
        """The output GEMM's input [U, attention, U * layer_norm(attention)] after dropout (`training`), in
        `dtype`."""
        # the gating in fp32, as the reference computes it
        u32, attn32 = u_NU.float(), attn_NU.float()
        normed = F.layer_norm(attn32, (u32.shape[-1],), norm_weight.float(), norm_bias.float(), STU_NORM_EPS)
        gated = u32 * normed
        y_N3U = F.dropout(torch.cat([u32, attn32, gated], dim=1), p=self.dropout, training=training)
        return y_N3U.to(dtype)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.num_heads}, qk_dim={self.qk_dim}, v_dim={self.v_dim}, "
                f"dropout={self.dropout}, selective_recompute={self.selective_recompute}")
