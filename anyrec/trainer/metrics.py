"""Evaluation metrics synced over ranks, built on torchmetrics (and torchrec's NE formulas).

AUC and accuracy are torchmetrics' `BinaryAUROC` / `BinaryAccuracy`. Normalized entropy and log
loss are a small torchmetrics `Metric` whose per-batch states come from
`torchrec.metrics.ne.get_ne_states` and whose result is `torchrec.metrics.ne.compute_ne`:
torchrec's own `NEMetric` needs its `RecMetricModule` task machinery, which a trainer with a
single task does not need. torchmetrics all-gathers the states over ranks at `compute()`.
"""

from __future__ import annotations

import math

import torch
from torchmetrics import Metric
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC
from torchrec.metrics.ne import compute_ne, get_ne_states

_ETA = 1e-12  # torchrec's clamp for probabilities and counts


class NormalizedEntropy(Metric):
    """Cross entropy relative to that of always predicting the mean CTR; also the log loss."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        for name in ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels"):
            self.add_state(name, default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, probs_B: torch.Tensor, labels_B: torch.Tensor) -> None:
        weights_B = torch.ones_like(probs_B, dtype=torch.float64)
        states = get_ne_states(labels_B.double(), probs_B.double(), weights_B, _ETA)
        for name, value in states.items():
            setattr(self, name, getattr(self, name) + value)

    def compute(self) -> dict[str, torch.Tensor]:
        ne = compute_ne(self.cross_entropy_sum, self.weighted_num_samples, self.pos_labels,
                        self.neg_labels, _ETA)
        # torchrec's cross entropy is in bits; the log loss is reported in nats like the train loss.
        logloss = self.cross_entropy_sum * math.log(2.0) / self.weighted_num_samples.clamp(min=_ETA)
        return {"ne": ne, "logloss": logloss}


class EvalMetrics:
    """AUC, accuracy, normalized entropy and log loss over everything seen on every rank."""

    def __init__(self, device: torch.device) -> None:
        self._auc = BinaryAUROC().to(device)
        self._acc = BinaryAccuracy().to(device)
        self._ne = NormalizedEntropy().to(device)

    def update(self, logits_B: torch.Tensor, labels_B: torch.Tensor) -> None:
        probs_B = torch.sigmoid(logits_B.float())
        labels_long_B = labels_B.long()
        self._auc.update(probs_B, labels_long_B)
        self._acc.update(probs_B, labels_long_B)
        self._ne.update(probs_B, labels_B)

    def compute(self) -> dict[str, float]:
        ne = self._ne.compute()
        return {"auc": float(self._auc.compute()), "accuracy": float(self._acc.compute()),
                "ne": float(ne["ne"]), "logloss": float(ne["logloss"])}
