"""The summary's memory check (anyrec.trainer.memcheck): predicted peak per rank beside the measured one,
the error, a warning past 15 %, nulls where the device measures nothing; the data source's bytes."""

from __future__ import annotations

import logging

import pytest
import torch

from anyrec.planner.memory import MemoryPrediction
from anyrec.trainer.memcheck import memory_check, resident_device_bytes


def _pred(weights: int) -> MemoryPrediction:
    return MemoryPrediction(weights, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2**20, "update")


def test_memory_check_reports_and_warns(caplog):
    with caplog.at_level(logging.INFO, logger="anyrec.trainer.memcheck"):
        out = memory_check([_pred(100), _pred(120)], [100, 200])
    assert out["predicted_peak_memory_bytes_per_rank"] == [100, 120]
    assert out["measured_peak_memory_bytes_per_rank"] == [100, 200]
    assert out["memory_prediction_error_per_rank"] == pytest.approx([0.0, -0.4])
    assert out["memory_prediction_error"] == pytest.approx(120 / 200 - 1)
    assert out["predicted_reserved_memory_bytes_per_rank"] == [100 + 2**20, 120 + 2**20]
    assert out["predicted_memory_terms"]["embedding_weights_bytes"] == 120
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "memory model" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="anyrec.trainer.memcheck"):
        close = memory_check([_pred(110)], [100])
    assert close["memory_prediction_error"] == pytest.approx(0.1)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_nulls_where_nothing_is_measured_or_predicted():
    cpu = memory_check([_pred(100), _pred(100)], [None, None], log=False)  # a CPU backend measures nothing
    assert cpu["memory_prediction_error"] is None and cpu["memory_prediction_error_per_rank"] == [None, None]
    none = memory_check(None, [100], log=False)  # planner=simple predicts nothing
    assert none["memory_prediction_error"] is None and none["predicted_peak_memory_bytes_per_rank"] is None
    assert none["predicted_memory_terms"] is None and none["measured_peak_memory_bytes_per_rank"] == [100]


def test_data_source_bytes_count_each_storage_once_rounded():
    class Source:
        def __init__(self) -> None:
            self.table = torch.zeros(1000, dtype=torch.int64)  # 8000 bytes -> 8192
            self.view = self.table[:10]  # the same storage
            self.scratch = [torch.zeros(3), torch.zeros(200)]  # 512 + 1024
            self.name = "synthetic"

    assert resident_device_bytes([Source(), None], torch.device("cpu")) == 8192 + 512 + 1024
    assert resident_device_bytes([Source()], torch.device("meta")) == 0
