"""DLRMv4 through the trainer's one loop on a tiny synthetic stream, in one process: the steps are the
training windows' batches, each window is evaluated on the next (the last eval batches padded), the
summary carries each window's AUC beside the generator's hidden-model AUC, and a run stopped mid-window
and resumed from its checkpoint ends bit-exact with an uninterrupted one."""

from __future__ import annotations

import pytest

from anyrec.trainer import trainer as trainer_module

from .conftest import compose_config

# one intra-op thread: backend.threads=auto times counts on the job's own steps and keeps the fastest,
# which changes the float sums from run to run
TINY = ["model=dlrmv4_small", "backend=cpu", "backend.threads=1", "trainer.progress=false",
        "trainer.tensorboard=false", "trainer.calibrate=never", "trainer.fingerprint_weights=true",
        "data.batch_size=32", "model.hstu.table_scale=0.0001", "data.sequence.events_per_user_day=4",
        "data.sequence.num_windows=3", "+data.sequence.history_days=1"]


@pytest.fixture
def one_rank(monkeypatch):
    """A process group of one inside pytest; monkeypatch restores the environment afterwards."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _train(*overrides: str) -> tuple[dict, tuple[int, ...]]:
    _, cfg = compose_config([*TINY, *overrides])
    trainer = trainer_module.Trainer(cfg)
    try:
        return trainer.train(), trainer.eval_points
    finally:
        trainer.close()


def test_windows_train_then_evaluate_the_next_and_resume_mid_window_exactly(one_rank, tmp_path):
    full, window_ends = _train()
    assert len(window_ends) == 2 and full["steps"] == window_ends[-1]  # the stream decides the steps
    assert [(e["window"], e["step"]) for e in full["window_eval"]] == [(1, window_ends[0]),
                                                                       (2, window_ends[1])]
    assert set(full["hidden_auc_by_window"]) == {"1", "2"}
    assert full["eval_auc"] == full["window_eval"][-1]["auc"]
    assert (full["model"], full["attention_kernel"]) == ("dlrmv4_small", "torch")

    # trainer.evaluate=false: the same steps and weights, no window evaluated (nor its hidden AUC drawn)
    steps_only, points = _train("trainer.evaluate=false")
    assert points == () and steps_only["window_eval"] == [] and steps_only["eval_auc"] is None
    assert steps_only["steps"] == full["steps"] and steps_only["hidden_auc_by_window"] == {}
    assert steps_only["weights_sha256"] == full["weights_sha256"]

    mid = window_ends[0] // 2  # inside training window 0
    ckpt = [f"trainer.checkpoint.dir={tmp_path / 'ck'}"]
    first, _ = _train(f"trainer.steps={mid}", *ckpt)
    assert first["steps"] == mid and first["window_eval"] == []  # stopped before window 0 ended
    resumed, _ = _train(*ckpt)
    assert resumed["resumed_from_step"] == mid and resumed["steps"] == full["steps"]
    assert resumed["weights_sha256"] == full["weights_sha256"]
    assert resumed["final_loss"] == full["final_loss"]
    assert resumed["window_eval"] == full["window_eval"]
