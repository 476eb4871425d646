"""The run summary is built from values (JobFacts, RunState, Outcome), with no Trainer, and touches no
file: what it reports; `remember_run` writes the measured step back to the cache, only for a run that
was not stopped; the correction read at set-up is what the prediction uses."""

from __future__ import annotations

import json
import time

import pytest
import torch

from anyrec.history.cache import CACHE_DIR_ENV
from anyrec.history.steplearn import Correction, ObservedSteps
from anyrec.planner.types import Perf
from anyrec.runtime.distributed import ONE_PROCESS
from anyrec.trainer.summary import (
    JobFacts,
    MetricWriter,
    Outcome,
    RunState,
    learnt_correction,
    log_train,
    remember_run,
    run_summary,
)

KEY = "0123456789abcdef/quiet"


def _run(steps: int = 20) -> RunState:
    run = RunState.begin(0, steps, 5, torch.device("cpu"), MetricWriter(None, False), samples_per_step=64,
                         is_main=True, progress=False)
    run.timer.chunk_start(0)
    for step in range(1, steps + 1):
        time.sleep(0.002)
        run.window.add(torch.tensor(0.5))
        run.timer.after_step(step)
    run.timer.chunk_end(steps)
    return run


def _outcome(**changes) -> Outcome:
    values = dict(step=20, final_loss=0.5, train_loss=0.5, eval_result=None, skipped_batches=1,
                  malformed_rows=2, resumed_from=None, stopped_by=None,
                  predicted_perf=Perf(fwd_compute_s=1e-3), predicted_memory=None,
                  peak_allocated_bytes=1234, peak_reserved_bytes=4096, weights_sha256="ab" * 32)
    return Outcome(**{**values, **changes})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    return ObservedSteps(tmp_path)


def test_summary_reports_the_values_it_is_given(cache):
    job = JobFacts("cpu", "torch", ONE_PROCESS, batch_size=64, sharding_group_size=1, step_key=KEY)
    run = _run()
    s = run_summary(job, run, _outcome())
    assert (s["steps"], s["backend"], s["embedding_kernel"]) == (20, "cpu", "torch")
    assert (s["batch_size_per_rank"], s["sharding_group_size"]) == (64, 1)
    assert (s["skipped_batches"], s["data_malformed_rows"], s["peak_memory_bytes"]) == (1, 2, 1234)
    assert s["samples_per_s"] == pytest.approx(20 * 64 / run.timer.total_s)
    assert s["weights_sha256"] == "ab" * 32 and s["stopped_by"] is None
    assert s["model_step_ms"] == pytest.approx(1.0) and s["measured_step_ms"] > 0
    assert cache.correction(KEY).runs == 0  # the summary writes nothing
    remember_run(job, s, _outcome())
    assert cache.correction(KEY).runs == 1  # this run's step, learnt for the next one
    # the next run reads it once, at set-up, and predicts with it
    learnt = learnt_correction(KEY, 1e-3, ONE_PROCESS)
    assert learnt.runs == 1 and learnt.factor == pytest.approx((s["measured_step_ms"] / 1.0) ** 0.5)
    again = run_summary(JobFacts("cpu", "torch", ONE_PROCESS, 64, 1, KEY, correction=learnt), _run(),
                        _outcome())
    assert again["predicted_step_ms"] == pytest.approx(learnt.factor) and again["step_correction_runs"] == 1


def test_a_stopped_run_teaches_nothing(cache):
    job = JobFacts("cpu", "torch", ONE_PROCESS, batch_size=64, sharding_group_size=1, step_key=KEY)
    s = run_summary(job, _run(), _outcome(stopped_by="SIGTERM", weights_sha256=None))
    assert s["stopped_by"] == "SIGTERM" and "weights_sha256" not in s
    remember_run(job, s, _outcome(stopped_by="SIGTERM"))
    assert cache.correction(KEY).runs == 0
    assert JobFacts("cpu", "torch", ONE_PROCESS, 64, 1).correction == Correction()  # none read: factor 1


def test_train_record_rate_counts_every_rank(tmp_path):
    run = RunState.begin(0, 10, 5, torch.device("cpu"), MetricWriter(str(tmp_path), True, tensorboard=False),
                         samples_per_step=128, is_main=True, progress=False)
    run.timer.chunk_start(0)
    for _ in range(5):
        run.window.add(torch.tensor(0.25))
    time.sleep(0.01)
    log_train(run, 5, 0.5, dense_lr=2.0, embedding_lr=4.0)
    run.writer.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["loss"] == 0.25 and (record["dense_lr"], record["embedding_lr"]) == (1.0, 2.0)
    assert 0 < record["samples_per_s"] <= 5 * 128 / 0.01
