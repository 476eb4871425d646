"""Input validation and the learning-rate schedule (in process, no process group needed)."""

from __future__ import annotations

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec.config import OptimConfig
from anyrec.trainer.schedule import WarmupPolyDecay
from anyrec.trainer.validate import InputValidator, check_batch

NAMES, ROWS = ["cat_0", "cat_1"], [10, 5]


def _batch(ids0, ids1, keys=NAMES, dense=13):
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.tensor(ids0 + ids1), lengths=torch.tensor([1] * len(ids0) + [1] * len(ids1)))
    B = len(ids0)
    return Batch(dense_features=torch.zeros(B, dense), sparse_features=kjt, labels=torch.zeros(B))


def test_check_batch():
    assert check_batch(_batch([0, 9], [4, 0]), NAMES, ROWS, 13) is None
    assert check_batch(_batch([0, 10], [4, 0]), NAMES, ROWS, 13) == (
        "feature cat_0: id 10 out of range for its table of 10 rows (ids must be in [0, 10))")
    assert "feature cat_1: negative id -3" in check_batch(_batch([0, 1], [-3, 0]), NAMES, ROWS, 13)
    assert "the data has 2 sparse features, the model has 3 tables" in check_batch(
        _batch([0, 1], [0, 0]), [*NAMES, "cat_2"], [*ROWS, 3], 13)
    assert "12 dense features" in check_batch(_batch([0, 1], [0, 0], dense=12), NAMES, ROWS, 13)


def test_validator_raises_value_error_naming_step():
    v = InputValidator(NAMES, ROWS, 13, torch.device("cpu"))
    batches = v.wrap([_batch([0], [0]), _batch([0], [7])], first_step=4)
    next(batches)
    with pytest.raises(ValueError, match=r"bad input at step 6: feature cat_1: id 7 out of range"):
        next(batches)


def test_warmup_poly_decay():
    s = WarmupPolyDecay.from_config(OptimConfig(warmup_steps=4, decay_start_step=10, decay_steps=10))
    assert [s.factor(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.factor(9) == 1.0 and s.factor(10) == 1.0
    assert s.factor(15) == pytest.approx(0.25) and s.factor(20) == 0.0 and s.factor(99) == 0.0
    assert WarmupPolyDecay.from_config(OptimConfig()).factor(123) == 1.0
    with pytest.raises(ValueError, match="decay_start_step"):
        WarmupPolyDecay.from_config(OptimConfig(warmup_steps=5, decay_start_step=2, decay_steps=3))
