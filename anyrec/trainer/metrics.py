"""Evaluation metrics over everything every rank of the job saw (the default process group's ranks),
computed as torchrec's `RecMetric`s compute them, without their `RecMetricModule` task machinery (and
without importing torchrec.metrics or torchmetrics: about 0.4 s of every rank's start-up).

- AUC: the exact AUROC (the Mann-Whitney statistic over the fp32 probabilities all ranks gathered, each
  tied (positive, negative) pair counted as half), and 0.5 (torchrec's no-signal value) when the eval set
  holds one class only or nothing.
- Accuracy: a prediction counts positive when its fp32 probability is >= 0.5, as in torchrec's
  `compute_accuracy_sum`.
- Normalized entropy and log loss: torchrec's NE states (`cross_entropy_sum` in bits, sample and
  label counts) and its `compute_ne`; log loss in nats like the train loss.

Deliberate differences from torchrec: cross entropy is taken from the logits in fp64 (softplus form),
not from probabilities clamped to [1e-12, 1 - 1e-12]: no saturation for logits past ~16.6 (where fp32
sigmoid reaches 1.0) and no cap at ~39.9 bits per sample (within the clamp range the two agree to
rounding). torchrec's AUC (a trapezoid over an argsort) depends on the order the sort leaves ties in.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.nn import functional as F

from anyrec.runtime.distributed import DistInfo, all_gather_list, padded

_ETA = 1e-12  # torchrec's clamp for counts
_NO_SIGNAL_AUC = 0.5  # torchrec's AUC when there are no (positive, negative) pairs
THRESHOLD = 0.5  # probability at and above which a prediction is positive (torchrec's default)
# the summed states: cross entropy (bits), samples, positive and negative labels, correct predictions
_SUMS = ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels", "correct")


def compute_ne(ce_sum: torch.Tensor, weighted_num_samples: torch.Tensor, pos_labels: torch.Tensor,
               neg_labels: torch.Tensor, eta: float) -> torch.Tensor:
    """torchrec.metrics.ne.compute_ne: the cross entropy over that of always predicting the mean label."""
    mean_label = pos_labels / weighted_num_samples.double().clamp(min=eta)
    mean_label = mean_label.double().clamp(min=eta, max=1 - eta)
    return ce_sum / (-pos_labels * torch.log2(mean_label) - neg_labels * torch.log2(1.0 - mean_label))


def exact_auc(probs_N: torch.Tensor, labels_N: torch.Tensor) -> float:
    """The fraction of (positive, negative) pairs the scores order correctly, a tie counting half: from
    the positives' rank sum, ties given their average rank (fp64); the no-signal 0.5 where a class is
    missing (a label between 0 and 1 counts as its integer part, as torchmetrics' did)."""
    _, inverse_N, counts_U = torch.unique(probs_N, sorted=True, return_inverse=True, return_counts=True)
    ends_U = counts_U.double().cumsum(0)
    mean_rank_U = ends_U - (counts_U.double() - 1) / 2  # 1-based ranks of a tie group, averaged
    positive_N = labels_N.bool()
    n_pos = float(positive_N.sum())
    n_neg = probs_N.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return _NO_SIGNAL_AUC
    rank_sum = float(mean_rank_U[inverse_N][positive_N].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def _gathered(x_N: torch.Tensor, world: int) -> torch.Tensor:
    """Every one of the `world` ranks' `x_N` (lengths may differ), concatenated in rank order."""
    sizes = [int(n) for n in all_gather_list(torch.tensor([x_N.numel()], device=x_N.device), None, world)]
    parts = all_gather_list(padded(x_N, max(sizes)), None, world)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


class EvalMetrics:
    """AUC, accuracy, normalized entropy and log loss over everything seen on every rank of `info`'s job
    (one process: this one's alone)."""

    def __init__(self, device: torch.device, info: DistInfo) -> None:
        self._world = info.world_size
        self._sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=device)
        self._probs: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []

    def update(self, logits_B: torch.Tensor, labels_B: torch.Tensor) -> None:
        probs_B = torch.sigmoid(logits_B.float())
        labels_B = labels_B.double()
        # -y log p - (1-y) log(1-p) with p = sigmoid(x), computed stably from x; torchrec keeps bits
        ce_nats_B = F.binary_cross_entropy_with_logits(logits_B.double(), labels_B, reduction="none")
        correct = ((probs_B >= THRESHOLD) == labels_B.bool()).sum()
        # every term made on the device (new_full fills a scalar: no host copy that waits for the device)
        self._sums += torch.stack([ce_nats_B.sum() / math.log(2.0), labels_B.new_full((), labels_B.numel()),
                                   labels_B.sum(), (1.0 - labels_B).sum(), correct.double()])
        self._probs.append(probs_B.reshape(-1))
        self._labels.append(labels_B.reshape(-1).to(torch.uint8))

    def compute(self) -> dict[str, float]:
        sums = self._sums.clone()
        probs_N = torch.cat(self._probs) if self._probs else sums.new_zeros(0, dtype=torch.float32)
        labels_N = torch.cat(self._labels) if self._labels else sums.new_zeros(0, dtype=torch.uint8)
        if self._world > 1:
            dist.all_reduce(sums)
            probs_N, labels_N = _gathered(probs_N, self._world), _gathered(labels_N, self._world)
        ce, samples, pos, neg, correct = sums.unbind()
        ne = compute_ne(ce, samples, pos, neg, _ETA)
        # torchrec's cross entropy is in bits; the log loss is reported in nats like the train loss.
        logloss = ce * math.log(2.0) / samples.clamp(min=_ETA)
        # label counts summed over ranks: every rank takes the same branch
        one_class = float(pos) == 0 or float(neg) == 0
        auc = _NO_SIGNAL_AUC if one_class else exact_auc(probs_N, labels_N)
        return {"auc": auc, "accuracy": float(correct / samples.clamp(min=_ETA)),
                "ne": float(ne), "logloss": float(logloss)}
