"""What a trainer reads: its train and eval sources, their batch size per rank, and the checks every
batch (input validation) and every loss (non-finite guard) go through."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torchrec.datasets.utils import Batch

from anyrec.config import AnyrecConfig, TrainerConfig
from anyrec.data import build_source, resolve_batch_size
from anyrec.data.prefetch import Prefetched
from anyrec.models.family import ModelFamily
from anyrec.runtime.distributed import DistInfo
from anyrec.schema import BatchSchema
from anyrec.trainer.memcheck import resident_device_bytes
from anyrec.trainer.validate import InputValidator, NonFiniteGuard

logger = logging.getLogger(__name__)


@dataclass
class Inputs:
    """The sources and checks of one trainer. A streamed source (`WindowStream`) also bounds the steps
    (`steps`: its training windows' batches) and says when an evaluation is due (`eval_points`: after each
    training window, on the next one)."""

    batch_size: int  # per rank
    train: Any  # a data source: `iter_from(step, n)`
    eval: Any | None  # None without evaluation (trainer.evaluate=false; eval_steps=0 on a batch source)
    validator: InputValidator | None  # None with trainer.validate_inputs=false
    loss_guard: NonFiniteGuard
    eval_batches: Callable[[int], Iterable[Any]] | None = None  # step -> the batches evaluated after it
    steps: int | None = None  # the most training steps the source holds (None: unbounded)
    eval_points: tuple[int, ...] = ()  # steps after which an evaluation is due, whatever eval_every says
    facts: dict[str, Any] = field(default_factory=dict)  # what the source says of itself, for the summary


class WindowStream:
    """A stream of 1-day windows as the trainer's one loop reads it: the training batches of windows 0 ..
    W-2 back to back (step s is one batch of one window: a resume at any step sees what an uninterrupted
    run would), and after window T's last step an evaluation on every sample of window T + 1. `source`:
    `num_windows()`, `num_train_batches(w)`, `train_batch(w, i)`, `eval_batches(w)` (each the same count
    on every rank), `batch_size`."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.batch_size = source.batch_size
        windows = source.num_windows()
        if windows < 2:
            raise ValueError(f"a stream of {windows} window(s): training on window T and evaluating on "
                             f"T + 1 needs at least 2 (data.sequence.num_windows)")
        ends, total = [], 0
        for w in range(windows - 1):
            total += source.num_train_batches(w)
            ends.append(total)
        self.window_ends = tuple(ends)  # step after the last batch of training window w

    def window_at(self, step: int) -> tuple[int, int]:
        """(window, batch index in it) of the batch step `step` trains on."""
        w = bisect.bisect_right(self.window_ends, step)
        return w, step - (self.window_ends[w - 1] if w else 0)

    def iter_from(self, step: int = 0, num_steps: int | None = None) -> Iterator[Any]:
        """Training batches from step `step` on, `num_steps` of them (None: to the stream's end)."""
        end = self.window_ends[-1] if num_steps is None else min(step + num_steps, self.window_ends[-1])
        for s in range(step, end):
            yield self.source.train_batch(*self.window_at(s))

    def evaluated_window(self, step: int) -> int:
        """The window evaluated after step `step`: the one after the last window trained (wholly or not)."""
        return min(bisect.bisect_left(self.window_ends, step) + 1, len(self.window_ends))

    def eval_after(self, step: int) -> Iterator[Any]:
        """Every sample of the window that follows the training window step `step` ends (or is in)."""
        return iter(self.source.eval_batches(self.evaluated_window(step)))


