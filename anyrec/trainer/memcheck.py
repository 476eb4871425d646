"""Every run checks the plan's memory prediction: each rank's measured peak of device memory allocated
during training beside the planner's predicted peak for that rank (anyrec.planner.memory), where the
backend measures device memory (CUDA, ROCm, simdev; null on a CPU)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from anyrec.planner.memory import MemoryPrediction, alloc_bytes

logger = logging.getLogger(__name__)

MISS_WARN_FRACTION = 0.15  # a memory prediction off by more than this risks an out-of-memory plan


def resident_device_bytes(sources: list[Any], device: torch.device) -> int:
    """Bytes of device tensors the data sources keep as attributes (directly or in a list or tuple),
    each storage counted once and rounded as the allocator rounds it."""
    seen: set[int] = set()
    total = 0
    for source in sources:
        for value in vars(source).values() if source is not None and hasattr(source, "__dict__") else ():
            for t in value if isinstance(value, list | tuple) else (value,):
                if isinstance(t, torch.Tensor) and t.device == device:
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in seen:
                        seen.add(storage.data_ptr())
                        total += alloc_bytes(storage.nbytes())
    return total


def memory_check(predicted: list[MemoryPrediction] | None, measured: list[int | None],
                 log: bool = True, measured_reserved: list[int | None] | None = None) -> dict[str, object]:
    """The summary's keys: predicted and measured peak bytes per rank, each rank's relative error
    predicted / measured - 1, and the error of the largest (null where either is missing); logs them and
    warns past MISS_WARN_FRACTION. The same for reserved bytes (the allocator's segments: what a device's
    capacity limits) where `measured_reserved` is given."""
    pred = [p.allocated_bytes for p in predicted] if predicted else None
    per_rank = [None if pred is None or m is None or i >= len(pred) or not m else pred[i] / m - 1.0
                for i, m in enumerate(measured)]
    have = [m for m in measured if m]
    error = _largest_error(pred or [], measured)
    if log and have:
        mb = " ".join("-" if m is None else f"{m / 2**20:.1f}" for m in measured)
        pmb = " ".join(f"{p / 2**20:.1f}" for p in pred) if pred else "no prediction"
        logger.info("peak device memory: %s MiB measured per rank, %s MiB predicted by the plan", mb, pmb)
        if error is not None and abs(error) > MISS_WARN_FRACTION:
            logger.warning("the plan predicted a peak of %.1f MiB per rank but the largest measured %.1f MiB "
                           "(%+.0f%%): the memory model does not fit this job, so a plan near the memory "
                           "limit may not fit (docs/planning.md, memory terms)", max(pred) / 2**20,
                           max(have) / 2**20, error * 100)
    return {
        "predicted_peak_memory_bytes_per_rank": pred,
        "measured_peak_memory_bytes_per_rank": measured,
        "memory_prediction_error_per_rank": per_rank,
        "memory_prediction_error": error,
        "predicted_reserved_memory_bytes_per_rank": [p.reserved_bytes for p in predicted or []] or None,
        "measured_reserved_memory_bytes_per_rank": measured_reserved,
        "reserved_memory_prediction_error": _largest_error([p.reserved_bytes for p in predicted or []],
                                                           measured_reserved or []),
        "predicted_memory_terms": _largest_terms(predicted),
    }


def _largest_error(predicted: list[int], measured: list[int | None]) -> float | None:
    """The largest predicted over the largest measured, less 1 (null where either is missing)."""
    have = [m for m in measured if m]
    return max(predicted) / max(have) - 1.0 if predicted and have else None


def _largest_terms(predicted: list[MemoryPrediction] | None) -> dict[str, Any] | None:
    """The terms of the rank predicted to peak highest, and where its peak falls."""
    if not predicted:
        return None
    top = max(predicted, key=lambda p: p.allocated_bytes)
    return {**top.terms(), "peak_phase": top.peak_phase}
