"""Input validation and the learning-rate schedule (in process, no process group needed)."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec.config import OptimConfig
from anyrec.data.prefetch import Prefetched
from anyrec.runtime.distributed import ONE_PROCESS, DistInfo
from anyrec.runtime.errors import NonFiniteLossError
from anyrec.trainer import validate
from anyrec.trainer.optim import WarmupPolyDecay
from anyrec.trainer.validate import (
    InputValidator,
    NonFiniteGuard,
    check_metadata,
    describe,
    flush_checks,
    value_report,
)

from .conftest import OpRecorder

NAMES, ROWS = ["cat_0", "cat_1"], [10, 5]


def _batch(ids0, ids1, keys=NAMES, dense=13):
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.tensor(ids0 + ids1), lengths=torch.tensor([1] * len(ids0) + [1] * len(ids1)))
    B = len(ids0)
    return Batch(dense_features=torch.zeros(B, dense), sparse_features=kjt, labels=torch.zeros(B))


def _labelled(batch, labels=None, dense=None):
    return Batch(dense_features=batch.dense_features if dense is None else dense,
                 sparse_features=batch.sparse_features,
                 labels=batch.labels if labels is None else labels)


def check_batch(batch, feature_names, table_rows, num_dense):
    """Everything wrong with this batch for this model, checked now."""
    problem = check_metadata(batch, feature_names, num_dense)
    if problem is not None:
        return problem
    return describe(value_report(batch, table_rows).tolist(), feature_names, table_rows)


def test_check_batch():
    assert check_batch(_batch([0, 9], [4, 0]), NAMES, ROWS, 13) is None
    assert check_batch(_batch([0, 10], [4, 0]), NAMES, ROWS, 13) == (
        "feature cat_0: id 10 out of range for its table of 10 rows (ids must be in [0, 10))")
    assert "feature cat_1: negative id -3" in check_batch(_batch([0, 1], [-3, 0]), NAMES, ROWS, 13)
    assert "the data has 2 sparse features, the model has 3 tables" in check_batch(
        _batch([0, 1], [0, 0]), [*NAMES, "cat_2"], [*ROWS, 3], 13)
    assert "12 dense features" in check_batch(_batch([0, 1], [0, 0], dense=12), NAMES, ROWS, 13)
    good = _batch([0, 1], [0, 0])
    assert check_batch(_labelled(good, labels=torch.tensor([1.0, 7.0])), NAMES, ROWS, 13) == (
        "1 labels are not 0 or 1")
    nan = torch.zeros(2, 13)
    nan[1, 4], nan[0, 0] = math.nan, math.inf
    assert check_batch(_labelled(good, dense=nan), NAMES, ROWS, 13) == "2 dense values are NaN or infinite"
    wrong_shape = _labelled(good, labels=torch.zeros(2, 1))
    assert "labels have shape (2, 1)" in check_batch(wrong_shape, NAMES, ROWS, 13)
    assert "dense features must be floating point" in check_batch(
        _labelled(good, dense=torch.zeros(2, 13, dtype=torch.int64)), NAMES, ROWS, 13)


def test_validator_reports_the_first_bad_step_at_flush_without_syncing():
    v = InputValidator(NAMES, ROWS, 13, torch.device("cpu"), ONE_PROCESS)
    good, bad_ids = _batch([0, 1], [0, 0]), _batch([0, 1], [0, 7])
    bad_labels = _labelled(good, labels=torch.tensor([0.0, 2.0]))
    with OpRecorder() as rec:
        drawn = list(v.wrap([good, bad_labels, bad_ids, good], first_step=4))
    assert len(drawn) == 4 and len(rec.ops) > 10  # nothing raised while drawing: found later
    assert not any("_local_scalar_dense" in op for op in rec.ops)  # no value read back to the host
    with pytest.raises(ValueError, match=r"^bad input at step 6: 1 labels are not 0 or 1$"):
        flush_checks(v, None)
    flush_checks(v, None)  # the findings were consumed: nothing pending, nothing raised
    list(v.wrap([good, good, bad_ids], first_step=0, what="eval batch"))
    with pytest.raises(ValueError, match=r"at eval batch 3: feature cat_1: id 7 out of range"):
        flush_checks(v, None)


def test_validator_raises_metadata_problems_at_once():
    v = InputValidator(NAMES, ROWS, 13, torch.device("cpu"), ONE_PROCESS)
    batches = v.wrap([_batch([0], [0]), _batch([0], [0], dense=5)], first_step=0)
    next(batches)
    with pytest.raises(ValueError, match=r"bad input at step 2: the data has 5 dense features"):
        next(batches)


def test_prefetch_workers_compute_the_value_findings(monkeypatch):
    """With a prefetched source the findings are computed in the worker as it makes each batch
    (the step's thread only queues them) and are reported as before; a batch with wrong metadata
    reaches the validator unprepared and raises there."""
    batches = [_batch([0, 1], [0, 0]), _batch([0, 1], [0, 7]), _batch([0], [0], dense=5)]

    class Source:
        batch_size = 2

        def batch(self, step):
            return batches[step]

    v = InputValidator(NAMES, ROWS, 13, torch.device("cpu"), ONE_PROCESS)
    made_in = []
    real = validate.value_report

    def recording(batch, rows):
        made_in.append(threading.current_thread().name)
        return real(batch, rows)

    monkeypatch.setattr(validate, "value_report", recording)
    source = Prefetched(Source(), depth=2)
    source.prepare = v.prepare
    drawn = v.wrap(source.iter_from(0, 3), first_step=0)
    next(drawn), next(drawn)
    assert made_in == ["anyrec-prefetch-0"] * 2
    with pytest.raises(ValueError, match=r"bad input at step 3: the data has 5 dense features"):
        next(drawn)
    with pytest.raises(ValueError, match=r"^bad input at step 2: feature cat_1: id 7 out of range"):
        flush_checks(v, None)


@pytest.mark.parametrize("skip", [False, True])
def test_nonfinite_guard(skip):
    g = NonFiniteGuard(skip=skip, device=torch.device("cpu"), info=ONE_PROCESS)
    losses = [torch.tensor(0.5), torch.tensor(math.nan), torch.tensor(0.4), torch.tensor(math.inf)]
    with OpRecorder() as rec:
        run_backward = [g.observe(loss, step) for step, loss in enumerate(losses, start=10)]
    host_reads = sum("_local_scalar_dense" in op for op in rec.ops)
    if skip:  # the decision is needed before the backward: one read per step, and NaN/inf skipped
        assert run_backward == [True, False, True, False] and host_reads == 4
        flush_checks(None, g)
        return
    assert run_backward == [True] * 4 and host_reads == 0
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss at step 12;"):
        flush_checks(None, g)


def test_both_checks_share_one_all_reduce(monkeypatch):
    """A flush is one all-reduce for the input and loss checks together; the input's finding wins."""
    rank1 = DistInfo(rank=1, world_size=2, local_rank=1, local_world_size=2)
    reduced = []

    def all_reduce(t, op):  # rank 0 found nothing: the minimum is this rank's code
        reduced.append(t.tolist())

    monkeypatch.setattr(validate.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(validate.dist, "broadcast_object_list", lambda box, src: None)
    v = InputValidator(NAMES, ROWS, 13, torch.device("cpu"), rank1)
    g = NonFiniteGuard(skip=False, device=torch.device("cpu"), info=rank1)
    list(v.wrap([_batch([0, 1], [0, 0])] * 2, first_step=0))
    g.observe(torch.tensor(0.3), 0)
    flush_checks(v, g)  # nothing found
    assert len(reduced) == 1
    g.observe(torch.tensor(math.nan), 3)
    list(v.wrap([_batch([0, 1], [0, 0])], first_step=4))
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss at step 4 \(rank 1\);"):
        flush_checks(v, g)
    assert len(reduced) == 2 and reduced[1][1] == 3 * 2 + 1
    list(v.wrap([_batch([0, 1], [0, 9])], first_step=5))  # id 9 >= 5 rows of cat_1
    with pytest.raises(ValueError, match=r"^bad input at step 6 \(rank 1\): feature cat_1: id 9"):
        flush_checks(v, g)
    assert len(reduced) == 3


def test_warmup_poly_decay():
    s = WarmupPolyDecay.from_config(OptimConfig(warmup_steps=4, decay_start_step=10, decay_steps=10))
    assert [s.factor(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.factor(9) == 1.0 and s.factor(10) == 1.0
    assert s.factor(15) == pytest.approx(0.25) and s.factor(20) == 0.0 and s.factor(99) == 0.0
    assert WarmupPolyDecay.from_config(OptimConfig()).factor(123) == 1.0
    with pytest.raises(ValueError, match="decay_start_step"):
        WarmupPolyDecay.from_config(OptimConfig(warmup_steps=5, decay_start_step=2, decay_steps=3))


def test_skip_nonfinite_leaves_nan_dense_training_batches_to_the_loss_guard():
    nan = torch.zeros(2, 13)
    nan[1, 4] = math.nan
    batch = _labelled(_batch([0, 1], [0, 0]), dense=nan)
    skipping = InputValidator(NAMES, ROWS, 13, torch.device("cpu"), ONE_PROCESS, skip_nonfinite=True)
    skipping(batch, 3)
    flush_checks(skipping, None)  # a training step: the loss guard skips it
    skipping(batch, 0, "eval batch")
    with pytest.raises(ValueError, match="bad input at eval batch 1: 1 dense values are NaN or infinite"):
        flush_checks(skipping, None)  # evaluation stays strict
    strict = InputValidator(NAMES, ROWS, 13, torch.device("cpu"), ONE_PROCESS)
    strict(batch, 3)
    with pytest.raises(ValueError, match="bad input at step 4: 1 dense values are NaN or infinite"):
        flush_checks(strict, None)


def test_skip_nonfinite_lets_nan_npy_rows_reach_the_loss_guard(tmp_path):
    import numpy as np

    from anyrec.config import DataConfig
    from anyrec.data.criteo import CriteoSource

    from .test_data_criteo import MODEL, _write_npy_day

    dense = np.ones((32, 13), dtype=np.float32)
    dense[5, 3] = np.nan
    d = _write_npy_day(tmp_path, dense=dense)
    data = DataConfig(name="criteo_npy", path=str(d), train_files=["day_0"], batch_size=8)
    batch = CriteoSource(MODEL, data, skip_nonfinite=True).batch(0)
    assert int(torch.isnan(batch.dense_features).sum()) == 1
    with pytest.raises(ValueError, match=r"day_0_dense.npy row 5: dense feature 3 is nan"):
        CriteoSource(MODEL, data).batch(0)
    with pytest.raises(ValueError, match=r"day_0_dense.npy row 5: dense feature 3 is nan"):
        CriteoSource(MODEL, data, split="eval", skip_nonfinite=True).batch(0)  # evaluation stays strict
