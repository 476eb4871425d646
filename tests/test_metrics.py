"""Eval metrics: AUC, accuracy, normalized entropy and log loss against direct formulas."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from anyrec.trainer.metrics import EvalMetrics


def test_eval_metrics_match_formulas():
    g = torch.Generator().manual_seed(0)
    labels = torch.bernoulli(torch.full((1000,), 0.3), generator=g)
    logits = torch.randn(1000, generator=g) + 1.5 * labels
    m = EvalMetrics(torch.device("cpu"))
    m.update(logits[:600], labels[:600])
    m.update(logits[600:], labels[600:])
    out = m.compute()
    logloss = float(F.binary_cross_entropy_with_logits(logits.double(), labels.double()))
    p = float(labels.mean())
    baseline = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert abs(out["logloss"] - logloss) < 1e-6  # probabilities are fp32
    assert abs(out["ne"] - logloss / baseline) < 1e-6
    assert out["accuracy"] == float(((logits > 0).float() == labels).float().mean())
    # AUC by counting correctly ordered (positive, negative) pairs.
    pos, neg = logits[labels == 1], logits[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).double().mean()
    assert abs(out["auc"] - float(pairs)) < 1e-6
