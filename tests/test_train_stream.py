"""A windowed stream through the trainer's one loop: step -> (window, batch), evaluation after each
training window on the next; DLRMv4's sizes from the job's model config."""

from __future__ import annotations

import pytest

from anyrec.config import ModelConfig
from anyrec.models.dlrmv4 import dlrmv4_config, workload_facts
from anyrec.trainer.inputs import WindowStream


class FakeWindows:
    """Three windows of 2, 3 and 4 training batches; a batch is (window, index)."""

    batch_size = 4

    def num_windows(self) -> int:
        return 3

    def num_train_batches(self, w: int) -> int:
        return [2, 3, 4][w]

    def train_batch(self, w: int, i: int) -> tuple[int, int]:
        return (w, i)

    def eval_batches(self, w: int) -> list[tuple[str, int]]:
        return [("eval", w)]


def test_steps_run_through_the_training_windows_and_evaluate_the_next():
    stream = WindowStream(FakeWindows())
    assert stream.window_ends == (2, 5)  # the last window is evaluated only
    assert list(stream.iter_from(0)) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert list(stream.iter_from(3, 10)) == [(1, 1), (1, 2)]  # a resume mid-window
    assert list(stream.eval_after(2)) == [("eval", 1)] and list(stream.eval_after(5)) == [("eval", 2)]


def test_a_stream_of_one_window_is_refused():
    one = FakeWindows()
    one.num_windows = lambda: 1
    with pytest.raises(ValueError, match="at least 2"):
        WindowStream(one)


def test_dlrmv4_sizes_come_from_the_model_config():
    cfg = ModelConfig(name="v4", family="dlrmv4", embedding_dim=32,
                      hstu={"table_scale": 0.002, "model_dim": 32, "max_seq_len": 128})
    m = dlrmv4_config(cfg)
    assert m.table_dim == 32 and m.model_dim == 32 and m.table_rows["item_id"] == 18_782
    assert workload_facts(cfg).lookups_per_sample["item_id"] == 120.0  # 128 less 8 contextual tokens
    with pytest.raises(ValueError, match="model.hstu has no field 'widht'"):
        dlrmv4_config(ModelConfig(name="v4", family="dlrmv4", hstu={"widht": 3}))
