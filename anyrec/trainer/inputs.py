"""What a trainer reads: its train and eval sources, their batch size per rank, and the checks every
batch (input validation) and every loss (non-finite guard) go through."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchrec.datasets.utils import Batch

from anyrec.config import AnyrecConfig
from anyrec.data import build_source, resolve_batch_size
from anyrec.data.prefetch import Prefetched
from anyrec.models.family import ModelFamily
from anyrec.trainer.distributed import DistInfo
from anyrec.trainer.memcheck import resident_device_bytes
from anyrec.trainer.validate import InputValidator, NonFiniteGuard


@dataclass
class Inputs:
    """The sources and checks of one trainer."""

    batch_size: int  # per rank
    train: Any  # a data source: `iter_from(step, n)`, `batch(step)`
    eval: Any | None  # None without evaluation (trainer.eval_steps=0)
    validator: InputValidator | None  # None with trainer.validate_inputs=false
    loss_guard: NonFiniteGuard


def build_inputs(cfg: AnyrecConfig, family: ModelFamily, dist: DistInfo, device: torch.device,
                 pin: Callable[[Batch], Batch] | None) -> Inputs:
    """Sources for this rank of the data `family`'s model reads (prefetched file batches land in
    page-locked memory by `pin`, if given), checked against the family's batch schema."""
    tc = cfg.trainer
    family.check_data(cfg.data.name)
    data_cfg = resolve_batch_size(cfg.data, dist.world_size)

    def source(split: str) -> Any:
        # skip_nonfinite: a training batch's non-finite dense rows are left to the loss guard
        return build_source(cfg.model, data_cfg, tc.seed, dist.rank, dist.world_size, split=split,
                            pin=pin, device=device,
                            skip_nonfinite=tc.skip_nonfinite and split == "train")

    schema = family.batch_schema(cfg.model)
    validator = (InputValidator(list(schema.features), list(schema.table_rows), schema.num_dense, device,
                                dist, tc.skip_nonfinite)
                 if tc.validate_inputs else None)
    inputs = Inputs(data_cfg.batch_size, source("train"), source("eval") if tc.eval_steps > 0 else None,
                    validator, NonFiniteGuard(tc.skip_nonfinite, device, dist))
    for src in (inputs.train, inputs.eval):
        if isinstance(src, Prefetched) and validator is not None:
            src.prepare = validator.prepare  # value checks in the prefetch worker
    return inputs



def host_estimate_of_resident_bytes(cfg: AnyrecConfig, dist: DistInfo) -> int:
    """What a rank's data sources keep on its device, measured on the same sources built on the host (for
    planning without the device: `anyrec-plan`). Synthetic data generates batches on the device from
    tables it keeps there; file sources keep nothing there between batches (the batch term counts those)."""
    if cfg.data.name != "synthetic":
        return 0
    from anyrec.data.synthetic import SyntheticCriteo  # a source loads only when chosen

    data, host = resolve_batch_size(cfg.data, dist.world_size), torch.device("cpu")
    splits = ("train", "eval") if cfg.trainer.eval_steps > 0 else ("train",)
    sources = [SyntheticCriteo(cfg.model, data, cfg.trainer.seed, dist.rank, dist.world_size, split=s,
                               device=host) for s in splits]
    return resident_device_bytes(sources, host)
