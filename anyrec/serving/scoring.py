"""Scoring batches with a loaded artifact: torchrec `Batch`es (what anyrec's data sources make) become the
program's plain tensors, every batch is checked against the artifact's model before it is scored, and the
trainer's metrics are kept over everything scored.

Legend: B batch, I dense features, F sparse features.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torchrec.datasets.utils import Batch

from anyrec.config import IdLayout, ModelConfig
from anyrec.runtime.distributed import ONE_PROCESS
from anyrec.schema import feature_names
from anyrec.serving.model import ScoringInputs
from anyrec.trainer.metrics import EvalMetrics
from anyrec.trainer.validate import InputValidator, flush_checks


def batch_inputs(batch: Batch, id_layout: IdLayout, device: torch.device) -> ScoringInputs:
    """A Batch's features as a scoring call takes them: dense, and per feature its ids and its bags (B + 1
    offsets or B lengths), read from the KeyedJaggedTensor's key-major layout without torchrec's ops."""
    kjt = batch.sparse_features
    num_features, size = len(kjt.keys()), batch.dense_features.shape[0]
    lengths_FB = kjt.lengths().long().view(num_features, size)
    ids = list(torch.split(kjt.values().long(), lengths_FB.sum(dim=1).tolist()))
    if id_layout == IdLayout.lengths:
        bags = list(lengths_FB.unbind(0))
    else:
        offsets_FB1 = torch.cat([lengths_FB.new_zeros(num_features, 1), lengths_FB.cumsum(dim=1)], dim=1)
        bags = list(offsets_FB1.unbind(0))
    return ScoringInputs(batch.dense_features.to(device).float(), [v.to(device) for v in ids],
                         [b.to(device) for b in bags])


@dataclass
class ScoreRun:
    """What a scoring pass produced: click probabilities in order, the metrics, counts and time."""

    probs: list[torch.Tensor] = field(default_factory=list)
    samples: int = 0
    model_s: float = 0.0  # seconds in the program's calls
    wall_s: float = 0.0  # seconds of the whole pass (reading and checking the data included)
    metrics: dict[str, float] | None = None


def score_batches(program: Callable[..., torch.Tensor], model: ModelConfig, id_layout: IdLayout,
                  batches: Iterable[Batch], device: torch.device,
                  on_batch: Callable[[int], object] | None = None) -> ScoreRun:
    """Score every batch with `program` (an artifact's `ScoringProgram` or module); each is checked first
    (feature count, dense width, ids within their tables: ValueError in one line naming the batch),
    labels feed the trainer's EvalMetrics; `on_batch(samples)` after each batch (a progress bar)."""
    validator = InputValidator(feature_names(len(model.table_rows)), list(model.table_rows),
                               model.num_dense_features, device, ONE_PROCESS)
    metrics = EvalMetrics(device)
    run, start = ScoreRun(), time.perf_counter()
    with torch.no_grad():
        for i, batch in enumerate(batches):
            validator(batch, i, "batch")
            flush_checks(validator, None)  # before the lookup: a bad id would index outside its table
            inputs = batch_inputs(batch, id_layout, device)
            t = time.perf_counter()
            logits_B = program(*inputs.args())
            run.model_s += time.perf_counter() - t
            metrics.update(logits_B, batch.labels.to(device))
            run.probs.append(torch.sigmoid(logits_B.float()).cpu())
            run.samples += logits_B.shape[0]
            if on_batch is not None:
                on_batch(logits_B.shape[0])
    run.wall_s = time.perf_counter() - start
    run.metrics = metrics.compute() if run.samples else None
    return run
