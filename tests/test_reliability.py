"""Failures stop cleanly: a NaN loss (or its batch skipped), out-of-range ids, a wrong number of
features; every rank exits non-zero with one clear line from rank 0, and nothing hangs."""

from __future__ import annotations

import math

import pytest

from .conftest import last_json_line, torchrun
from .faults import NAN_AT_STEP, faulty
from .test_data import write_tsv

pytestmark = pytest.mark.integration  # jobs: under torchrun, or one run in this process

BASE = ["-m", "anyrec.train", "model=dlrm_tiny", "data.batch_size=32", "trainer.eval_steps=0",
        "trainer.progress=false", "trainer.tensorboard=false"]


def _errors(proc):
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("anyrec-train: error:")]


def _failed_run(tmp_path, *overrides, nan_at: int | None = None):
    """A 2-rank job of 8 steps with `overrides` (and rank 0's training batch `nan_at` given a NaN)
    that must fail: the process and its one error line."""
    args, env = (BASE, None) if nan_at is None else (faulty(BASE), {NAN_AT_STEP: str(nan_at)})
    proc = torchrun([*args, "trainer.steps=8", *overrides, f"hydra.run.dir={tmp_path}"], cwd=tmp_path,
                    timeout=180, env=env)
    assert proc.returncode != 0
    lines = _errors(proc)
    assert len(lines) == 1, proc.stderr[-3000:]
    return proc, lines[0]


def test_nan_loss_stops_at_that_step(tmp_path):
    # The NaN is injected on rank 0 only: rank 1 must stop too, naming the same step (the deferred
    # check is all-reduced at the chunk's end). Input validation off: it would name the NaN input first.
    proc, line = _failed_run(tmp_path, "trainer.validate_inputs=false", nan_at=3)
    assert "non-finite loss" in line and "at step 4" in line, proc.stderr[-3000:]
    assert "exitcode  : 3" in proc.stderr or "exitcode: 3" in proc.stderr.replace("  ", " ")


def test_nan_batch_skipped_when_asked(tmp_path):
    proc = torchrun([*faulty(BASE), "trainer.steps=8", "trainer.skip_nonfinite=true",
                     "trainer.validate_inputs=false", f"hydra.run.dir={tmp_path}"], cwd=tmp_path, timeout=180,
                    env={NAN_AT_STEP: "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = last_json_line(proc.stdout)
    assert s["steps"] == 8 and s["skipped_batches"] == 1
    # finite: the NaN never reached the weights
    assert s["final_loss"] is not None and math.isfinite(s["final_loss"])


def test_nan_input_is_named_by_the_validator(tmp_path):
    _, line = _failed_run(tmp_path, nan_at=3)
    assert "bad input at step 4 (rank 0): 1 dense values are NaN or infinite" in line


def test_out_of_range_ids_fail_on_every_rank(tmp_path):
    _, line = _failed_run(tmp_path, "data.id_range_scale=2.0")
    assert "bad input at step 1" in line and "out of range for its table of" in line
    assert "feature cat_" in line


def test_wrong_number_of_features_fails_clearly(tmp_path, train_here):
    write_tsv(tmp_path / "day_0", 64)
    proc = train_here([*BASE[2:], "trainer.steps=2", "data=criteo_tsv", f"data.path={tmp_path}",
                       "model.table_rows=[10,20,30]", f"hydra.run.dir={tmp_path}/h"], tmp_path)
    assert proc.returncode == 2
    lines = _errors(proc)
    assert lines == ["anyrec-train: error: bad input at step 1: the data has 26 sparse features, "
                     "the model has 3 tables (model.table_rows)"], proc.stderr[-3000:]


def test_nan_input_batch_skipped_when_asked_with_validation_on(tmp_path):
    # trainer.skip_nonfinite means what it says with the input checks on (the default) too.
    proc = torchrun([*faulty(BASE), "trainer.steps=8", "trainer.skip_nonfinite=true",
                     f"hydra.run.dir={tmp_path}"], cwd=tmp_path, timeout=180, env={NAN_AT_STEP: "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = last_json_line(proc.stdout)
    assert s["steps"] == 8 and s["skipped_batches"] == 1
    assert s["final_loss"] is not None and math.isfinite(s["final_loss"])


@pytest.mark.deadline
@pytest.mark.integration
def test_a_short_soak_recovers_bit_identically_from_random_kills():
    # benchmarks/soak.py in short: 3 SIGKILLs (a rank or torchrun) at seeded-random instants.
    from benchmarks import soak

    result = soak.soak(kills=3, seed=3, steps=12, every=3, eval_every=6, limit_s=400, log=lambda *a: None)
    killed = [r for r in result["tries"] if r["killed"]]
    assert result["kills"] == 3 and result["identical"] == 3, killed
    assert result["incomplete_used"] == 0 and result["incomplete_left"] == 0, killed
    assert result["left_behind"] == 0
    assert all(s < 5 for s in result["launcher_workers_exit_s"]), killed
