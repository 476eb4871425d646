"""Data sources: synthetic Criteo-shaped batches and the Criteo TSV / npy / multi-hot npz files.

Every source has `batch(step)` (a pure function of step and rank, which makes resumes exact) and
`iter_from(step, num_steps)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch
from torchrec.datasets.utils import Batch

from anyrec.config import DataConfig, ModelConfig
from anyrec.data.prefetch import Prefetched

SOURCES = ("synthetic", "criteo_tsv", "criteo_npy", "criteo_multihot")


class DataSource(Protocol):
    """What the trainer needs from a source of batches."""

    batch_size: int

    def batch(self, step: int) -> Batch: ...

    def iter_from(self, step: int = 0, num_steps: int | None = None): ...


def resolve_batch_size(data: DataConfig, world_size: int) -> DataConfig:
    """`data` with the per-rank batch size fixed (from `global_batch_size` when that is set); the sizes'
    ranges are the typed config's (anyrec.config.RANGES), their relation to the world size is checked here."""
    if data.global_batch_size is None:
        return data
    if data.global_batch_size % world_size:
        raise ValueError(f"data.global_batch_size={data.global_batch_size} must be a positive "
                         f"multiple of the world size {world_size}")
    return dataclasses.replace(data, batch_size=data.global_batch_size // world_size)


def build_source(model: ModelConfig, data: DataConfig, seed: int, rank: int, world_size: int,
                 split: str, pin: Callable[[Batch], Batch] | None = None, device: torch.device | None = None,
                 skip_nonfinite: bool = False) -> DataSource:
    """The source named by `data.name` for one rank and split ("train" or "eval"). Synthetic batches are made
    on `device` (the training device; default CPU): on an accelerator in the step (asynchronous kernels), on a
    CPU `data.prefetch` batches ahead by background threads at idle priority (they use the cores the step
    leaves free). File sources always make `data.prefetch` batches ahead (into pinned memory by
    `pin`, the backend's `Backend.pin`), at idle priority when the training device is a CPU. `skip_nonfinite`
    (trainer.skip_nonfinite): file sources let NaN/inf dense values of training rows through for the trainer
    to skip their step."""
    on_cpu = device is None or torch.device(device).type == "cpu"
    if data.name == "synthetic":
        from anyrec.data.synthetic import SyntheticCriteo  # a source loads only when chosen

        source = SyntheticCriteo(model, data, seed, rank, world_size, split=split, device=device)
        ahead = on_cpu and data.prefetch  # on an accelerator the batch is made in the step
        return Prefetched(source, data.prefetch, data.prefetch_workers, idle=True) if ahead else source
    if data.name in ("criteo_tsv", "criteo_npy", "criteo_multihot"):
        from anyrec.data.criteo import CriteoSource  # a source loads only when chosen (numpy, iopath)

        source = CriteoSource(model, data, rank, world_size, split=split, skip_nonfinite=skip_nonfinite)
        if not data.prefetch:
            return source
        return Prefetched(source, data.prefetch, data.prefetch_workers, pin, idle=on_cpu)
    raise ValueError(f"unknown data source {data.name!r}; choose one of {', '.join(SOURCES)}")
