"""Scoring batches with a loaded artifact: a batch of the family's data (a torchrec `Batch`, a
`SequenceBatch`) becomes the program's plain tensors by the family's export signature, every batch is
checked before it is scored, and the trainer's metrics are kept over everything scored.

Checks: a pooled family's batches go through the trainer's own input checks (`InputValidator`: feature
count, dense width, ids within their tables), as training checks them; a sequence family's batches, which
the trainer leaves to its model, through the signature's check of the program's call (shapes, lengths,
targets, ids within their tables), the one every call of `ScoringProgram` makes.

Legend: B batch (samples; a sequence family: targets), I dense features, F sparse features.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from anyrec.config import IdLayout, ModelConfig
from anyrec.models.family import ModelFamily
from anyrec.runtime.distributed import ONE_PROCESS
from anyrec.trainer.metrics import EvalMetrics
from anyrec.trainer.validate import InputValidator, flush_checks


@dataclass
class ScoreRun:
    """What a scoring pass produced: click probabilities in order, the metrics, counts and time."""

    probs: list[torch.Tensor] = field(default_factory=list)
    samples: int = 0  # scores (a sequence family: targets)
    batches: int = 0  # batches scored
    model_s: float = 0.0  # seconds in the program's calls
    wall_s: float = 0.0  # seconds of the whole pass (reading and checking the data included)
    metrics: dict[str, float] | None = None


def score_batches(program: Callable[..., torch.Tensor], family: ModelFamily, model: ModelConfig,
                  id_layout: IdLayout, batches: Iterable[Any], device: torch.device,
                  on_batch: Callable[[int], object] | None = None) -> ScoreRun:
    """Score every batch with `program` (an artifact's `ScoringProgram` or module) of `family`'s `model`;
    each is checked first (ValueError in one line naming the batch), labels feed the trainer's EvalMetrics;
    `on_batch(scores)` after each batch (a progress bar)."""
    export = family.export_signature()
    schema = family.batch_schema(model)
    validator = (None if schema.sequence else
                 InputValidator(list(schema.features), list(schema.table_rows), schema.num_dense, device,
                                ONE_PROCESS))
    check = export.check(model, id_layout)
    metrics = EvalMetrics(device, ONE_PROCESS)  # one process scores every rank's rows
    run, start = ScoreRun(), time.perf_counter()
    with torch.no_grad():
        for i, batch in enumerate(batches):
            if validator is not None:
                validator(batch, i, "batch")
                flush_checks(validator, None)  # before the lookup: a bad id would index outside its table
            try:
                args, labels = export.batch_args(batch, id_layout, device)
                if validator is None:
                    check(args)  # whichever program scores it (a module's graph checks no values)
            except ValueError as e:
                raise ValueError(f"bad input at batch {i + 1}: {e}") from None
            t = time.perf_counter()
            logits = program(*args)
            run.model_s += time.perf_counter() - t
            metrics.update(logits, labels.to(device))
            run.probs.append(torch.sigmoid(logits.float()).cpu())
            run.samples += logits.shape[0]
            run.batches += 1
            if on_batch is not None:
                on_batch(logits.shape[0])
    run.wall_s = time.perf_counter() - start
    run.metrics = metrics.compute() if run.samples else None
    return run
