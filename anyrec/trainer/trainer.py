"""The Trainer: build a sharded DLRM from a config, train it, evaluate it, checkpoint it, report.

Methods read in order: init_distributed, build, train_step, train, evaluate, state_dict /
load_state_dict, close. Steps run through torchrec's TrainPipelineSparseDist (or an eager loop),
with the embedding optimizer fused into the backward and the dense one stepped after it.
Planning lives in `planning.py`, the weight fingerprint in `fingerprint.py`.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from anyrec.backends import Backend, get_backend
from anyrec.backends.dispatch import embedding_impl
from anyrec.backends.sparse_ops import install as install_sparse_ops
from anyrec.config import AnyrecConfig
from anyrec.data import build_source, resolve_batch_size
from anyrec.data.prefetch import Prefetched
from anyrec.kernels.ebc import TritonEBCOptimizer
from anyrec.kernels.replicated import ReplicatedTableOptimizer
from anyrec.models.dlrm import DLRM, build_model, feature_names, table_configs
from anyrec.models.init import init_model
from anyrec.planner.types import Perf
from anyrec.trainer.breakdown import (
    StepProfiler,
    breakdown_window,
    format_breakdown,
    gather_breakdown,
    phase,
    predicted_phases,
)
from anyrec.trainer.checkpoint import CheckpointManager
from anyrec.trainer.distributed import DistInfo, all_reduce_mean, destroy_distributed, init_distributed
from anyrec.trainer.fingerprint import weights_fingerprint
from anyrec.trainer.lineage import identity_config
from anyrec.trainer.metrics import EvalMetrics
from anyrec.trainer.optim import (
    apply_embedding_optimizer,
    check_embedding_optimizer,
    check_embedding_weight_decay,
    dense_optimizer,
    embedding_optimizer_config,
)
from anyrec.trainer.perfcheck import StepTimer, gather_step_s, prediction_check, warmup_steps
from anyrec.trainer.pipeline import EagerLoop, SparseDistPipeline, StepFunctions
from anyrec.trainer.planning import sharders, shared_plan
from anyrec.trainer.reporting import LossWindow, MetricWriter, progress_bar
from anyrec.trainer.schedule import WarmupPolyDecay, set_lr
from anyrec.trainer.shutdown import StopRequest, peers_met
from anyrec.trainer.validate import InputValidator, NonFiniteGuard, flush_checks

logger = logging.getLogger(__name__)

EBC_PATH = "model.sparse_arch"  # where the EmbeddingBagCollection sits inside DLRMTrain
PRECISIONS = ("auto", "bf16", "fp32")


class DLRMTrain(nn.Module):
    """A DLRM plus its loss, taking a whole Batch (the shape torchrec's train pipelines expect)."""

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        logits_B = self.model(batch.dense_features, batch.sparse_features)
        loss = self.loss_fn(logits_B.float(), batch.labels)
        return loss, (logits_B.detach(), batch.labels)



@dataclass
class _Run:
    """What one `train()` call accumulates between its steps."""

    start_step: int
    window: LossWindow  # the last `log_every` losses, on the device
    bar: Any  # a tqdm bar or None
    train_time_s: float = 0.0  # in finished chunks
    chunk_start: float = 0.0  # perf_counter() at the start of the running chunk
    last_checkpoint: Path | None = None
    timer: StepTimer | None = None  # seconds per step after warm-up, for the prediction check
    profile_at: int | None = None  # the step where the breakdown's profiled window starts
    profiler: StepProfiler | None = None  # while the window runs


class Trainer:
    """Owns the backend, the process group, the sharded model, its optimizers, data and checkpoints."""

    def __init__(self, cfg: AnyrecConfig, plan: ShardingPlan | None = None) -> None:
        self.cfg = cfg
        self.backend: Backend = get_backend(cfg.backend.name)
        self.dist: DistInfo = self.init_distributed()
        self.device = self.backend.device(self.dist.local_rank)
        self.plan_override = plan
        self.step = 0
        self.skipped_batches = 0
        self.resumed_from: int | None = None
        self._last_loss = torch.tensor(math.nan)
        self.predicted_perf: Perf | None = None  # the plan's slowest rank, where a planner predicted one
        self.build()
        self.checkpoints = (CheckpointManager(cfg.trainer.checkpoint, self.signature(), self.dist.is_main,
                                              identity_config(cfg)) if cfg.trainer.checkpoint.dir else None)
        start = self.checkpoints.start() if self.checkpoints is not None else None  # locks the dir
        if start is not None:
            self.load_checkpoint(start)

    def init_distributed(self) -> DistInfo:
        info = init_distributed(self.backend, self.cfg.trainer.collective_timeout_s,
                                self.cfg.trainer.peer_timeout_s)
        self.backend.bind_local_rank(info.local_rank, info.local_world_size, self.cfg.backend.bind_cores)
        return info

    # ---- build ------------------------------------------------------------------------------------

    def build(self) -> None:
        """Model (tables on meta, then sharded by DMP), plan, optimizers, step pipeline and data."""
        tc = self.cfg.trainer
        self._check_trainer_config()
        self.autocast = tc.mixed_precision == "bf16" or (
            tc.mixed_precision == "auto" and self.backend.device_type != "cpu")
        self.schedule = WarmupPolyDecay.from_config(self.cfg.optim)
        torch.manual_seed(tc.seed)
        check_embedding_weight_decay(self.cfg.optim, self.embedding_kernel)
        # One device with anyrec's own TBE: no sharding, so no input distribution (whose KJT
        # permutes need FBGEMM ops) and no FBGEMM kernel anywhere in the step. Naming the sparse ops'
        # implementation (backend.sparse_ops=portable|fbgemm) asks for the sharded path instead.
        self.unsharded = (self.dist.world_size == 1
                          and embedding_impl(self.embedding_kernel).unsharded_builder is not None
                          and self.cfg.backend.sparse_ops == "auto")
        if self.unsharded:
            self._build_unsharded()
        else:
            self._build_sharded()
        # the same initial weights whatever the kernel, plan, world size or device
        init_model(self.model, table_configs(self.cfg.model), tc.seed, EBC_PATH)
        self._build_optimizers_and_pipeline()
        self._build_data()
        self.writer = MetricWriter(tc.run_dir, self.dist.is_main, tc.tensorboard)
        if self.dist.is_main:
            self._log_setup()

    def _check_trainer_config(self) -> None:
        tc = self.cfg.trainer
        if tc.mixed_precision not in PRECISIONS:
            raise ValueError(f"trainer.mixed_precision must be one of {PRECISIONS}, "
                             f"got {tc.mixed_precision!r}")
        if tc.steps < 0 or tc.eval_steps < 0 or tc.eval_every < 0 or tc.breakdown_steps < 0:
            raise ValueError("trainer.steps, eval_steps, eval_every and breakdown_steps must be >= 0")
        if tc.breakdown_steps:
            breakdown_window(tc.steps, warmup_steps(tc.steps), tc.breakdown_steps)  # room for it

    def _build_sharded(self) -> None:
        """Tables on the meta device, placed by the plan and allocated by DistributedModelParallel."""
        install_sparse_ops(self.backend, self.cfg.backend.sparse_ops)  # torchrec's input/output dist ops
        model = build_model(self.cfg.model, self.device, ebc_device=torch.device("meta"),
                            kernels=self.backend.select_kernels(self.cfg.backend))
        # Embedding optimizer fused into the backward pass (TBE updates rows in place).
        apply_embedding_optimizer(model.sparse_arch.parameters(), self.cfg.optim)
        self.sharding_plan, self.predicted_perf = (self.plan_override, None) if self.plan_override else \
            shared_plan(self.cfg, self.backend, self.dist, model, EBC_PATH, self.embedding_kernel)
        check_embedding_optimizer(self.cfg.optim, self.embedding_kernel, self.device.type, self.sharding_plan)
        self.model = DistributedModelParallel(
            DLRMTrain(model), device=self.device, plan=self.sharding_plan,
            sharders=sharders(self.embedding_kernel),
        )
        self.fused_optimizer = self.model.fused_optimizer

    def _build_unsharded(self) -> None:
        """All tables on this device in anyrec's TritonEmbeddingBagCollection (Triton or torch ops)."""
        ebc = embedding_impl(self.embedding_kernel).build_unsharded(
            table_configs(self.cfg.model), optimizer=embedding_optimizer_config(self.cfg.optim),
            device=self.device)
        self.sharding_plan = None
        self.model = DLRMTrain(DLRM(self.cfg.model, ebc, device=self.device,
                                    kernels=self.backend.select_kernels(self.cfg.backend)))
        self.fused_optimizer = TritonEBCOptimizer(ebc, prefix=f"{EBC_PATH}.")

    def _build_optimizers_and_pipeline(self) -> None:
        """The dense optimizer beside the fused one, and the loop that runs a step."""
        dense_params = dict(in_backward_optimizer_filter(self.model.named_parameters()))
        # replicated (data-parallel) tables train by the embedding rule and lr, like sharded ones
        tables = {n: p for n, p in dense_params.items() if n.startswith(f"{EBC_PATH}.")}
        dense_params = {n: p for n, p in dense_params.items() if n not in tables}
        self.dense_params = list(dense_params.values())
        self.dense_optimizer = KeyedOptimizerWrapper(
            dense_params, lambda params: dense_optimizer(self.cfg.optim, params))
        optimizers = [("dense", self.dense_optimizer), ("sparse", self.fused_optimizer)]
        self.replicated_optimizer = None
        if tables:
            rule = embedding_optimizer_config(self.cfg.optim)
            self.replicated_optimizer = KeyedOptimizerWrapper(
                tables, lambda params: ReplicatedTableOptimizer(params, rule))
            optimizers.append(("replicated", self.replicated_optimizer))
        self.optimizer = CombinedOptimizer(optimizers)
        fns = StepFunctions(self._forward, self._backward, self._optimizer_step)
        loop = SparseDistPipeline if self.cfg.trainer.pipeline and not self.unsharded else EagerLoop
        self.pipeline = loop(self.model, self.optimizer, self.device, fns)

    def _build_data(self) -> None:
        cfg, tc = self.cfg, self.cfg.trainer
        data_cfg = resolve_batch_size(cfg.data, self.dist.world_size)
        self.batch_size = data_cfg.batch_size
        # Prefetched file batches land in page-locked memory where there is a device to copy them to.
        pin = self.backend.device_type != "cpu"
        self.train_data = build_source(cfg.model, data_cfg, tc.seed, self.dist.rank, self.dist.world_size,
                                       split="train", pin_memory=pin, device=self.device,
                                       skip_nonfinite=tc.skip_nonfinite)
        self.eval_data = (build_source(cfg.model, data_cfg, tc.seed, self.dist.rank, self.dist.world_size,
                                       split="eval", pin_memory=pin, device=self.device)
                          if tc.eval_steps > 0 else None)
        self.loss_guard = NonFiniteGuard(tc.skip_nonfinite, self.device)
        self.validator = (InputValidator(feature_names(len(cfg.model.table_rows)), list(cfg.model.table_rows),
                                         cfg.model.num_dense_features, self.device, tc.skip_nonfinite)
                          if tc.validate_inputs else None)
        for source in (self.train_data, self.eval_data):
            if isinstance(source, Prefetched) and self.validator is not None:
                source.prepare = self.validator.prepare  # value checks in the prefetch worker

    def _log_setup(self) -> None:
        logger.info("backend: %s", self.backend.describe())
        logger.info("kernels: %s", ", ".join(
            f"{op}={impl}" for op, impl in self.backend.select_kernels(self.cfg.backend).items()))
        if self.unsharded:
            logger.info("one device, %s embedding kernel: tables unsharded (no input distribution)",
                        self.embedding_kernel)
        else:
            logger.info("torchrec sharding plan:\n%s", self.sharding_plan)
        logger.info("step loop: %s, precision: %s, batch %d per rank", type(self.pipeline).__name__,
                    "bf16 autocast" if self.autocast else "fp32", self.batch_size)

    @property
    def embedding_kernel(self) -> str:
        """The `embedding` op's implementation the backend selected (fbgemm | triton | torch)."""
        return self.backend.select_kernels(self.cfg.backend)["embedding"]

    # ---- one step, in three parts the pipelines call -------------------------------------------

    @property
    def predicted_step_s(self) -> float | None:
        """The plan's predicted seconds per step (its slowest rank), None where nothing predicted it."""
        return self.predicted_perf.total_s if self.predicted_perf is not None else None

    def _forward(self, batch: Batch) -> tuple[torch.Tensor, Any]:
        with phase("forward"), self.backend.autocast(self.autocast):
            return self.model(batch)

    def _backward(self, loss: torch.Tensor) -> None:
        """Backward (the fused embedding update happens inside it), skipped for a non-finite loss
        when `trainer.skip_nonfinite` (every rank skips the same step); see validate.NonFiniteGuard."""
        loss = loss if loss.dim() == 0 else loss.sum()
        self._last_loss = loss.detach()
        if not self.loss_guard.observe(self._last_loss, self.step):
            self.skipped_batches += 1
            logger.warning("step %d: non-finite loss, batch skipped (no update)", self.step + 1)
            return
        with phase("backward"):
            loss.backward()

    def _optimizer_step(self) -> None:
        with phase("optimizer"):
            if self.cfg.optim.grad_clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.dense_params, self.cfg.optim.grad_clip_norm)
            self.optimizer.step()

    def _set_lr(self, step: int) -> float:
        """Learning rates of both optimizers for the step about to run; returns the factor."""
        f = self.schedule.factor(step)
        set_lr(self.dense_optimizer, self.cfg.optim.dense_lr * f)
        set_lr(self.fused_optimizer, self.cfg.optim.embedding_lr * f)
        if self.replicated_optimizer is not None:
            set_lr(self.replicated_optimizer, self.cfg.optim.embedding_lr * f)
        return f

    def train_step(self, batch: Batch) -> torch.Tensor:
        """One eager step on one batch: forward, backward (rows update inside it), dense step."""
        self.model.train()
        self._set_lr(self.step)
        self.optimizer.zero_grad()
        loss, _ = self._forward(batch.to(self.device, non_blocking=True))
        self._backward(loss)
        self._optimizer_step()
        self.step += 1
        return self._last_loss

    # ---- the loop --------------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Run to `trainer.steps` (from a resumed step if any) and return the summary (same on all ranks).

        Steps run in chunks between evaluations and checkpoints; each chunk drains the pipeline, so
        a checkpoint holds exactly the state after its step and the data position is that step.
        """
        tc = self.cfg.trainer
        run = _Run(start_step=self.step, window=LossWindow(max(1, tc.log_every), self.device),
                   bar=progress_bar(self.dist.is_main and tc.progress, tc.steps, self.step),
                   timer=StepTimer(self.step, tc.steps))
        if tc.breakdown_steps:
            try:
                run.profile_at = breakdown_window(tc.steps, run.timer.warm_step, tc.breakdown_steps)
            except ValueError as e:  # resumed too close to the end (a fresh run was checked in build)
                logger.warning("no step breakdown: %s", e)
        self.backend.reset_peak_memory_stats()
        self.model.train()
        self.stopper = StopRequest(self.dist.rank, self.dist.world_size, tc.stop_check_every, tc.stop_grace_s,
                                   tc.collective_timeout_s)
        self.stopper.install()  # SIGINT/SIGTERM: every rank stops after the same step
        try:
            while self.step < tc.steps and not self.stopper.stopped_by:
                if self.step == run.profile_at:
                    run.profiler = StepProfiler(tc.breakdown_steps, self.backend.device_type).__enter__()
                self._train_chunk(self._next_stop(tc.steps, run), run)
                if not self.stopper.stopped_by:
                    self._between_chunks(run)
            if run.bar is not None:
                run.bar.close()
            return self._finish(run)
        finally:
            self.stopper.restore()
            if run.profiler is not None:
                run.profiler.__exit__(None, None, None)

    def _next_stop(self, steps: int, run: _Run) -> int:
        """The next step after which something happens between steps (eval, checkpoint, fault)."""
        tc = self.cfg.trainer
        stops = [steps]
        if run.profile_at is not None and run.profile_at > self.step:
            stops.append(run.profile_at)  # the profiled window is a chunk of its own
        for every in (tc.eval_every, tc.checkpoint.every if self.checkpoints else 0):
            if every > 0:
                stops.append((self.step // every + 1) * every)
        if tc.fault.kill_at_step is not None and tc.fault.kill_at_step > self.step:
            stops.append(tc.fault.kill_at_step)
        return min(stops)

    def _batches(self, source, first_step: int, num_steps: int, what: str = "step"):
        batches = source.iter_from(first_step, num_steps)
        return self.validator.wrap(batches, first_step, what) if self.validator is not None else batches

    def _train_chunk(self, stop: int, run: _Run) -> None:
        """Steps up to `stop`; the time until the pipeline is drained counts as training time."""
        batches = self._batches(self.train_data, self.step, stop - self.step)
        run.chunk_start = time.perf_counter()
        timed = run.profiler is None  # profiled steps are slower: not in measured_step_ms
        if timed:
            run.timer.chunk_start(self.step)
        while True:
            lr_factor = self._set_lr(self.step)
            try:
                self.pipeline.progress(batches)
            except StopIteration:
                break
            self.step += 1
            if run.profiler is not None:
                run.profiler.step()
            run.timer.after_step(self.step)
            self._after_step(run, lr_factor)
            if self.stopper.should_stop(self.step):
                break
        self._flush_checks()  # before any checkpoint or evaluation of this state
        self.backend.synchronize()
        run.train_time_s += time.perf_counter() - run.chunk_start
        if timed:
            run.timer.chunk_end(self.step)

    def _after_step(self, run: _Run, lr_factor: float) -> None:
        """Loss window and progress bar; every `trainer.log_every` steps the deferred checks and a
        train record (the only host reads of device values in the steady state)."""
        log_every = self.cfg.trainer.log_every
        run.window.add(self._last_loss)
        if run.bar is not None:
            run.bar.update(1)
        if log_every and self.step % log_every == 0:
            self._flush_checks()
            self._log_train(run, lr_factor)

    def _flush_checks(self) -> None:
        """Raise what the deferred input and loss checks found (one all-reduce: all ranks call it)."""
        flush_checks(self.validator, self.loss_guard)

    def _log_train(self, run: _Run, lr_factor: float) -> None:
        mean = run.window.mean()
        if math.isnan(mean):
            return
        if run.bar is not None:
            run.bar.set_postfix(loss=f"{mean:.4f}", refresh=False)
        elapsed_s = run.train_time_s + time.perf_counter() - run.chunk_start
        rate = self.batch_size * self.dist.world_size * (self.step - run.start_step) / max(elapsed_s, 1e-9)
        if self.dist.is_main:
            logger.info("step %d loss %.5f", self.step, mean)
        self.writer.write(self.step, "train", {
            "loss": mean, "samples_per_s": rate, "lr_factor": lr_factor,
            "dense_lr": self.cfg.optim.dense_lr * lr_factor,
            "embedding_lr": self.cfg.optim.embedding_lr * lr_factor})

    def _between_chunks(self, run: _Run) -> None:
        """Fault injection, then a periodic checkpoint and evaluation when one is due (not at the end)."""
        tc = self.cfg.trainer
        self._maybe_fault()
        if self.checkpoints is not None and self.step < tc.steps and tc.checkpoint.every and \
                self.step % tc.checkpoint.every == 0:
            run.last_checkpoint = self.save_checkpoint()
        if tc.eval_every and self.step % tc.eval_every == 0 and self.step < tc.steps and self.eval_data:
            self._log_eval(self.evaluate())

    def _finish(self, run: _Run) -> dict[str, Any]:
        """The final checkpoint (unless the last chunk wrote it), the final evaluation and the summary."""
        stopped = self.stopper.stopped_by is not None
        if self.checkpoints is not None and self.step > (self.resumed_from or 0) and (
                not stopped or self.cfg.trainer.checkpoint.on_signal) and (
                run.last_checkpoint is None or run.last_checkpoint.name != f"step_{self.step}"):
            run.last_checkpoint = self.save_checkpoint()
        final_loss = train_loss = None  # no step ran in this process (resumed at the end)
        if self.step > run.start_step:
            final_loss, train_loss = all_reduce_mean(
                [float(self._last_loss), run.window.mean()],
                self.device)
        eval_result = None
        if self.eval_data is not None and not stopped:
            eval_result = self.evaluate()
            self._log_eval(eval_result)
        summary = self._summary(run, final_loss, train_loss, eval_result)
        summary.update(prediction_check(self.predicted_step_s, gather_step_s(run.timer.step_s, self.device),
                                        log=self.dist.is_main))
        summary["measured_steps"] = run.timer.steps  # this rank's timed steps (the same on every rank)
        if run.profiler is not None:
            profiler, run.profiler = run.profiler, None  # stopped here, not again on the way out
            summary["step_breakdown_ms"] = self._breakdown(profiler)
        if self.cfg.trainer.fingerprint_weights:
            summary["weights_sha256"] = weights_fingerprint(self.model, self.dist.is_main)
        return summary

    def _breakdown(self, profiler: StepProfiler) -> dict[str, Any]:
        """Stop the profiler; every rank's ms per step by phase beside the plan's (logged on rank 0)."""
        profiler.__exit__(None, None, None)
        per_rank = gather_breakdown(profiler.ms_per_step(), self.device)
        predicted = predicted_phases(self.predicted_perf)
        if self.dist.is_main:
            logger.info("step breakdown over the last %d steps (torch.profiler; collectives are part of "
                        "the phases they ran in):\n%s", profiler.steps, format_breakdown(per_rank, predicted))
        return {"steps": profiler.steps, "per_rank": per_rank, "predicted": predicted}

    def _summary(self, run: _Run, final_loss: float | None, train_loss: float | None,
                 eval_result: dict[str, float] | None) -> dict[str, Any]:
        """The run's JSON summary (README documents its keys)."""
        samples = (self.step - run.start_step) * self.batch_size * self.dist.world_size
        return {
            "steps": self.step,
            "samples_per_s": samples / run.train_time_s if run.train_time_s > 0 else None,
            "train_loss": train_loss,
            "final_loss": final_loss,
            **{f"eval_{k}": eval_result[k] if eval_result else None
               for k in ("auc", "ne", "logloss", "accuracy")},
            "backend": self.backend.name,
            "embedding_kernel": self.embedding_kernel,
            "world_size": self.dist.world_size,
            "hosts": self.dist.hosts,
            "local_world_size": self.dist.local_world_size,
            "batch_size_per_rank": self.batch_size,
            "elapsed_s": run.train_time_s,
            "peak_memory_bytes": self.backend.max_memory_allocated(),  # null where not measured
            "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "skipped_batches": self.skipped_batches,
            "data_malformed_rows": getattr(self.train_data, "malformed_rows", 0),
            "resumed_from_step": self.resumed_from,
            "checkpoint": str(run.last_checkpoint) if run.last_checkpoint else None,
            "stopped_by": self.stopper.stopped_by,  # SIGINT/SIGTERM, or null
        }

    def _log_eval(self, result: dict[str, float]) -> None:
        self.writer.write(self.step, "eval", result)
        if self.dist.is_main:
            logger.info("step %d eval %s", self.step, " ".join(f"{k} {v:.5f}" for k, v in result.items()))

    def _maybe_fault(self) -> None:
        """Test-only: SIGKILL one rank after `trainer.fault.kill_at_step` on the first attempt."""
        fault = self.cfg.trainer.fault
        if (fault.kill_at_step is not None and self.step == fault.kill_at_step
                and self.dist.rank == fault.kill_rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            logger.warning("fault injection: SIGKILL rank %d after step %d", self.dist.rank, self.step)
            os.kill(os.getpid(), signal.SIGKILL)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """AUC, NE, log loss and accuracy over `trainer.eval_steps` held-out batches per rank."""
        assert self.eval_data is not None
        self.model.eval()
        metrics = EvalMetrics(self.device)
        batches = self._batches(self.eval_data, 0, self.cfg.trainer.eval_steps, what="eval batch")
        while True:
            try:
                logits_B, labels_B = self.pipeline.progress(batches)
            except StopIteration:
                break
            metrics.update(logits_B, labels_B)
        if self.validator is not None:
            self.validator.flush()
        self.model.train()
        return metrics.compute()

    # ---- checkpoints ----------------------------------------------------------------------------

    def signature(self) -> dict[str, Any]:
        """What a checkpoint must match to load into this model (world size may differ)."""
        tables = {c.name: [c.num_embeddings, c.embedding_dim] for c in table_configs(self.cfg.model)}
        dense = {n: list(p.shape) for n, p in self.model.named_parameters() if "sparse_arch" not in n}
        return {"tables": tables, "dense": dense, "optimizer": self.cfg.optim.name}

    def state_dict(self) -> dict[str, Any]:
        """Model, both optimizers (dense and fused embedding), step/data position and this rank's RNG."""
        return {
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            # The data position is the step: every source's batch(step) is a pure function of it.
            "progress": torch.tensor([self.step, self.step, self.skipped_batches], dtype=torch.int64),
            "rng": {f"rank{self.dist.rank}": torch.get_rng_state()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        step, data_step, skipped = (int(x) for x in state["progress"])
        assert step == data_step, "the data position is the step"
        self.step, self.skipped_batches = step, skipped
        rng = state.get("rng", {}).get(f"rank{self.dist.rank}")
        if rng is not None:
            torch.set_rng_state(rng)

    def save_checkpoint(self) -> Path:
        assert self.checkpoints is not None
        path = self.checkpoints.save(self.step, self.state_dict(),
                                     {"world_size": self.dist.world_size, "model": self.cfg.model.name})
        if self.dist.is_main:
            logger.info("checkpoint: %s", path)
        return path

    def load_checkpoint(self, path: Path) -> None:
        """Resume from `path`: checks first, then DCP loads in place (resharding if needed)."""
        assert self.checkpoints is not None
        self.checkpoints.read_meta(path)
        self.dense_optimizer.init_state()  # lazy optimizer state must exist to be loaded into
        state = self.state_dict()
        saved = self.checkpoints.saved_keys(path)
        if not any(k.startswith(f"rng.rank{self.dist.rank}") for k in saved):
            state.pop("rng")  # a rank that did not exist in the saved run
            logger.warning("checkpoint %s has no RNG state for rank %d", path, self.dist.rank)
        self.checkpoints.load(path, state)
        self.load_state_dict(state)
        self.resumed_from = self.step
        if self.dist.is_main:
            logger.info("resumed from %s (step %d)", path, self.step)
            if self.step > self.cfg.trainer.steps:
                logger.warning("resumed at step %d, past trainer.steps=%d: no step to train", self.step,
                               self.cfg.trainer.steps)

    def close(self, failed: bool = False, keep_group: bool = False) -> None:
        """Release the sharded model before the process group goes (see destroy_distributed).

        `failed`: after an error, a peer may be gone; wait for the others only briefly.
        `keep_group`: leave the process group up (another Trainer in this process still uses it and
        closes last).
        """
        self.writer.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
        # Everything that holds the sharded tables or their process groups goes first, so the
        # gc.collect() in destroy_distributed frees them while the group still exists.
        del self.pipeline, self.optimizer, self.dense_optimizer, self.fused_optimizer, self.dense_params
        del self.replicated_optimizer
        del self.model, self.train_data, self.eval_data, self.checkpoints
        if not keep_group:
            destroy_distributed(barrier=not failed or peers_met(self.dist.rank, self.dist.world_size))
