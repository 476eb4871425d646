"""Metrics synced over ranks, built on torchmetrics."""

from __future__ import annotations

import torch
from torchmetrics.classification import BinaryAUROC


class AUC:
    """ROC AUC over everything seen on every rank."""

    def __init__(self, device: torch.device) -> None:
        self._metric = BinaryAUROC().to(device)

    def update(self, probs_B: torch.Tensor, labels_B: torch.Tensor) -> None:
        self._metric.update(probs_B, labels_B.long())

    def compute(self) -> float:
        return float(self._metric.compute())
