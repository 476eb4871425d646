"""Optimizers by name: the fused embedding optimizer (in backward) and the dense one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torchrec.optim import RowWiseAdagrad

from anyrec.config import OptimConfig

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


def _check(cfg: OptimConfig) -> None:
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if cfg.embedding_lr <= 0 or cfg.dense_lr <= 0:
        raise ValueError(f"learning rates must be > 0, got embedding_lr={cfg.embedding_lr}, "
                         f"dense_lr={cfg.dense_lr}")


def embedding_optimizer(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Optimizer class and kwargs for `apply_optimizer_in_backward` (torchrec maps them to TBE)."""
    _check(cfg)
    lr = cfg.embedding_lr
    if cfg.name == "sgd":
        return torch.optim.SGD, {"lr": lr}
    if cfg.name == "adagrad":
        return torch.optim.Adagrad, {"lr": lr, "eps": cfg.eps}
    if cfg.name == "rowwise_adagrad":
        return RowWiseAdagrad, {"lr": lr, "eps": cfg.eps}
    return torch.optim.Adam, {"lr": lr, "eps": cfg.eps, "betas": tuple(cfg.betas)}


def dense_optimizer(cfg: OptimConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of the MLPs and interaction (row-wise Adagrad means plain Adagrad here)."""
    _check(cfg)
    params = list(params)
    lr = cfg.dense_lr
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=cfg.weight_decay)
    if cfg.name in ("adagrad", "rowwise_adagrad"):
        return torch.optim.Adagrad(params, lr=lr, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=lr, eps=cfg.eps, betas=tuple(cfg.betas),
                            weight_decay=cfg.weight_decay)
