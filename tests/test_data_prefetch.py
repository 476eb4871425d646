"""Prefetching: the same batches in the same order, made ahead by threads, errors surfacing at the
batch that failed, pinned memory when asked, and no thread left behind."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch

from anyrec.backends import get_backend
from anyrec.config import DataConfig, ModelConfig
from anyrec.data import build_source
from anyrec.data.prefetch import Prefetched, PrefetchIterator
from anyrec.data.preprocess import main as preprocess_main

from .conftest import compose_config, last_json_line
from .test_data import write_tsv


class CountingSource:
    """Batch `step` is a tensor holding step; records which steps were made; fails at `fail_at`."""

    batch_size = 4

    def __init__(self, fail_at: int | None = None, delay_s: float = 0.0) -> None:
        self.made: list[int] = []
        self.fail_at, self.delay_s = fail_at, delay_s

    def batch(self, step: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        if step == self.fail_at:
            raise ValueError(f"criteo: /data/day_0_labels.npy row {step * 4}: label 7 is not 0 or 1")
        self.made.append(step)
        return torch.full((4,), step)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("anyrec-prefetch")]


def _wait_for(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.mark.parametrize("workers", [1, 3])
def test_same_batches_in_order(workers):
    src = CountingSource()
    got = [int(b[0]) for b in Prefetched(src, depth=4, workers=workers).iter_from(5, 17)]
    assert got == list(range(5, 22))
    assert _wait_for(lambda: not _prefetch_threads())


def test_batches_are_made_ahead_of_the_consumer():
    src = CountingSource()
    it = Prefetched(src, depth=3).iter_from(0, None)
    assert int(next(it)[0]) == 0
    # With nothing consumed since, the worker fills its queue: batches 1..3 exist before anyone asks.
    assert _wait_for(lambda: len(src.made) >= 4), src.made
    time.sleep(0.2)
    assert len(src.made) <= 5  # bounded: depth queued plus one waiting to be queued
    it.close()
    assert _wait_for(lambda: not _prefetch_threads())


def test_worker_error_surfaces_at_its_batch():
    it = Prefetched(CountingSource(fail_at=3), depth=2, workers=2).iter_from(0, 10)
    assert [int(next(it)[0]) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"^criteo: /data/day_0_labels.npy row 12: label 7 is not 0 or 1$"):
        next(it)
    assert _wait_for(lambda: not _prefetch_threads())


def test_abandoned_iterator_stops_its_threads():
    it = Prefetched(CountingSource(delay_s=0.01), depth=2, workers=2).iter_from(0, None)
    next(it)
    assert _prefetch_threads()
    del it
    gc.collect()
    assert _wait_for(lambda: not _prefetch_threads())


def test_pinned_only_when_asked():
    class Pinnable:
        def __init__(self) -> None:
            self.pinned = False

    def pin(b: Pinnable) -> Pinnable:  # what a backend's pin does to a batch
        b.pinned = True
        return b

    assert all(b.pinned for b in PrefetchIterator(lambda s: Pinnable(), 0, 3, depth=2, pin=pin))
    assert not any(b.pinned for b in PrefetchIterator(lambda s: Pinnable(), 0, 3, depth=2))


def test_wrapper_passes_the_source_through():
    src = CountingSource()
    pre = Prefetched(src, depth=2)
    assert pre.batch_size == 4 and int(pre.batch(7)[0]) == 7
    with pytest.raises(ValueError, match="must be >= 1"):
        PrefetchIterator(src.batch, 0, 1, depth=0)


@pytest.mark.integration  # two trainings
def test_training_with_prefetch_is_bit_identical(tmp_path, train_here):
    write_tsv(tmp_path / "day_0", 150)
    assert preprocess_main([str(tmp_path / "day_0"), "--out-dir", str(tmp_path / "npy")]) == 0

    def train(name: str, *extra: str) -> dict:
        proc = train_here(["model=dlrm_tiny", "data=criteo_npy", f"data.path={tmp_path}/npy",
                           "data.batch_size=16", "trainer.steps=12", "trainer.eval_every=6",
                           "trainer.eval_steps=3", "trainer.progress=false", "trainer.tensorboard=false",
                           "trainer.fingerprint_weights=true", f"hydra.run.dir={tmp_path}/{name}", *extra],
                          tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return last_json_line(proc.stdout)

    plain = train("plain", "data.prefetch=0")
    ahead = train("ahead", "data.prefetch=3", "data.prefetch_workers=2")
    assert plain["final_loss"] == ahead["final_loss"] and plain["eval_auc"] == ahead["eval_auc"]
    assert plain["weights_sha256"] == ahead["weights_sha256"]


def test_pinned_batches_on_an_accelerator(tmp_path):
    """GPU-only: prefetched Criteo batches are page-locked and copy to the device unchanged."""
    backend = get_backend("auto")
    if backend.device_type == "cpu":
        pytest.skip("needs an accelerator (pinned memory)")
    write_tsv(tmp_path / "day_0", 40)
    assert preprocess_main([str(tmp_path / "day_0"), "--out-dir", str(tmp_path / "npy")]) == 0
    model = ModelConfig(name="m", table_rows=[97] * 26)
    data = DataConfig(name="criteo_npy", path=str(tmp_path / "npy"), train_files=["day_0"], batch_size=8)
    assert backend.pins_host_memory()
    src = build_source(model, data, 0, 0, 1, "train", pin=backend.pin)
    for step, b in enumerate(src.iter_from(0, 3)):
        assert b.dense_features.is_pinned() and b.sparse_features.values().is_pinned()
        on_device = b.to(backend.device(), non_blocking=True)
        assert torch.equal(on_device.dense_features.cpu(), src.batch(step).dense_features)


@pytest.mark.parametrize(("bad", "message"), [
    ("data.prefetch=-1", "data.prefetch must be >= 0, got -1"),
    ("data.prefetch_workers=0", "data.prefetch_workers must be >= 1")])
def test_prefetch_settings_are_checked(bad, message):
    with pytest.raises(ValueError, match=message):
        compose_config(["data=criteo_npy", "data.path=/nonexistent", bad])  # the typed config refuses it


def test_idle_workers_take_one_thread_at_idle_priority_and_leave_the_defaults():
    """Training on a CPU, a worker competes with the step for the same cores: it runs its torch ops
    on one thread at idle scheduling priority; the consumer's threads and the default for new
    threads are unchanged."""
    before = torch.get_num_threads()

    def probe(step):
        policy = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
        return step, torch.get_num_threads(), policy

    got = list(PrefetchIterator(probe, 0, 3, depth=2, idle=True))
    assert [s for s, _, _ in got] == [0, 1, 2] and all(n == 1 for _, n, _ in got)
    if hasattr(os, "SCHED_IDLE"):
        assert all(p == os.SCHED_IDLE for _, _, p in got)
    normal = list(PrefetchIterator(probe, 0, 2, depth=2))
    assert all(n == before for _, n, _ in normal)
    if hasattr(os, "SCHED_IDLE"):
        assert all(p != os.SCHED_IDLE for _, _, p in normal)
    fresh = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == before and fresh == [before]


def test_synthetic_batches_on_a_cpu_are_made_ahead_at_idle_priority():
    """Synthetic data on a CPU: `data.prefetch` batches ahead by idle workers, the same batches in
    the same order; prefetch=0 and accelerators (kernels queued in the step) make them in the step."""
    from anyrec.data.synthetic import SyntheticCriteo

    model = ModelConfig(name="m", table_rows=[50, 7, 300, 1, 64, 129], multi_hot=[1, 3, 2, 1, 5, 2])
    data = DataConfig(batch_size=8)
    ahead = build_source(model, data, 3, 1, 2, "train", device=torch.device("cpu"))
    assert isinstance(ahead, Prefetched) and ahead.idle and ahead.depth == data.prefetch
    plain = build_source(model, DataConfig(batch_size=8, prefetch=0), 3, 1, 2, "train")
    assert isinstance(plain, SyntheticCriteo)
    on_device = build_source(model, data, 3, 1, 2, "train", device=torch.device("meta"))
    assert isinstance(on_device, SyntheticCriteo) and on_device.device.type == "meta"
    for step, b in enumerate(ahead.iter_from(0, 4)):
        ref = plain.batch(step)
        assert torch.equal(b.sparse_features.values(), ref.sparse_features.values())
        assert torch.equal(b.dense_features, ref.dense_features) and torch.equal(b.labels, ref.labels)
