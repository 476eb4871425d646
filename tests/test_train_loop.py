"""The one training loop: `Trainer.run_steps` is what `train()` runs; the step state round-trips;
the deferred checks are flushed once per step boundary."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

from anyrec.trainer import trainer as trainer_module
from anyrec.trainer.checkpoint import TrainerState

from .conftest import compose_config

TINY = ["model=dlrm_tiny", "backend=cpu", "backend.embedding_kernel=torch", "trainer.progress=false",
        "trainer.tensorboard=false", "data.batch_size=32", "trainer.seed=3"]


@pytest.fixture
def one_rank(monkeypatch):
    """A process group of one inside pytest; monkeypatch restores the environment afterwards."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # the Trainer sets them; set-then-delete removes them after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _trainer(*overrides):
    _, cfg = compose_config([*TINY, *overrides])
    return trainer_module.Trainer(cfg)


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_train_is_run_steps_in_chunks(one_rank):
    """train() with an evaluation every 3 steps (chunks of 3) and two bare run_steps(3) calls give
    the same per-step losses and weights, bit for bit."""
    a = _trainer("trainer.steps=6", "trainer.eval_every=3", "trainer.eval_steps=1")
    try:
        losses_a: list[float] = []
        a.step_hooks.append(lambda t: losses_a.append(float(t.last_loss)))
        summary = a.train()
        weights_a = _weights(a)
    finally:
        a.close()
    b = _trainer("trainer.steps=6", "trainer.eval_steps=0")
    try:
        losses_b: list[float] = []
        b.step_hooks.append(lambda t: losses_b.append(float(t.last_loss)))
        b.run_steps(3)
        b.run_steps(3)
        assert b.step == 6
        weights_b = _weights(b)
    finally:
        b.close()
    assert summary["steps"] == 6 and len(losses_a) == 6
    assert losses_a == losses_b and summary["final_loss"] == losses_a[-1]
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def test_one_flush_per_step_boundary(one_rank, monkeypatch):
    """Chunks end at steps 5 and 10 (evaluations), which are also log steps: one flush each."""
    flushed = []
    real = trainer_module.flush_checks

    def counting(validator, guard):
        if guard is not None:  # a training boundary's flush (evaluation flushes its input checks alone)
            flushed.append(t.step)
        real(validator, guard)

    monkeypatch.setattr(trainer_module, "flush_checks", counting)
    t = _trainer("trainer.steps=10", "trainer.log_every=5", "trainer.eval_every=5", "trainer.eval_steps=1")
    try:
        t.train()
    finally:
        t.close()
    assert flushed == [5, 10]


def test_trainer_state_round_trips_step_skips_and_rng_storing_the_step_once():
    state = TrainerState(rank=1, step=7, skipped_batches=2)
    assert isinstance(state, Stateful)  # what DCP calls on save and load
    saved = state.state_dict()
    assert set(saved) == {"step", "skipped_batches", "rng"} and set(saved["rng"]) == {"rank1"}
    assert (int(saved["step"]), int(saved["skipped_batches"])) == (7, 2)
    expected = torch.rand(3)  # what the RNG gives right after the save
    torch.rand(5)
    other = TrainerState(rank=1)
    other.load_state_dict(saved)
    assert (other.step, other.skipped_batches) == (7, 2)
    assert torch.equal(torch.rand(3), expected)  # the RNG is back where it was saved


def test_checkpoint_stores_the_step_once_and_reads_the_previous_layout(one_rank, tmp_path):
    """A checkpoint holds the trainer's state under `trainer` (the step once, no `progress`); one in the
    0.1.0 layout (`progress` = [step, data step, skipped] and a top-level `rng`) still resumes."""
    ckpt = [f"trainer.checkpoint.dir={tmp_path}", "trainer.eval_steps=0"]
    a = _trainer("trainer.steps=4", *ckpt)
    try:
        a.train()
        keys = a.checkpoints.saved_keys(tmp_path / "step_4")
        assert {"trainer.step", "trainer.skipped_batches", "trainer.rng.rank0"} <= keys
        assert not any("progress" in k for k in keys)
        state = a.state_dict()  # what 0.1.0 wrote beside the model and optimizers
        legacy = {"model": state["model"], "optim": state["optim"],
                  "progress": torch.tensor([6, 6, 1]), "rng": state["trainer"]["rng"]}
        a.checkpoints.save(6, legacy, {"world_size": 1, "model": "dlrm_tiny"})
        weights_a = _weights(a)
    finally:
        a.close()
    b = _trainer("trainer.steps=6", *ckpt)
    try:
        assert (b.step, b.state.skipped_batches, b.resumed_from) == (6, 1, 6)
        weights_b = _weights(b)
        assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    finally:
        b.close()


def test_a_cpu_trainer_times_each_step_and_measures_the_median(one_rank):
    """The CPU backend queues no device work, so the trainer times each step alone: the summary's
    measured step is the median of the timed steps."""
    t = _trainer("trainer.steps=12", "trainer.eval_steps=0")
    try:
        assert not t.backend.queues_device_work()
        summary = t.train()
        timer = t.run.timer
        assert timer.per_step is not None and timer.per_step.n == summary["measured_steps"] > 0
        assert summary["measured_step_ms"] == pytest.approx(timer.per_step.median() * 1e3)
        assert summary["measured_step_statistic"] == "median"
    finally:
        t.close()
