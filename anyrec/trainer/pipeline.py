"""How steps run: torchrec's TrainPipelineSparseDist, or a plain eager loop with the same interface.

Both call the trainer's three step functions, so guards (non-finite loss), gradient clipping and
autocast are the same either way: `forward(batch) -> (loss, output)`, `backward(loss)` (may skip the
backward, which also skips the fused embedding update) and `optimizer_step()`. `progress(batches)`
runs one step (training mode) or one forward (eval mode) and raises StopIteration when `batches` is
exhausted; afterwards the pipeline is empty and takes a new iterator. Training steps call it from
`Trainer.run_steps` only; evaluation goes through `predictions`. On CPU the sparse-dist pipeline gives
bit-identical weights to the eager loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

# torchrec logs at INFO each time an iterator runs out (once per chunk of steps here): keep it quiet.
logging.getLogger("torchrec.distributed.train_pipeline.train_pipelines").setLevel(logging.WARNING)


class SparseDistPipeline(TrainPipelineSparseDist):
    """TrainPipelineSparseDist (batch i+1's input dist overlaps batch i's compute) with our hooks."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 fns: Any) -> None:
        super().__init__(model, optimizer, device, execute_all_batches=True, custom_model_fwd=fns.forward)
        self._fns = fns  # the trainer: its forward, backward and optimizer_step

    def _backward(self, losses: torch.Tensor) -> None:
        self._fns.backward(losses)

    def _optimizer_step(self) -> None:
        self._fns.optimizer_step()


def predictions(pipeline: SparseDistPipeline | EagerLoop, batches: Iterator[Batch]) -> Iterator[Any]:
    """In eval mode: the model's output for every batch of `batches`, through the pipeline (forward only)."""
    while True:
        try:
            yield pipeline.progress(batches)
        except StopIteration:
            return


class EagerLoop:
    """One batch at a time: copy, forward, backward, step (`trainer.pipeline=false`)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 fns: Any) -> None:
        self._model, self._optimizer, self._device, self._fns = model, optimizer, device, fns

    def progress(self, batches: Iterator[Batch]) -> Any:
        batch = next(batches).to(self._device, non_blocking=True)
        if not self._model.training:
            return self._fns.forward(batch)[1]
        self._optimizer.zero_grad()
        loss, output = self._fns.forward(batch)
        self._fns.backward(loss)
        self._fns.optimizer_step()
        return output
