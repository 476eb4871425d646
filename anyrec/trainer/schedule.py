"""The learning-rate schedule of MLPerf DLRM: linear warmup, a plateau, then polynomial decay.

Applied to every optimizer each step through its param groups; torchrec hands the fused embedding
one's to the TBE kernels (`set_learning_rate`) at `zero_grad` and `step`, i.e. before the backward
that updates the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from anyrec.config import OptimConfig


@dataclass(frozen=True)
class WarmupPolyDecay:
    """lr(step) = base x factor(step); `step` counts from 0 (the step about to run)."""

    warmup_steps: int = 0
    decay_start_step: int = 0
    decay_steps: int = 0
    decay_power: float = 2.0
    end_lr_factor: float = 0.0

    @classmethod
    def from_config(cls, cfg: OptimConfig) -> WarmupPolyDecay:
        if cfg.warmup_steps < 0 or cfg.decay_steps < 0 or cfg.decay_start_step < 0:
            raise ValueError("optim.warmup_steps, decay_start_step and decay_steps must be >= 0")
        if cfg.decay_steps and cfg.decay_start_step < cfg.warmup_steps:
            raise ValueError(f"optim.decay_start_step={cfg.decay_start_step} must not come before the "
                             f"end of warmup (optim.warmup_steps={cfg.warmup_steps})")
        if not 0.0 <= cfg.end_lr_factor <= 1.0:
            raise ValueError(f"optim.end_lr_factor must be in [0, 1], got {cfg.end_lr_factor}")
        return cls(cfg.warmup_steps, cfg.decay_start_step, cfg.decay_steps, cfg.decay_power,
                   cfg.end_lr_factor)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay_steps and step >= self.decay_start_step:
            t = min(1.0, (step - self.decay_start_step) / self.decay_steps)
            return self.end_lr_factor + (1.0 - self.end_lr_factor) * (1.0 - t) ** self.decay_power
        return 1.0


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every param group's learning rate."""
    for group in optimizer.param_groups:
        group["lr"] = lr
