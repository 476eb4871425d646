"""The Trainer: build a sharded DLRM from a config, train it, evaluate it, report a summary.

Methods read in order: init_distributed, build, train_step, train, evaluate, close.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections import deque
from typing import Any

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from anyrec.backends import Backend, get_backend, resolve_hardware
from anyrec.config import AnyrecConfig
from anyrec.data.synthetic import SyntheticCriteo
from anyrec.models.dlrm import DLRM, build_model
from anyrec.trainer.distributed import DistInfo, all_reduce_mean, destroy_distributed, init_distributed
from anyrec.trainer.metrics import AUC
from anyrec.trainer.optim import dense_optimizer, embedding_optimizer

logger = logging.getLogger(__name__)

EBC_PATH = "model.sparse_arch"  # where the EmbeddingBagCollection sits inside DLRMTrain


class DLRMTrain(nn.Module):
    """A DLRM plus its loss, taking a whole Batch (the shape torchrec's train pipelines expect)."""

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        logits_B = self.model(batch.dense_features, batch.sparse_features)
        loss = self.loss_fn(logits_B, batch.labels)
        return loss, (logits_B.detach(), batch.labels)


class Trainer:
    """Owns the backend, the process group, the sharded model, its optimizers and the data."""

    def __init__(self, cfg: AnyrecConfig, plan: ShardingPlan | None = None) -> None:
        self.cfg = cfg
        self.backend: Backend = get_backend(cfg.backend.name)
        self.dist: DistInfo = self.init_distributed()
        self.device = self.backend.device(self.dist.local_rank)
        self.plan_override = plan
        self.step = 0
        self.build()

    def init_distributed(self) -> DistInfo:
        info = init_distributed(self.backend)
        if self.backend.device_type == "cpu" and info.local_world_size > 1:
            # Share the host's cores between the local ranks instead of oversubscribing.
            import os

            torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world_size))
        return info

    def build(self) -> None:
        """Model (tables on meta, then sharded by DMP), plan, optimizers and data."""
        cfg = self.cfg
        torch.manual_seed(cfg.trainer.seed)
        model = build_model(cfg.model, self.device, ebc_device=torch.device("meta"))
        # Embedding optimizer fused into the backward pass (TBE updates rows in place).
        opt_cls, opt_kwargs = embedding_optimizer(cfg.optim)
        apply_optimizer_in_backward(opt_cls, model.sparse_arch.parameters(), opt_kwargs)
        train_module = DLRMTrain(model)
        self.sharding_plan = self.plan_override or self._plan(model)
        self.model = DistributedModelParallel(
            train_module, device=self.device, plan=self.sharding_plan, sharders=self._sharders(),
        )
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(self.model.named_parameters())),
            lambda params: dense_optimizer(cfg.optim, params),
        )
        self.optimizer = CombinedOptimizer([("dense", dense), ("sparse", self.model.fused_optimizer)])
        self.train_data = SyntheticCriteo(cfg.model, cfg.data, cfg.trainer.seed, self.dist.rank,
                                          self.dist.world_size, split="train")
        self.eval_data = SyntheticCriteo(cfg.model, cfg.data, cfg.trainer.seed, self.dist.rank,
                                         self.dist.world_size, split="eval")
        if self.dist.is_main:
            logger.info("backend: %s", self.backend.describe())
            logger.info("kernels: %s", ", ".join(
                f"{op}={impl}" for op, impl in self.backend.select_kernels(cfg.backend).items()))
            logger.info("torchrec sharding plan:\n%s", self.sharding_plan)

    @property
    def embedding_kernel(self) -> str:
        """The `embedding` op's implementation the backend selected (fbgemm | triton | torch)."""
        return self.backend.select_kernels(self.cfg.backend)["embedding"]

    def _sharders(self) -> list:
        from anyrec.backends.sharders import embedding_sharder

        return [embedding_sharder(self.embedding_kernel)]

    def _plan(self, model: DLRM) -> ShardingPlan:
        """The sharding plan from the configured planner (co-design by default)."""
        from anyrec.planner.job import plan_job
        from anyrec.planner.simple import simple_table_shardings, to_sharding_plan

        ebc, info = model.sparse_arch, self.dist
        if self.cfg.planner.name == "simple":
            shardings = simple_table_shardings(ebc.embedding_bag_configs(), info.world_size,
                                               force=self.cfg.planner.sharding)
            from anyrec.backends.sharders import compute_kernel

            return to_sharding_plan(ebc, shardings, EBC_PATH, info.world_size, info.local_world_size,
                                    self.backend.device_type, sharder=self._sharders()[0],
                                    compute_kernel=compute_kernel(self.embedding_kernel))
        if self.cfg.planner.name != "codesign":
            raise ValueError(f"unknown planner {self.cfg.planner.name!r}; choose codesign or simple")
        device = resolve_hardware(self.cfg.hardware.sku, self.cfg.hardware.spec, self.backend)
        result = plan_job(self.cfg, device, info.world_size, info.local_world_size, self.cfg.data.batch_size,
                          compute_device=self.backend.device_type, kernel=self.embedding_kernel)
        if info.is_main:
            logger.info("co-design plan:\n%s", result.report(advice=False))
        return result.to_sharding_plan(EBC_PATH, module=ebc, compute_device=self.backend.device_type)

    def _to_device(self, batch: Batch) -> Batch:
        return batch.to(self.device, non_blocking=True)

    def train_step(self, batch: Batch) -> torch.Tensor:
        """One step: forward, backward (embedding rows update inside it), dense optimizer step."""
        self.model.train()
        self.optimizer.zero_grad()
        loss, _ = self.model(self._to_device(batch))
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return loss.detach()

    def train(self) -> dict[str, Any]:
        """Run `trainer.steps` steps, evaluate, and return the summary (identical on every rank)."""
        tc = self.cfg.trainer
        window: deque[float] = deque(maxlen=max(1, tc.log_every))
        bar = None
        if self.dist.is_main and tc.progress:
            from tqdm import tqdm

            bar = tqdm(total=tc.steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
        last_loss = math.nan
        start = time.perf_counter()
        for batch in self.train_data.iter_from(self.step, tc.steps - self.step):
            loss = self.train_step(batch)
            last_loss = float(loss)
            window.append(last_loss)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{last_loss:.4f}", refresh=False)
            if tc.log_every and self.step % tc.log_every == 0 and self.dist.is_main:
                logger.info("step %d loss %.5f", self.step, sum(window) / len(window))
        self.backend.synchronize()
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.close()
        final_loss, train_loss = all_reduce_mean(
            [last_loss, sum(window) / max(1, len(window))], self.device)
        eval_auc = self.evaluate() if tc.eval_steps > 0 else None
        samples = tc.steps * self.cfg.data.batch_size * self.dist.world_size
        return {
            "steps": self.step,
            "samples_per_s": samples / elapsed if elapsed > 0 else None,
            "train_loss": train_loss,
            "final_loss": final_loss,
            "eval_auc": eval_auc,
            "backend": self.backend.name,
            "embedding_kernel": self.embedding_kernel,
            "world_size": self.dist.world_size,
            "elapsed_s": elapsed,
        }

    @torch.no_grad()
    def evaluate(self) -> float:
        """AUC over `trainer.eval_steps` held-out batches per rank, gathered over all ranks."""
        self.model.eval()
        auc = AUC(self.device)
        for batch in self.eval_data.iter_from(0, self.cfg.trainer.eval_steps):
            _, (logits_B, labels_B) = self.model(self._to_device(batch))
            auc.update(torch.sigmoid(logits_B.float()), labels_B)
        value = auc.compute()
        self.model.train()
        return value

    def close(self) -> None:
        """Release the sharded model before the process group goes (see destroy_distributed)."""
        for name in ("optimizer", "model", "train_data", "eval_data"):
            if hasattr(self, name):
                delattr(self, name)
        destroy_distributed()
