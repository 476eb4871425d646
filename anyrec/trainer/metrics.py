"""Evaluation metrics synced over ranks (torchmetrics all-gathers the states at `compute()`), computed
as torchrec's `RecMetric`s compute them, without their `RecMetricModule` task machinery.

- AUC: torchmetrics' exact `BinaryAUROC`, and 0.5 (torchrec's no-signal value) when the eval set
  holds one class only or nothing (torchmetrics would give 0.0).
- Accuracy: a prediction counts positive when its fp32 probability is >= 0.5, as in torchrec's
  `compute_accuracy_sum` (torchmetrics' `BinaryAccuracy` uses > 0.5).
- Normalized entropy and log loss: torchrec's NE states (`cross_entropy_sum` in bits, sample and
  label counts) and `compute_ne`; log loss in nats like the train loss.

Deliberate differences from torchrec: cross entropy is taken from the logits in fp64 (softplus form),
not from probabilities clamped to [1e-12, 1 - 1e-12]: no saturation for logits past ~16.6 (where fp32
sigmoid reaches 1.0) and no cap at ~39.9 bits per sample (within the clamp range the two agree to
rounding). AUC counts each tied (positive, negative) pair as half (the exact AUROC); torchrec's
trapezoid over an argsort depends on the order the sort leaves ties in.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC
from torchrec.metrics.ne import compute_ne

_ETA = 1e-12  # torchrec's clamp for counts
_NO_SIGNAL_AUC = 0.5  # torchrec's AUC when there are no (positive, negative) pairs
THRESHOLD = 0.5  # probability at and above which a prediction is positive (torchrec's default)


class NormalizedEntropy(Metric):
    """Cross entropy relative to that of always predicting the mean CTR; also the log loss."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        for name in ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels"):
            self.add_state(name, default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits_B: torch.Tensor, labels_B: torch.Tensor) -> None:
        labels_B = labels_B.double()
        # -y log p - (1-y) log(1-p) with p = sigmoid(x), computed stably from x; torchrec keeps bits
        ce_nats_B = F.binary_cross_entropy_with_logits(logits_B.double(), labels_B, reduction="none")
        self.cross_entropy_sum += ce_nats_B.sum() / math.log(2.0)
        self.weighted_num_samples += labels_B.numel()
        self.pos_labels += labels_B.sum()
        self.neg_labels += (1.0 - labels_B).sum()

    def compute(self) -> dict[str, torch.Tensor]:
        ne = compute_ne(self.cross_entropy_sum, self.weighted_num_samples, self.pos_labels,
                        self.neg_labels, _ETA)
        # torchrec's cross entropy is in bits; the log loss is reported in nats like the train loss.
        logloss = self.cross_entropy_sum * math.log(2.0) / self.weighted_num_samples.clamp(min=_ETA)
        return {"ne": ne, "logloss": logloss, "pos_labels": self.pos_labels.clone(),
                "neg_labels": self.neg_labels.clone()}


class ThresholdAccuracy(Metric):
    """Fraction of samples whose prediction (probability >= `THRESHOLD`) equals the label."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        for name in ("correct", "total"):
            self.add_state(name, default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, probs_B: torch.Tensor, labels_B: torch.Tensor) -> None:
        self.correct += ((probs_B >= THRESHOLD) == labels_B.bool()).sum()
        self.total += labels_B.numel()

    def compute(self) -> torch.Tensor:
        return self.correct / self.total.clamp(min=_ETA)


class EvalMetrics:
    """AUC, accuracy, normalized entropy and log loss over everything seen on every rank."""

    def __init__(self, device: torch.device) -> None:
        self._auc = BinaryAUROC().to(device)
        self._acc = ThresholdAccuracy().to(device)
        self._ne = NormalizedEntropy().to(device)

    def update(self, logits_B: torch.Tensor, labels_B: torch.Tensor) -> None:
        probs_B = torch.sigmoid(logits_B.float())
        self._auc.update(probs_B, labels_B.long())
        self._acc.update(probs_B, labels_B)
        self._ne.update(logits_B, labels_B)

    def compute(self) -> dict[str, float]:
        ne = self._ne.compute()
        # label counts summed over ranks (inside compute): every rank takes the same branch
        one_class = float(ne["pos_labels"]) == 0 or float(ne["neg_labels"]) == 0
        auc = _NO_SIGNAL_AUC if one_class else float(self._auc.compute())
        return {"auc": auc, "accuracy": float(self._acc.compute()),
                "ne": float(ne["ne"]), "logloss": float(ne["logloss"])}
