"""Eval metrics: AUC, accuracy, normalized entropy and log loss against direct formulas."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from anyrec.runtime.distributed import ONE_PROCESS
from anyrec.trainer.metrics import EvalMetrics


def test_eval_metrics_match_formulas():
    g = torch.Generator().manual_seed(0)
    labels = torch.bernoulli(torch.full((1000,), 0.3), generator=g)
    logits = torch.randn(1000, generator=g) + 1.5 * labels
    m = EvalMetrics(torch.device("cpu"), ONE_PROCESS)
    m.update(logits[:600], labels[:600])
    m.update(logits[600:], labels[600:])
    out = m.compute()
    logloss = float(F.binary_cross_entropy_with_logits(logits.double(), labels.double()))
    p = float(labels.double().mean())
    baseline = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert abs(out["logloss"] - logloss) < 1e-12  # from the logits in fp64
    assert abs(out["ne"] - logloss / baseline) < 1e-12
    assert out["accuracy"] == int(((logits > 0).float() == labels).sum()) / 1000
    # AUC by counting correctly ordered (positive, negative) pairs.
    pos, neg = logits[labels == 1], logits[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).double().mean()
    assert abs(out["auc"] - float(pairs)) < 1e-12  # exact, in fp64


def test_auc_counts_a_tied_pair_as_half_and_agrees_with_torchmetrics():
    """Scores rounded to a tenth tie often: each tied (positive, negative) pair counts half. The AUROC
    anyrec reported before (torchmetrics' BinaryAUROC, a trapezoid in fp32) agrees to its rounding."""
    from torchmetrics.classification import BinaryAUROC  # installed with torchrec; anyrec imports neither

    g = torch.Generator().manual_seed(1)
    labels = torch.bernoulli(torch.full((3000,), 0.4), generator=g)
    logits = torch.round((torch.randn(3000, generator=g) + labels) * 10) / 10
    out = _metrics(logits, labels)
    probs = torch.sigmoid(logits)
    pos, neg = probs[labels == 1], probs[labels == 0]
    pairs = ((pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()).mean()
    assert abs(out["auc"] - float(pairs)) < 1e-12
    assert abs(out["auc"] - float(BinaryAUROC()(probs, labels.long()))) < 1e-6
    assert abs(out["auc"] - float((pos[:, None] > neg[None, :]).double().mean())) > 1e-3  # ties matter here


def test_the_metrics_import_neither_torchmetrics_nor_torchrecs_metrics():
    """Both cost every rank's start-up about 0.4 s (torchmetrics imports matplotlib)."""
    import ast

    from .conftest import ROOT

    for path in (ROOT / "anyrec").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.split(".")[0] == "torchmetrics"
                        or n.startswith("torchrec.metrics")], path


def _metrics(logits, labels) -> dict[str, float]:
    m = EvalMetrics(torch.device("cpu"), ONE_PROCESS)
    m.update(torch.as_tensor(logits, dtype=torch.float32), torch.as_tensor(labels, dtype=torch.float32))
    return m.compute()


def test_single_class_auc_is_torchrecs_no_signal_value():
    assert _metrics([0.3, -1.0, 2.0], [1, 1, 1])["auc"] == 0.5
    assert _metrics([0.3, -1.0, 2.0], [0, 0, 0])["auc"] == 0.5
    assert _metrics([0.3, -1.0], [1, 0])["auc"] == 1.0  # two classes: the real AUC
    assert _metrics([0.3, -1.0], [0.7, 0])["auc"] == 0.5  # a soft label counts as its integer part


def test_probability_one_half_counts_positive():
    # logit 0 and -1e-9 both give an fp32 probability of exactly 0.5: positive, as torchrec thresholds
    assert float(torch.sigmoid(torch.tensor(-1e-9))) == 0.5
    assert _metrics([0.0, -1e-9], [1, 1])["accuracy"] == 1.0
    assert _metrics([0.0, -1e-9], [0, 0])["accuracy"] == 0.0
    assert _metrics([-0.01], [0])["accuracy"] == 1.0


def test_logloss_is_stable_for_large_logits():
    # fp32 sigmoid(40) == 1.0: a loss through probabilities would clamp at -ln(1e-12) = 27.6 nats
    logits, labels = torch.tensor([40.0, -40.0, 0.0]), torch.tensor([0.0, 1.0, 1.0])
    out = _metrics(logits, labels)
    want = float(F.binary_cross_entropy_with_logits(logits.double(), labels.double()))
    assert abs(want - (40 + 40 + math.log(2)) / 3) < 1e-9
    assert abs(out["logloss"] - want) < 1e-12
    p = 2 / 3
    assert abs(out["ne"] - want / -(p * math.log(p) + (1 - p) * math.log(1 - p))) < 1e-12
