"""The Trainer: build a sharded model of its family from a config, train it, evaluate it, checkpoint it,
report.

Steps run through torchrec's TrainPipelineSparseDist (or an eager loop), the embedding optimizer fused
into the backward and the dense one stepped after it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torchrec.datasets.utils import Batch

from anyrec.backends import Backend
from anyrec.backends.dispatch import Impl
from anyrec.backends.hardware import Hardware, resolve_hardware
from anyrec.backends.sparse_ops import install as install_sparse_ops
from anyrec.backends.threads import ThreadTuner
from anyrec.config import AnyrecConfig, Precision, Switch
from anyrec.history.steplearn import run_key
from anyrec.kernels.ebc import TritonEBCOptimizer
from anyrec.models.dlrm import DLRMTrain
from anyrec.models.family import ModelFamily, resolve_family
from anyrec.models.init import init_model
from anyrec.planner.memory import MemoryPrediction
from anyrec.planner.planned import PlannedJob
from anyrec.planner.types import Perf
from anyrec.runtime.distributed import DistInfo, Runtime, all_reduce_mean, close_runtime, start_runtime
from anyrec.runtime.shutdown import StopRequest, peers_met
from anyrec.signing import resolve_key
from anyrec.trainer.checkpoint import (
    LEGACY_PROGRESS,
    CheckpointManager,
    TrainerState,
    from_legacy,
    legacy_template,
)
from anyrec.trainer.compile import compile_dense
from anyrec.trainer.fingerprint import weights_fingerprint
from anyrec.trainer.inputs import build_inputs
from anyrec.trainer.lineage import identity_config
from anyrec.trainer.memcheck import resident_device_bytes
from anyrec.trainer.metrics import EvalMetrics
from anyrec.trainer.optim import (
    Optimizers,
    WarmupPolyDecay,
    apply_embedding_optimizer,
    check_embedding_optimizer,
    check_embedding_weight_decay,
    embedding_optimizer_config,
)
from anyrec.trainer.perfcheck import StepProfiler, breakdown_window, phase, warmup_steps
from anyrec.trainer.pipeline import EagerLoop, SparseDistPipeline, predictions
from anyrec.trainer.planning import place_shards, shard_model, shared_plan, unsharded_memory
from anyrec.trainer.summary import (
    JobFacts,
    MetricWriter,
    Outcome,
    RunState,
    learnt_correction,
    log_eval,
    log_train,
    remember_run,
    run_summary,
)
from anyrec.trainer.validate import flush_checks

logger = logging.getLogger(__name__)

__all__ = ["EBC_PATH", "DLRMTrain", "Trainer"]

EBC_PATH = "model.sparse_arch"  # where the EmbeddingBagCollection sits inside DLRMTrain (the dlrm family)


class Trainer:
    """Owns the backend, the process group, the sharded model, its optimizers, data and checkpoints."""

    def __init__(self, cfg: AnyrecConfig, planned: PlannedJob | None = None, runtime: Runtime | None = None,
                 hardware: Hardware | None = None, family: ModelFamily | None = None,
                 precision: Precision | None = None) -> None:
        """`planned`: the job planned by the caller (calibration's step points: a plan given table by
        table), else here (`shared_plan`); `runtime`: the process's backend, group and binding, set up by
        the caller (else here, from the config); `hardware`: the device the plan is costed on (else
        resolved from `cfg.hardware`); `family`: the model family (else resolved from
        `cfg.model.family`); `precision`: the dense part's, as the caller resolved `trainer.mixed_precision`
        on the runtime's backend (else here)."""
        self.cfg = cfg
        self.family = family if family is not None else resolve_family(cfg.model)
        signing_key = resolve_key(cfg.trainer.signing_key_file)  # an unusable key fails before any work
        self.owns_runtime = runtime is None  # set up here: this Trainer ends it (close)
        self.runtime = runtime if runtime is not None else self.init_distributed()
        self.backend: Backend = self.runtime.backend
        self.dist: DistInfo = self.runtime.dist
        self.device = self.runtime.device
        self.hardware = hardware
        # the dense part's precision, resolved once: the plan is costed in it and the step runs in it
        self.precision = (precision if precision is not None
                          else self.backend.dense_precision(cfg.trainer.mixed_precision))
        self.kernels: dict[str, Impl] = self.backend.select_kernels(cfg.backend)  # each op's, resolved once
        self.planned = planned  # the sharded path's job, planned once (None: one device, unsharded)
        self.state = TrainerState(rank=self.dist.rank)
        self.resumed_from: int | None = None
        self.last_loss = torch.tensor(math.nan)  # on this rank's device: reading it waits for the device
        # host seconds of the step just run (None for a chunk's first, which fills the pipeline): what the
        # CPU's thread timing reads; on an accelerator the host runs ahead, so it times launches
        self.last_step_s: float | None = None
        self.predicted_perf: Perf | None = None  # the plan's slowest rank, where a planner predicted one
        self.predicted_memory: list[MemoryPrediction] | None = None  # each world rank's peak, if predicted
        # Called after every training step with the trainer (anyrec-parity records each step's loss).
        self.step_hooks: list[Callable[[Trainer], None]] = []
        self.step_hooks += self.backend.step_hooks()  # e.g. the CPU's thread timing (backends/threads.py)
        self.stopper: StopRequest | None = None  # during train(): SIGINT/SIGTERM stop every rank
        self.build()
        self.checkpoints = (CheckpointManager(cfg.trainer.checkpoint, self.signature(), self.dist,
                                              identity_config(cfg), signing_key)
                            if cfg.trainer.checkpoint.dir else None)
        start = self.checkpoints.start() if self.checkpoints is not None else None  # locks the dir
        if start is not None:
            self.load_checkpoint(start)
        tc = cfg.trainer
        # after any resume: `auto` weighs the saving over the steps this job has left to run
        if self.family.compiles_dense:
            self.compiled = compile_dense(self.model, cfg.model, self.backend, self.device, tc.compile,
                                          self.steps - self.step, self.batch_size, self.autocast, self.dist)
        elif tc.compile == Switch.true and self.dist.is_main:
            logger.warning("trainer.compile=true ignored: model.family=%s runs its dense part eagerly",
                           self.family.name)
        self.run = RunState.begin(self.step, self.steps, tc.log_every, self.device, self.writer,
                                  self.batch_size * self.dist.world_size, self.dist.is_main, tc.progress,
                                  per_step_timing=not self.backend.queues_device_work())

    def init_distributed(self) -> Runtime:
        """The backend, process group and core binding the config names (a Trainer given no runtime)."""
        tc = self.cfg.trainer
        return start_runtime(self.cfg.backend.name, self.cfg.backend.bind_cores, tc.collective_timeout_s,
                             tc.peer_timeout_s, self.cfg.backend.threads)

    @property
    def autocast(self) -> bool:
        """Whether the step runs under bf16 autocast: the resolved precision's (`build`)."""
        return self.precision == Precision.bf16

    def _hardware(self) -> Hardware:
        """The device the plan is costed on: the one given, else the config's, resolved once."""
        if self.hardware is None:
            hw = self.cfg.hardware
            self.hardware = resolve_hardware(hw.sku, hw.spec, self.backend, hw.measurements)
        return self.hardware

    # ---- build ------------------------------------------------------------------------------------

    def build(self) -> None:
        """Model (tables on meta, then sharded by DMP), plan, optimizers, step pipeline and data."""
        tc = self.cfg.trainer
        self._check_trainer_config()
        self.schedule = WarmupPolyDecay.from_config(self.cfg.optim)
        torch.manual_seed(tc.seed)
        check_embedding_weight_decay(self.cfg.optim, self.kernels["embedding"])
        # One device with anyrec's own TBE: no sharding, so no input distribution (whose KJT
        # permutes need FBGEMM ops) and no FBGEMM kernel anywhere in the step. Naming the sparse ops'
        # implementation (backend.sparse_ops=portable|fbgemm) asks for the sharded path instead.
        self.unsharded = (self.dist.world_size == 1 and self.family.build_around is not None
                          and self.kernels["embedding"].unsharded_builder is not None
                          and self.cfg.backend.sparse_ops == "auto")
        # The data first: what its sources keep on the device is part of the memory the plan must fit.
        # Prefetched file batches land in page-locked memory where there is a device to copy them to.
        inputs = build_inputs(self.cfg, self.family, self.dist, self.device,
                              self.backend.pin if self.backend.pins_host_memory() else None)
        self.batch_size, self.train_data, self.eval_data = inputs.batch_size, inputs.train, inputs.eval
        self.eval_batches, self.eval_points, self.source_facts = (inputs.eval_batches, inputs.eval_points,
                                                                  inputs.facts)
        # trainer.steps, or fewer where the source holds fewer (a stream's training windows)
        self.steps = tc.steps if inputs.steps is None else min(tc.steps, inputs.steps)
        self.window_evals: list[dict[str, Any]] = []  # a stream's evaluation after each training window
        self.validator, self.loss_guard = inputs.validator, inputs.loss_guard
        self.resident_bytes = resident_device_bytes([self.train_data, self.eval_data], self.device)
        if self.unsharded:
            self._build_unsharded()
        else:
            self._build_sharded()
        # the same initial weights whatever the kernel, plan, world size or device
        family = self.family
        init_model(self.model, family.table_configs(self.cfg.model), tc.seed, family.sparse_path,
                   family.collection_key)
        self.optimizers = Optimizers(self.model, self.fused_optimizer, self.cfg.optim, family.sparse_path)
        loop = SparseDistPipeline if tc.pipeline and not self.unsharded else EagerLoop
        layout = self.planned.layout if self.planned is not None else None
        self.pipeline = loop(self.model, self.optimizers.combined, self.device, self,
                             layout.sync_every if layout is not None else 1)
        self.writer = MetricWriter(tc.run_dir, self.dist.is_main, tc.tensorboard)
        group = layout.group_size if layout is not None else self.dist.world_size
        step_key = self._step_key(group) if self.dist.is_main else None
        model_s = self.predicted_perf.total_s if self.predicted_perf is not None else None
        self.job = JobFacts(self.backend.name, self.embedding_kernel, self.dist, self.batch_size, group,
                            step_key, hardware_file=self._hardware().measured_by,
                            correction=learnt_correction(step_key, model_s, self.dist))
        if self.dist.is_main:
            self._log_setup()

    def _step_key(self, sharding_group_size: int) -> str | None:
        """Where this workload's measured steps on this machine are learnt (None where the plan was not
        made with a calibrated file): its shape, and the other processes' load the binding saw."""
        choice = self.runtime.binding.bind
        other = choice.load.other_cores if choice is not None and choice.load is not None else None
        return run_key(self.cfg, self._hardware(), self.batch_size, self.embedding_kernel, self.precision,
                       self.dist.world_size, self.dist.local_world_size, other, sharding_group_size)

    def _check_trainer_config(self) -> None:
        tc = self.cfg.trainer  # ranges: checked where the typed config was built (anyrec.config.RANGES)
        if tc.breakdown_steps:
            breakdown_window(tc.steps, warmup_steps(tc.steps), tc.breakdown_steps)  # room for it

    def _build_sharded(self) -> None:
        """Tables on the meta device, placed by the plan and allocated by DistributedModelParallel."""
        install_sparse_ops(self.backend, self.cfg.backend.sparse_ops)  # torchrec's input/output dist ops
        family = self.family
        model = family.build_train(self.cfg.model, self.device, torch.device("meta"), self.kernels)
        # Embedding optimizer fused into the backward pass (TBE updates rows in place).
        apply_embedding_optimizer(family.sparse_module(model).parameters(), self.cfg.optim)
        embedding, hardware = self.kernels["embedding"], self._hardware()
        if self.planned is None:
            self.planned = shared_plan(self.cfg, self.backend, self.dist, model, family, embedding,
                                       hardware, self.precision, self.resident_bytes,
                                       self.kernels.get("hstu_attention"))
        else:  # a job planned outside (calibration's step points) names the devices as a planned one does
            place_shards(self.planned.plan, self.backend, self.dist.local_world_size)
        self.predicted_perf = self.planned.slowest
        self.predicted_memory = list(self.planned.memory) if self.planned.memory is not None else None
        check_embedding_optimizer(self.cfg.optim, embedding, self.device.type, self.planned.plan)
        # DDP's static graph page-locks host memory for a device's used-parameter map: off where the
        # device cannot (its copies are then plain ones; the numbers do not change), for the dense
        # modules and for the data-parallel tables of a sharder that takes the setting.
        static_graph = self.device.type == "cpu" or self.backend.pins_host_memory()
        self.model = shard_model(model, self.device, self.planned, self.backend, self.dist, embedding,
                                 static_graph, family.pooled)  # 1D or 2D (the planned layout)
        self.fused_optimizer = self.model.fused_optimizer

    def _build_unsharded(self) -> None:
        """All tables on this device in anyrec's TritonEmbeddingBagCollection (Triton or torch ops)."""
        family = self.family
        assert family.build_around is not None  # `unsharded` asks for it
        ebc = self.kernels["embedding"].build_unsharded(
            family.table_configs(self.cfg.model), optimizer=embedding_optimizer_config(self.cfg.optim),
            device=self.device)
        self.model = family.build_around(self.cfg.model, ebc, self.device, self.kernels)
        hardware = self._hardware()
        self.predicted_memory = unsharded_memory(self.cfg, self.backend, self.model, family,
                                                 self.kernels["embedding"], hardware, self.precision,
                                                 self.resident_bytes)
        self.fused_optimizer = TritonEBCOptimizer(ebc, prefix=f"{family.sparse_path}.")

    def _log_setup(self) -> None:
        logger.info("backend: %s", self.backend.describe())
        logger.info("kernels: %s", ", ".join(f"{op}={impl.name}" for op, impl in self.kernels.items()))
        if self.unsharded:
            logger.info("one device, %s embedding kernel: tables unsharded (no input distribution)",
                        self.embedding_kernel)
        else:
            logger.debug("torchrec sharding plan:\n%s", self.planned.plan)  # the log file: a table a line
        logger.info("step loop: %s, precision: %s, batch %d per rank", type(self.pipeline).__name__,
                    "bf16 autocast" if self.autocast else "fp32", self.batch_size)

    @property
    def embedding_kernel(self) -> str:
        """The `embedding` op's implementation the backend selected (fbgemm | triton | torch)."""
        return self.kernels["embedding"].name

    @property
    def step(self) -> int:
        """Training steps done (also the data position: the next step trains on batch `step`)."""
        return self.state.step

    # ---- one step, in three parts the pipelines call -------------------------------------------

    def forward(self, batch: Batch) -> tuple[torch.Tensor, Any]:
        with phase("forward"), self.backend.autocast(self.autocast):
            return self.model(batch)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward (the fused embedding update happens inside it), skipped for a non-finite loss
        when `trainer.skip_nonfinite` (every rank skips the same step); see validate.NonFiniteGuard."""
        loss = loss if loss.dim() == 0 else loss.sum()
        self.last_loss = loss.detach()
        if not self.loss_guard.observe(self.last_loss, self.step):
            self.state.skipped_batches += 1
            logger.warning("step %d: non-finite loss, batch skipped (no update)", self.step + 1)
            return
        with phase("backward"):
            loss.backward()

    def optimizer_step(self) -> None:
        with phase("optimizer"):
            self.optimizers.step()

    # ---- the loop --------------------------------------------------------------------------------

    def run_steps(self, n: int, batches: Iterator[Batch] | None = None) -> None:
        """Train up to `n` steps from `self.step` (on `batches`, else the training data): the one training
        loop, which `train()` runs in chunks. It ends drained, so the state is exactly that after the
        last step, or earlier at a step all ranks agree on when a stop was requested (a signal)."""
        run = self.run
        source = self.train_data.iter_from(self.step, n) if batches is None else islice(batches, n)
        batches = self.validator.wrap(source, self.step) if self.validator is not None else source
        self.model.train()
        run.timer.chunk_start(self.step, timed=run.profiler is None)  # profiled steps are slower
        self.last_step_s, mark = None, None
        while True:
            lr_factor = self.schedule.factor(self.step)
            self.optimizers.set_lr(lr_factor)
            try:
                self.pipeline.progress(batches)
            except StopIteration:
                break
            self.state.step += 1
            now = time.perf_counter()
            self.last_step_s, mark = (now - mark if mark is not None else None), now
            if run.profiler is not None:
                run.profiler.step()
            run.timer.after_step(self.step)
            self._after_step(lr_factor)
            if self.stopper is not None and self.stopper.should_stop(self.step):
                break
        self._flush_checks()  # before any checkpoint or evaluation of this state
        self.backend.synchronize()
        run.timer.chunk_end(self.step)

    def _after_step(self, lr_factor: float) -> None:
        """Loss window, progress bar and step hooks; every `trainer.log_every` steps the deferred
        checks and a train record (the only host reads of device values in the steady state)."""
        run, log_every = self.run, self.cfg.trainer.log_every
        run.window.add(self.last_loss)
        run.bar.update(1)
        if log_every and self.step % log_every == 0:
            self._flush_checks()
            log_train(self.run, self.step, lr_factor, self.cfg.optim.dense_lr, self.cfg.optim.embedding_lr)
        for hook in self.step_hooks:
            hook(self)

    def _flush_checks(self) -> None:
        """Raise what the deferred input and loss checks found, once per step boundary (a collective)."""
        if self.run.flushed_at != self.step:
            self.run.flushed_at = self.step
            flush_checks(self.validator, self.loss_guard)

    def train(self) -> dict[str, Any]:
        """Run to `trainer.steps` (from a resumed step if any) and return the summary (same on all ranks).
        Steps run in chunks between evaluations and checkpoints, so a checkpoint holds exactly the state
        after its step."""
        tc, run = self.cfg.trainer, self.run
        if tc.breakdown_steps:
            try:
                run.profile_at = breakdown_window(self.steps, run.timer.warm_step, tc.breakdown_steps)
            except ValueError as e:  # resumed too close to the end (a fresh run was checked in build)
                logger.warning("no step breakdown: %s", e)
        self.backend.reset_peak_memory_stats()
        self.stopper = StopRequest(self.dist.rank, self.dist.world_size, tc.stop_check_every, tc.stop_grace_s,
                                   tc.collective_timeout_s)
        self.stopper.install()  # SIGINT/SIGTERM: every rank stops after the same step
        try:
            while self.step < self.steps and not self.stopper.stopped_by:
                if self.step == run.profile_at:
                    run.profiler = StepProfiler(tc.breakdown_steps, self.backend.device_type).__enter__()
                self.run_steps(self._next_stop(self.steps) - self.step)
                if not self.stopper.stopped_by:
                    self._between_chunks()
            run.bar.close()
            return self._finish()
        finally:
            self.stopper.restore()
            if run.profiler is not None:
                run.profiler.__exit__(None, None, None)

    def _next_stop(self, steps: int) -> int:
        """The next step after which something happens between steps (eval, checkpoint)."""
        tc = self.cfg.trainer
        stops = [steps]
        if self.run.profile_at is not None and self.run.profile_at > self.step:
            stops.append(self.run.profile_at)  # the profiled window is a chunk of its own
        for every in (tc.eval_every, tc.checkpoint.every if self.checkpoints else 0):
            if every > 0:
                stops.append((self.step // every + 1) * every)
        stops += [p for p in self.eval_points if p > self.step][:1]
        return min(stops)

    def _between_chunks(self) -> None:
        """A periodic checkpoint and evaluation when one is due (not at the end)."""
        tc = self.cfg.trainer
        if self.checkpoints is not None and self.step < self.steps and tc.checkpoint.every and \
                self.step % tc.checkpoint.every == 0:
            self.run.last_checkpoint = self.save_checkpoint()
        due = (tc.eval_every and self.step % tc.eval_every == 0) or self.step in self.eval_points
        if due and self.step < self.steps and self.eval_data:
            log_eval(self.run, self.step, self.evaluate())

    def _finish(self) -> dict[str, Any]:
        """The final checkpoint (unless the last chunk wrote it), the final evaluation and the summary."""
        run = self.run
        stopped = self.stopper.stopped_by is not None
        if self.checkpoints is not None and self.step > (self.resumed_from or 0) and (
                not stopped or self.cfg.trainer.checkpoint.on_signal) and (
                run.last_checkpoint is None or run.last_checkpoint.name != f"step_{self.step}"):
            run.last_checkpoint = self.save_checkpoint()
        final_loss = train_loss = None  # no step ran in this process (resumed at the end)
        if self.step > run.start_step:
            final_loss, train_loss = all_reduce_mean([float(self.last_loss), run.window.mean()], self.device)
        eval_result = None
        if self.eval_data is not None and not stopped:
            eval_result = self.evaluate()
            log_eval(run, self.step, eval_result)
        out = Outcome(self.step, final_loss, train_loss, eval_result, self.state.skipped_batches,
                      getattr(self.train_data, "malformed_rows", 0), self.resumed_from,
                      self.stopper.stopped_by, self.predicted_perf, self.predicted_memory,
                      self.backend.max_memory_allocated(), self.backend.max_memory_reserved(),
                      weights_fingerprint(self.model, self.dist) if self.cfg.trainer.fingerprint_weights
                      else None)
        summary = run_summary(self.job, run, out)
        remember_run(self.job, summary, out)  # the machine's history, written back once
        return {**summary, **self._thread_facts(), **self._model_facts()}

    def _model_facts(self) -> dict[str, Any]:
        """The summary's model keys: the model, its family, each op's implementation the model runs, the
        dense precision, each streamed window's evaluation and what the data source says of itself."""
        ops = {op: impl.name for op, impl in self.kernels.items() if op in ("interaction", "dcn_cross",
                                                                             "hstu_attention")}
        return {"model": self.cfg.model.name, "model_family": self.family.name,
                "attention_kernel": ops.get("hstu_attention") if not self.family.pooled else None,
                "precision": str(self.precision), "window_eval": self.window_evals,
                **self.source_facts}

    def _thread_facts(self) -> dict[str, Any]:
        """The summary's thread keys: this rank's intra-op count (under backend.threads=auto the count its
        last timing kept) and that timing (count -> the slowest rank's ms per step; null where nothing was
        timed)."""
        tuner = next((h for h in self.step_hooks if isinstance(h, ThreadTuner)), None)
        if tuner is None:
            return {"intra_op_threads": torch.get_num_threads(), "thread_trial_ms": None}
        timed = None if tuner.trial is None else {str(n): ms if math.isfinite(ms) else None
                                                  for n, ms in tuner.trial.step_ms.items()}
        return {"intra_op_threads": tuner.choice.intra_op, "thread_trial_ms": timed}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """AUC, NE, log loss and accuracy over `trainer.eval_steps` held-out batches per rank."""
        assert self.eval_data is not None and self.eval_batches is not None
        self.model.eval()
        metrics = EvalMetrics(self.device, self.dist)
        batches = self.eval_batches(self.step)
        if self.validator is not None:
            batches = self.validator.wrap(batches, 0, "eval batch")
        for logits_B, labels_B in predictions(self.pipeline, batches):
            metrics.update(logits_B, labels_B)
        flush_checks(self.validator, None)
        self.model.train()
        result = metrics.compute()
        if self.step in self.eval_points:  # a stream's: the window after the one trained last
            self.window_evals.append({"window": self.eval_points.index(self.step) + 1, "step": self.step,
                                      **result})
        return result

    # ---- checkpoints ----------------------------------------------------------------------------

    def signature(self) -> dict[str, Any]:
        """What a checkpoint must match to load into this model (world size may differ)."""
        tables = self.family.table_shapes(self.cfg.model)
        dense = {n: list(p.shape) for n, p in self.model.named_parameters() if "sparse_arch" not in n}
        return {"tables": tables, "dense": dense, "optimizer": self.cfg.optim.name}

    def state_dict(self) -> dict[str, Any]:
        """Model, all optimizers (dense, fused embedding, replicated) and the trainer's own state."""
        return {"model": self.model.state_dict(), "optim": self.optimizers.combined.state_dict(),
                "trainer": self.state.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizers.combined.load_state_dict(state["optim"])
        self.state.load_state_dict(state["trainer"])

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
        self.optimizers.dense.init_state()  # lazy optimizer state must exist to be loaded into
        state = self.state_dict()
        saved = self.checkpoints.saved_keys(path)
        legacy = LEGACY_PROGRESS in saved  # written by anyrec 0.1.0
        if legacy:
            del state["trainer"]
            state.update(legacy_template(self.state))
        holder = state if legacy else state["trainer"]
        if not any(k.startswith(f"{'' if legacy else 'trainer.'}rng.rank{self.dist.rank}") for k in saved):
            holder.pop("rng")  # a rank that did not exist in the saved run keeps its own
            logger.warning("checkpoint %s has no RNG state for rank %d", path, self.dist.rank)
        self.checkpoints.load(path, state)
        if legacy:
            state["trainer"] = from_legacy(state)
        self.load_state_dict(state)
        self.resumed_from = self.step
        if self.dist.is_main:
            logger.info("resumed from %s (step %d)", path, self.step)
            if self.step > self.cfg.trainer.steps:
                logger.warning("resumed at step %d, past trainer.steps=%d: no step to train", self.step,
                               self.cfg.trainer.steps)

    def close(self, failed: bool = False, keep_group: bool = False) -> None:
        """Release the sharded model before the process group goes (see destroy_distributed).
        `failed`: a peer may be gone, wait for the others only briefly; `keep_group`: leave the group up
        (another Trainer in this process still uses it and closes last), but stop the heartbeat of a
        runtime this Trainer set up (a thread left beating when the interpreter exits aborts it)."""
        self.writer.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
        # Everything that holds the sharded tables or their process groups goes first, so the
        # gc.collect() in destroy_distributed frees them while the group still exists.
        del self.pipeline, self.optimizers, self.fused_optimizer
        del self.model, self.train_data, self.eval_data, self.checkpoints
        if not keep_group:
            close_runtime(self.runtime, barrier=not failed or peers_met(self.dist.rank, self.dist.world_size))
        elif self.owns_runtime and self.runtime.heartbeat is not None:
            self.runtime.heartbeat.stop()
