"""Optimizers by name: the fused embedding optimizer (in backward) and the dense one; and the
learning-rate schedule of MLPerf DLRM (linear warmup, a plateau, then polynomial decay), set on every
optimizer's param groups each step: torchrec hands the fused embedding one's to the TBE kernels
(`set_learning_rate`) at `zero_grad` and `step`, i.e. before the backward that updates the rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec import optim as trec_optim
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from anyrec.backends.dispatch import Impl, implementations
from anyrec.config import OptimConfig
from anyrec.kernels.optimizers import OptimizerConfig, OptimizerKind
from anyrec.kernels.replicated import ReplicatedTableOptimizer
from anyrec.planner.job import quiet_dense_tbe_warning

OPTIMIZERS = tuple(k.value for k in OptimizerKind)  # the fused update rules name the optimizers


def _check(cfg: OptimConfig) -> None:
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if len(cfg.betas) != 2:
        raise ValueError(f"optim.betas needs two values (beta1, beta2), got {list(cfg.betas)}")


def embedding_optimizer_config(cfg: OptimConfig) -> OptimizerConfig:
    """The fused embedding update the config asks for (anyrec's TBE takes it as is;
    `embedding_optimizer` turns it into torchrec's terms)."""
    _check(cfg)
    return OptimizerConfig(kind=cfg.name, lr=cfg.embedding_lr, eps=cfg.eps, beta1=cfg.betas[0],
                           beta2=cfg.betas[1], weight_decay=cfg.weight_decay)


def embedding_optimizer(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Optimizer class and kwargs for `apply_optimizer_in_backward` (torchrec maps them to TBE).
    `weight_decay` is L2 (added to the row gradient), which FBGEMM's fused SGD / Adagrad do not apply:
    `check_embedding_weight_decay` refuses that combination."""
    opt = embedding_optimizer_config(cfg)
    kwargs: dict[str, Any] = {"lr": opt.lr}
    if opt.weight_decay > 0:
        kwargs["weight_decay"] = opt.weight_decay
    if opt.kind == OptimizerKind.SGD:
        return trec_optim.SGD, kwargs
    kwargs["eps"] = opt.eps
    if opt.kind == OptimizerKind.ADAGRAD:
        return trec_optim.Adagrad, kwargs
    if opt.kind == OptimizerKind.ROWWISE_ADAGRAD:
        return RowWiseAdagrad, kwargs
    return trec_optim.Adam, {**kwargs, "betas": (opt.beta1, opt.beta2)}


def check_embedding_optimizer(cfg: OptimConfig, embedding: Impl, device_type: str, plan: Any) -> None:
    """An embedding implementation without a fused kernel for `cfg.name` on this device (FBGEMM's CPU
    TBE has no Adam): one line, unless the plan replicates every table (those train with anyrec's
    replicated-table optimizer). `plan` is torchrec's ShardingPlan."""
    reason = embedding.fused_update_reason(cfg.name, device_type)
    if reason is None:
        return
    fused = sorted({ps.sharding_type for module in plan.plan.values() for ps in module.values()}
                   - {"data_parallel"})
    if not fused:  # every table replicated: run by FBGEMM's dense TBE, whose torch warning is benign
        quiet_dense_tbe_warning()
        return
    able = ", ".join(i.name for i in implementations("embedding")
                     if i.fused_update_reason(cfg.name, device_type) is None)
    raise ValueError(f"optim={cfg.name}: {reason} (the plan shards tables as {', '.join(fused)}); use "
                     f"backend.embedding_kernel= one of {able}, planner.sharding=data_parallel, or "
                     f"optim= one of {', '.join(embedding.cpu_optimizers or ())}")


def apply_embedding_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> None:
    """`apply_optimizer_in_backward` with `embedding_optimizer(cfg)`, its kwargs named as the TBEs read them:
    torchrec hands them to the sharded TBE unchanged, and both FBGEMM and anyrec's TBE name Adam's betas
    `beta1` / `beta2` (torch's `betas` is a TypeError in FBGEMM and was ignored by anyrec's TBE)."""
    params = list(params)
    opt_cls, kwargs = embedding_optimizer(cfg)
    apply_optimizer_in_backward(opt_cls, params, kwargs)  # builds each optimizer with `betas`
    for p in params:
        for stored in p._optimizer_kwargs:  # what torchrec's sharders read as fused params
            if "betas" in stored:
                stored["beta1"], stored["beta2"] = stored.pop("betas")


def dense_optimizer(cfg: OptimConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of the dense part (`optim.dense_name`, else `optim.name`; row-wise Adagrad means plain
    Adagrad here)."""
    _check(cfg)
    params, lr, name = list(params), cfg.dense_lr, cfg.dense_name or cfg.name
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=cfg.weight_decay)
    if name in ("adagrad", "rowwise_adagrad"):
        return torch.optim.Adagrad(params, lr=lr, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=lr, eps=cfg.eps, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


def check_embedding_weight_decay(cfg: OptimConfig, embedding: Impl) -> None:
    """Refuse weight decay with an embedding implementation whose fused update ignores it (FBGEMM's)."""
    if cfg.weight_decay > 0 and not embedding.fused_weight_decay:
        able = ", ".join(i.name for i in implementations("embedding") if i.fused_weight_decay)
        raise ValueError(f"optim.weight_decay={cfg.weight_decay} is not applied by the {embedding.name} "
                         f"embedding implementation's fused update; use backend.embedding_kernel= one "
                         f"of {able}, or optim.weight_decay=0")


class Optimizers:
    """A model's dense (MLPs, interaction), fused embedding (rows update inside the backward) and, where
    the plan replicates tables, replicated-table optimizers; the pipeline and checkpoint see `combined`."""

    def __init__(self, model: nn.Module, fused: KeyedOptimizer, cfg: OptimConfig, ebc_path: str) -> None:
        self.cfg = cfg
        # torchrec marks the empty placeholders of tables on other ranks as optimised in the backward,
        # but moving a module to a device torch cannot shallow-copy CPU tensors into (any PrivateUse1
        # device) gives it new Parameters without the mark: skip the placeholders by size too.
        params = {n: p for n, p in in_backward_optimizer_filter(model.named_parameters())
                  if not (n.startswith(f"{ebc_path}.") and p.numel() == 0)}
        # replicated (data-parallel) tables train by the embedding rule and lr, like sharded ones
        tables = {n: p for n, p in params.items() if n.startswith(f"{ebc_path}.")}
        dense = {n: p for n, p in params.items() if n not in tables}
        self.dense_params = list(dense.values())
        self.dense = KeyedOptimizerWrapper(dense, lambda ps: dense_optimizer(cfg, ps))
        named: list[tuple[str, KeyedOptimizer]] = [("dense", self.dense), ("sparse", fused)]
        if tables:
            rule = embedding_optimizer_config(cfg)
            replicated = KeyedOptimizerWrapper(tables, lambda ps: ReplicatedTableOptimizer(ps, rule))
            named.append(("replicated", replicated))
        self.combined = CombinedOptimizer(named)

    def set_lr(self, factor: float) -> None:
        """Every optimizer's learning rate: its base rate times the schedule's `factor`."""
        for name, optimizer in self.combined.optimizers:
            lr = (self.cfg.dense_lr if name == "dense" else self.cfg.embedding_lr) * factor
            for group in optimizer.param_groups:
                group["lr"] = lr

    def step(self) -> None:
        """The dense update (gradient clipped to `optim.grad_clip_norm` when set), then the others'."""
        if self.cfg.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.dense_params, self.cfg.grad_clip_norm)
        self.combined.step()


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
        if cfg.decay_steps and cfg.decay_start_step < cfg.warmup_steps:
            raise ValueError(f"optim.decay_start_step={cfg.decay_start_step} must not come before the "
                             f"end of warmup (optim.warmup_steps={cfg.warmup_steps})")
        return cls(cfg.warmup_steps, cfg.decay_start_step, cfg.decay_steps, cfg.decay_power,
                   cfg.end_lr_factor)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay_steps and step >= self.decay_start_step:
            t = min(1.0, (step - self.decay_start_step) / self.decay_steps)
            return self.end_lr_factor + (1.0 - self.end_lr_factor) * (1.0 - t) ** self.decay_power
        return 1.0
