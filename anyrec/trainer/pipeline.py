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

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DMPCollection
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist


class SparseDistPipeline(TrainPipelineSparseDist):
    """TrainPipelineSparseDist (batch i+1's input dist overlaps batch i's compute) with our hooks.
    `sync_every`: steps between a 2D model's averagings of its replicas (ParallelLayout.sync_every)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 fns: Any, sync_every: int = 1) -> None:
        # 2D (torchrec's DMPCollection): torchrec's pipeline averages the replicas after the backward of
        # every `sync_every`-th batch it runs; see ReplicaSync for the end of a chunk
        super().__init__(model, optimizer, device, execute_all_batches=True, custom_model_fwd=fns.forward,
                         dmp_collection_sync_interval_batches=sync_every)
        self._fns = fns  # the trainer: its forward, backward and optimizer_step
        self._replicas = ReplicaSync(model, sync_every)

    def progress(self, dataloader_iter: Iterator[Batch]) -> Any:
        try:
            return super().progress(dataloader_iter)
        except StopIteration:
            self._replicas.drained(self._model.training)
            raise

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


class ReplicaSync:
    """When a 2D model's replicas are averaged besides torchrec's pipeline schedule: after the backward of
    every `sync_every`-th step of the eager loop (the schedule torchrec's pipeline keeps), and whenever a
    chunk of training steps ends with unaveraged steps, so evaluation and checkpoints see one model."""

    def __init__(self, model: nn.Module, sync_every: int = 1) -> None:
        self._model = model if isinstance(model, DMPCollection) else None
        self._every = sync_every
        self._steps = 0  # training steps run
        self._unsynced = False

    def after_backward(self) -> None:
        """The eager loop's step: average on torchrec's schedule (batch index % sync_every == 0)."""
        if self._model is not None:
            if self._steps % self._every == 0:
                self._model.sync()
                self._unsynced = False
            else:
                self._unsynced = True
            self._steps += 1

    def drained(self, training: bool) -> None:
        """The step loop ran out of batches: average the replicas if a step since the last averaging left
        them apart (torchrec's pipeline: any step after the last multiple of `sync_every`)."""
        if self._model is None or not training:
            return
        if self._every > 1 or self._unsynced:
            self._model.sync()
            self._unsynced = False


class EagerLoop:
    """One batch at a time: copy, forward, backward, step (`trainer.pipeline=false`); `sync_every` as
    SparseDistPipeline's."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 fns: Any, sync_every: int = 1) -> None:
        self._model, self._optimizer, self._device, self._fns = model, optimizer, device, fns
        self._replicas = ReplicaSync(model, sync_every)

    def progress(self, batches: Iterator[Batch]) -> Any:
        try:
            batch = next(batches).to(self._device, non_blocking=True)
        except StopIteration:
            self._replicas.drained(self._model.training)
            raise
        if not self._model.training:
            return self._fns.forward(batch)[1]
        self._optimizer.zero_grad()
        loss, output = self._fns.forward(batch)
        self._fns.backward(loss)
        self._replicas.after_backward()
        self._fns.optimizer_step()
        return output
