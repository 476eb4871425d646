"""Optimizer settings for the fused embedding update, and the state footprint the planner charges.

The update is applied inside the embedding backward (no weight gradient is materialised). Semantics follow
FBGEMM's fused TBE optimizers, on every kernel (FBGEMM, anyrec's Triton and torch TBE, and the
replicated-table optimizer `anyrec.trainer.optim` builds for data-parallel tables):

  sgd              w -= lr * g
  rowwise_adagrad  m += mean_d(g^2) (one fp32 per row); w -= g * (lr / (sqrt(m) + eps))
  adagrad          m += g^2 (one fp32 per element);     w -= lr * g / (sqrt(m) + eps)
  adam             m1 = b1 m1 + (1-b1) g; m2 = b2 m2 + (1-b2) g^2 (fp32 per element, lazy: only rows
                   seen this step move); w -= lr * (m1_hat / (sqrt(m2_hat) + eps) + weight_decay * w)

where g is the row's gradient summed over every lookup of that row in the batch. Weight decay: for sgd /
adagrad / rowwise_adagrad it is L2, `weight_decay * w` added to g before the update (so it also feeds the
Adagrad accumulators); for adam it is decoupled (AdamW-style, scaled by lr, not in m1 / m2), which is
what FBGEMM's fused Adam does. Only rows looked up in the step decay.

Rounding follows FBGEMM's CPU kernels operation for operation (lr and eps are fp32, as FBGEMM takes
them), so anyrec's TBE and FBGEMM give the same bits from the same summed gradient:

  sgd      w = fma(g, -lr, w)                       (one rounding; FBGEMM's CUDA kernel fuses too)
  adagrad  m = fma(g, g, m);  w = fp32(w - fp32(lr * g) / (sqrt(m) + eps)), the subtraction, division,
           sqrt and eps sum in fp64 (FBGEMM's CPU kernel promotes there; its CUDA kernel stays in fp32,
           so FBGEMM itself differs from CPU to GPU by a rounding)
  rowwise  mean_d(g^2) summed in eight lanes as FBGEMM's AVX2 kernel does (`rowwise_mean_sq`); m += that;
           w -= g * (lr / (sqrt(m) + eps)) in fp32, one rounded division (`rowwise_step`). The state m
           then matches FBGEMM's bit for bit; the weights differ from FBGEMM's CPU kernel by one rounding
           on a few rows (the effective step differs by 1-3 units in the last place there; cause not found)

The functions below are that arithmetic on torch tensors; the Triton kernel spells the SGD and Adagrad
steps with `tl.fma` and fp64, and sums row-wise g^2 with `tl.sum` (a tree: the same as the lanes under
TRITON_INTERPRET for dims that are multiples of 8 up to 128, a rounding apart on GPUs).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class OptimizerKind(enum.StrEnum):
    """The fused update rules the embedding kernels implement."""

    SGD = "sgd"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAGRAD = "adagrad"
    ADAM = "adam"


# fp32 state elements each rule keeps: (per row, per element of the row)
_STATE_ELEMENTS: dict[OptimizerKind, tuple[int, int]] = {
    OptimizerKind.SGD: (0, 0),
    OptimizerKind.ROWWISE_ADAGRAD: (1, 0),
    OptimizerKind.ADAGRAD: (0, 1),
    OptimizerKind.ADAM: (0, 2),
}


@dataclass(frozen=True)
class OptimizerConfig:
    """One fused embedding optimizer: the rule and its hyperparameters (lr in weight units per step)."""

    kind: OptimizerKind = OptimizerKind.ROWWISE_ADAGRAD
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9  # adam only
    beta2: float = 0.999  # adam only
    weight_decay: float = 0.0  # L2 on the row gradient; decoupled for adam (see the module docstring)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", OptimizerKind(self.kind))
        except ValueError:
            kinds = ", ".join(k.value for k in OptimizerKind)
            raise ValueError(f"unknown embedding optimizer {self.kind!r}; expected one of {kinds}") from None
        if self.lr < 0 or self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"optimizer needs lr >= 0, eps > 0, weight_decay >= 0; got {self}")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ValueError(f"adam betas must lie in [0, 1); got {self.beta1}, {self.beta2}")


def state_bytes_per_row(kind: OptimizerKind | str, dim: int) -> int:
    """Bytes of optimizer state one row of `dim` elements carries (fp32, whatever the weights' dtype)."""
    per_row, per_elem = _STATE_ELEMENTS[OptimizerKind(kind)]
    return 4 * (per_row + per_elem * dim)


def zero_state(kind: OptimizerKind | str, rows: int, elements: int, device=None) -> dict[str, torch.Tensor]:
    """Zero fp32 state of `rows` rows holding `elements` weights, flat: `momentum1` (one value a row for
    row-wise Adagrad, a weight for Adagrad and Adam) and Adam's `momentum2`."""
    per_row, per_elem = _STATE_ELEMENTS[OptimizerKind(kind)]
    n = rows if per_row else elements
    return {f"momentum{i}": torch.zeros(n, dtype=torch.float32, device=device)
            for i in range(1, per_row + per_elem + 1)}


def f32(x: float) -> float:
    """`x` rounded to fp32 (how FBGEMM and the Triton kernels receive lr and eps)."""
    return float(torch.tensor(x, dtype=torch.float32))


def fma_f32(a: torch.Tensor, b: torch.Tensor | float, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once, as a fused multiply-add: the fp64 product of two fp32 values is exact;
    the fp64 sum is nudged to an odd last bit when it was inexact (its error comes from TwoSum), so the
    final rounding to fp32 is correct (53 >= 24 + 2 bits: no double-rounding error)."""
    p = a.double() * (b.double() if isinstance(b, torch.Tensor) else f32(b))
    cd = c.double()
    s = p + cd
    bv = s - p
    err = (p - (s - bv)) + (cd - bv)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(s.dtype)
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


def sgd_update(w: torch.Tensor, g: torch.Tensor, lr: float) -> torch.Tensor:
    """FBGEMM's SGD step on fp32 rows: fma(g, -lr, w)."""
    return fma_f32(g, -f32(lr), w)


def adagrad_update(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, lr: float, eps: float):
    """FBGEMM's CPU exact Adagrad step on fp32 elements: (new w, new m); see the module docstring."""
    m = fma_f32(g, g, m)
    q = g * f32(lr)  # fp32 * fp32 (torch rounds a Python scalar to the tensor's dtype)
    return (w.double() - q.double() / (m.double().sqrt() + f32(eps))).float(), m


def rowwise_mean_sq(g_UD: torch.Tensor) -> torch.Tensor:
    """mean_d(g^2) of each row [U], summed as FBGEMM's CPU row-wise Adagrad sums it: in eight lanes (AVX2
    width), lane j accumulates g_d^2 for d = j (mod 8) in order of d, each square rounded before the add;
    then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then / D."""
    u, d = g_UD.shape
    sq_UCL = torch.nn.functional.pad(g_UD * g_UD, (0, -d % 8)).view(u, (d + 7) // 8, 8)
    l_UL = sq_UCL[:, 0]  # the eight lanes
    for c in range(1, sq_UCL.shape[1]):
        l_UL = l_UL + sq_UCL[:, c]
    total_U = ((l_UL[:, 0] + l_UL[:, 1]) + (l_UL[:, 2] + l_UL[:, 3])) + (
        (l_UL[:, 4] + l_UL[:, 5]) + (l_UL[:, 6] + l_UL[:, 7]))
    return total_U / d


def rowwise_step(m_U: torch.Tensor, lr: float, eps: float) -> torch.Tensor:
    """lr / (sqrt(m) + eps) per row in fp32, one rounded division (a Python number divided by a tensor
    is reciprocal-then-multiply in torch: two roundings)."""
    return torch.full_like(m_U, f32(lr)) / (m_U.sqrt() + f32(eps))