def build_inputs(cfg: AnyrecConfig, family: ModelFamily, dist: DistInfo, device: torch.device,
                 pin: Callable[[Batch], Batch] | None) -> Inputs:
    """Sources for this rank of the data `family`'s model reads (prefetched file batches land in
    page-locked memory by `pin`, if given), checked against the family's batch schema."""
    tc = cfg.trainer
    family.check_data(cfg.data.name)
    data_cfg = resolve_batch_size(cfg.data, dist.world_size)
    schema = family.batch_schema(cfg.model)
    if schema.sequence:
        return sequence_inputs(cfg, schema, data_cfg.batch_size, dist, device)

    def source(split: str) -> Any:
        # skip_nonfinite: a training batch's non-finite dense rows are left to the loss guard
        return build_source(cfg.model, data_cfg, tc.seed, dist.rank, dist.world_size, split=split,
                            pin=pin, device=device,
                            skip_nonfinite=tc.skip_nonfinite and split == "train")

    validator = (InputValidator(list(schema.features), list(schema.table_rows), schema.num_dense, device,
                                dist, tc.skip_nonfinite)
                 if tc.validate_inputs else None)
    eval_source = source("eval") if evaluates_batches(tc) else None
    inputs = Inputs(data_cfg.batch_size, source("train"), eval_source, validator,
                    NonFiniteGuard(tc.skip_nonfinite, device, dist),
                    lambda _step: eval_source.iter_from(0, tc.eval_steps))
    for src in (inputs.train, inputs.eval):
        if isinstance(src, Prefetched) and validator is not None:
            src.prepare = validator.prepare  # value checks in the prefetch worker
    return inputs


def sequence_inputs(cfg: AnyrecConfig, schema: BatchSchema, batch_size: int, dist: DistInfo,
                    device: torch.device) -> Inputs:
    """A sequence model's stream (`data.name`: yambda_synthetic) for this rank: its windows' training
    batches, each window's evaluation on the next, and the generator's hidden-model AUC of each evaluated
    window (the ceiling a model can reach) for the summary."""
    from anyrec.data.yambda_synthetic import SyntheticYambda  # a source loads only when chosen
    from anyrec.sequence_schema import SequenceDataConfig, SequenceSchema  # a source loads only when chosen

    if cfg.data.name != "yambda_synthetic":
        raise ValueError(f"data={cfg.data.name}: the sequence trainer streams data=yambda_synthetic here")
    data = SequenceDataConfig.of(cfg.data.sequence, batch_size)
    source = SyntheticYambda(SequenceSchema(dict(zip(schema.features, schema.table_rows, strict=True))), data,
                             cfg.trainer.seed, dist.rank, dist.world_size)
    stream = WindowStream(source)
    if cfg.trainer.validate_inputs and dist.is_main:
        logger.info("input checks: sequence batches are checked by the model (lengths, targets)")
    guard = NonFiniteGuard(cfg.trainer.skip_nonfinite, device, dist)
    if not cfg.trainer.evaluate:  # the steps only: no window is evaluated, so no hidden AUC is drawn
        return Inputs(batch_size, stream, None, None, guard, None, stream.window_ends[-1],
                      facts={"hidden_auc_by_window": {}})
    hidden = {str(w): source.hidden_auc(w) for w in range(1, len(stream.window_ends) + 1)}
    return Inputs(batch_size, stream, stream, None, guard, stream.eval_after, stream.window_ends[-1],
                  stream.window_ends, {"hidden_auc_by_window": hidden})


def evaluates_batches(tc: TrainerConfig) -> bool:
    """Whether a batch source's job evaluates: `trainer.evaluate` and at least one batch per evaluation."""
    return tc.evaluate and tc.eval_steps > 0


def host_estimate_of_resident_bytes(cfg: AnyrecConfig, dist: DistInfo) -> int:
    """What a rank's data sources keep on its device, measured on the same sources built on the host (for
    planning without the device: `anyrec-plan`). Synthetic data generates batches on the device from
    tables it keeps there; file sources keep nothing there between batches (the batch term counts those)."""
    if cfg.data.name != "synthetic":
        return 0
    from anyrec.data.synthetic import SyntheticCriteo  # a source loads only when chosen

    data, host = resolve_batch_size(cfg.data, dist.world_size), torch.device("cpu")
    splits = ("train", "eval") if evaluates_batches(cfg.trainer) else ("train",)
    sources = [SyntheticCriteo(cfg.model, data, cfg.trainer.seed, dist.rank, dist.world_size, split=s,
                               device=host) for s in splits]
    return resident_device_bytes(sources, host)
