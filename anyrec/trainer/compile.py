"""`trainer.compile`: the dense model (bottom MLP, interaction, over-arch, loss) through torch.compile's
inductor; the sparse path (the EmbeddingBagCollection, its input and output distribution) stays with
torchrec's pipeline.

    false  eager (the numbers of record: golden curves and the default job's loss are eager ones)
    true   compiled, where the backend has an inductor code generator (CPU, CUDA, ROCm); eager with one
           warning on a device without one, or when the compile fails
    auto   compiled when the predicted saving over the job's remaining steps exceeds the compile time

Each dense module is compiled in place (`nn.Module.compile`), so parameter names, checkpoints and the DDP
wrapper see the same modules. The compile happens at build, on copies of the dense modules fed a batch of
the job's shape: a failure is caught there (eager, one warning) rather than in the first training step,
and the real modules then reuse the compiled code (dynamo's cache; their first call takes milliseconds).

`auto` reads a record measured once per machine and dense-model shape (`anyrec.history.compile_records`):
the compile time (training and evaluation graphs) and the dense part's step time eager and compiled.
Without a record it first bounds the saving by the whole eager dense step (no compile saves more than all
of it): below `MIN_COMPILE_S` over the remaining steps the job stays eager without compiling anything;
otherwise it measures, writes the record and decides. Rank 0 decides; every rank follows.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torchrec.distributed.model_parallel import get_unwrapped_module

from anyrec.config import ModelConfig, Switch
from anyrec.history.compile_records import CompileRecord, read_record, record_key, record_path, write_record
from anyrec.runtime.distributed import ONE_PROCESS, DistInfo, broadcast_from_main

if TYPE_CHECKING:
    from anyrec.backends import Backend

logger = logging.getLogger(__name__)

# Where the dense modules sit in the trainer's DLRMTrain (the EmbeddingBagCollection, model.sparse_arch,
# is never compiled: torchrec's pipeline rewrites its input distribution).
DENSE_MODULES = ("model.dense_arch", "model.interaction", "model.over_arch", "loss_fn")
# empirical: the shortest inductor compile of a dense DLRM (training + evaluation graphs) measured on a
# 2-core CPU host, dlrm_small, 2026-12-04, took 12.7 s: a saving bounded below this is not worth measuring.
MIN_COMPILE_S = 10.0
TIMED_STEPS = 10  # dense steps timed eager and compiled by the measurement


def worth_compiling(record: CompileRecord, remaining_steps: int) -> bool:
    """Whether compiling pays for itself: the saving over `remaining_steps` exceeds the compile time."""
    return record.saving_per_step_s * remaining_steps > record.compile_s


@dataclass(frozen=True)
class CompileDecision:
    """What `compile_dense` did and why (the reason is logged once)."""

    compiled: bool
    setting: Switch
    reason: str
    record: CompileRecord | None = None


# ---- measuring -------------------------------------------------------------------------------------


def dense_modules(train_model: nn.Module) -> dict[str, nn.Module]:
    """The compiled parts of a DLRMTrain (or of the DistributedModelParallel around one), by path."""
    unwrapped = get_unwrapped_module(train_model)
    return {path: unwrapped.get_submodule(path) for path in DENSE_MODULES}


def dense_step(modules: dict[str, nn.Module], dense_BI: torch.Tensor, sparse_BFD: torch.Tensor,
               labels_B: torch.Tensor, autocast: Callable[[], object], train: bool = True) -> torch.Tensor:
    """One forward (and, when `train`, backward) of the dense part as DLRM.forward and DLRMTrain run it."""
    with autocast():
        dense_BD = modules["model.dense_arch"](dense_BI)
        logits_B = modules["model.over_arch"](modules["model.interaction"](dense_BD, sparse_BFD)).squeeze(-1)
        loss = modules["loss_fn"](logits_B.float(), labels_B)
    if train:
        loss.backward()
    return loss


def _timed_steps(step: Callable[[], object], backend: Backend, n: int, best: bool = False) -> float:
    """The median seconds of `n` calls of `step` after one untimed call (a shared host's other work shows
    in the mean, far less in the median); the fastest call's with `best`."""
    step()
    backend.synchronize()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        backend.synchronize()
        times.append(time.perf_counter() - start)
    return min(times) if best else statistics.median(times)


def example_batch(model: ModelConfig, batch_size: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense features, pooled embeddings (with a gradient, as the EBC's output has) and labels of the job's
    shape, from a fixed generator (the global RNG, which seeds the model, is left alone)."""
    gen = torch.Generator().manual_seed(0)
    dense_BI = torch.randn(batch_size, model.num_dense_features, generator=gen).to(device)
    sparse_BFD = torch.randn(batch_size, len(model.table_rows), model.embedding_dim, generator=gen).to(device)
    labels_B = torch.randint(0, 2, (batch_size,), generator=gen).float().to(device)
    return dense_BI, sparse_BFD.requires_grad_(), labels_B


def measure_eager(modules: dict[str, nn.Module], batch: tuple, backend: Backend,
                  autocast: Callable[[], object], steps: int = TIMED_STEPS, best: bool = False) -> float:
    """Seconds per eager dense step, on copies of `modules` (the median step's; the fastest's with `best`)."""
    copies = {k: copy.deepcopy(m) for k, m in modules.items()}
    return _timed_steps(lambda: dense_step(copies, *batch, autocast), backend, steps, best)


def compile_copies(modules: dict[str, nn.Module], batch: tuple, backend: Backend,
                   autocast: Callable[[], object], compiler: str | Callable = "inductor"
                   ) -> tuple[dict[str, nn.Module], float]:
    """Compiled copies of `modules`, their training and evaluation graphs built, and the seconds that took.
    Raises what the compile raises."""
    copies = {k: copy.deepcopy(m) for k, m in modules.items()}
    for m in copies.values():
        m.compile(backend=compiler)
    start = time.perf_counter()
    dense_step(copies, *batch, autocast)
    for m in copies.values():
        m.eval()
    with torch.no_grad():
        dense_step(copies, *batch, autocast, train=False)
    for m in copies.values():
        m.train()
    backend.synchronize()
    return copies, time.perf_counter() - start


def measure_compiled(modules: dict[str, nn.Module], batch: tuple, backend: Backend,
                     autocast: Callable[[], object], steps: int = TIMED_STEPS,
                     compiler: str | Callable = "inductor") -> tuple[float, float]:
    """(compile seconds, seconds per compiled dense step) of copies of `modules`."""
    copies, compile_s = compile_copies(modules, batch, backend, autocast, compiler)
    return compile_s, _timed_steps(lambda: dense_step(copies, *batch, autocast), backend, steps)


# ---- the choice ------------------------------------------------------------------------------------


def choose(setting: Switch, backend: Backend, remaining_steps: int, record: CompileRecord | None,
           eager_step_s: Callable[[], float]) -> tuple[str, str]:
    """What to do before any compile: ("eager" | "compile" | "measure", why). `eager_step_s` is called
    only when `auto` has no record (it times the eager dense step)."""
    if setting is Switch.false:
        return "eager", "trainer.compile=false"
    if not backend.compiles:
        return "eager", (f"the {backend.name} backend's device ({backend.device_type}) has no inductor code "
                         f"generator")
    if setting is Switch.true:
        return "compile", "trainer.compile=true"
    if record is not None:
        saving = record.saving_per_step_s * remaining_steps
        verdict = "compile" if worth_compiling(record, remaining_steps) else "eager"
        return verdict, (f"auto: {remaining_steps} steps x {record.saving_per_step_s * 1e3:.3f} ms saved = "
                         f"{saving:.1f} s vs {record.compile_s:.1f} s to compile (this machine's record)")
    ceiling = eager_step_s() * remaining_steps
    if ceiling <= MIN_COMPILE_S:
        return "eager", (f"auto: the whole eager dense part takes {ceiling:.2f} s over {remaining_steps} "
                         f"steps, less than any compile ({MIN_COMPILE_S:.0f} s at the least)")
    return "measure", "auto: no record for this machine and model yet"


def compile_dense(train_model: nn.Module, model_cfg: ModelConfig, backend: Backend, device: torch.device,
                  setting: Switch, remaining_steps: int, batch_size: int, autocast: bool,
                  info: DistInfo = ONE_PROCESS, directory: Path | None = None,
                  compiler: str | Callable = "inductor") -> CompileDecision:
    """Compile `train_model`'s dense modules in place as `setting` says (rank 0 decides, every rank follows
    and compiles its own); logs the decision once. A failed compile leaves them eager, with one warning.
    `directory`: the records' folder (default: the calibration cache's); `compiler`: torch.compile's.

    Rank 0 first says what to do (its record, or a short eager timing): stay eager, compile, or compile and
    measure. Where a compile follows, every rank compiles its copies at once, rank 0 timing them where it
    measures; the ranks then follow rank 0's verdict. No rank waits out a whole compile in a collective
    (a `trainer.collective_timeout_s` shorter than a compile would fail the job at start-up), and the job
    starts one compile later, not two."""
    modules = dense_modules(train_model)
    batch = example_batch(model_cfg, batch_size, device)
    ctx = lambda: backend.autocast(autocast)  # noqa: E731 - a fresh context per step
    key = record_key(backend, model_cfg, batch_size, autocast, info.local_world_size) if info.is_main else ""
    first = _first_say(setting, modules, batch, backend, ctx, remaining_steps, key, directory) \
        if info.is_main else None
    action, reason, record = broadcast_from_main(first, info)
    if action == "eager":
        decision = CompileDecision(False, setting, reason, record)
    else:
        failure = None
        if info.is_main:
            decision = _compile_here(action, setting, reason, record, modules, batch, backend, ctx,
                                     remaining_steps, key, directory, compiler)
        else:
            try:
                compile_copies(modules, batch, backend, ctx, compiler)
            except Exception as e:  # noqa: BLE001 - any compile error: this rank's graphs are not usable
                failure = e
            decision = None
        decision = broadcast_from_main(decision, info)
        if decision.compiled and failure is not None:
            raise RuntimeError(f"rank {info.rank}: the dense model's compile failed where rank 0's "
                               f"succeeded: {_first_lines(failure)}") from failure
    assert isinstance(decision, CompileDecision)
    if decision.compiled:
        for m in modules.values():
            m.compile(backend=compiler)  # the compiled copies' code, reused (dynamo's cache)
    if info.is_main:
        # a forced compile the device cannot do is a setting ignored: a warning (a failed one warned already)
        failed = decision.reason.startswith("compile failed")
        ignored = setting is Switch.true and not decision.compiled and not failed
        # compiled, or a device without inductor: said on the console; auto's "it does not pay": the log file
        level = (logging.WARNING if ignored else
                 logging.INFO if decision.compiled or failed or not backend.compiles else logging.DEBUG)
        logger.log(level, "dense model: %s (%s)", "compiled (inductor)" if decision.compiled else "eager",
                   decision.reason)
    return decision


def _first_say(setting: Switch, modules: dict[str, nn.Module], batch: tuple, backend: Backend,
               ctx: Callable[[], object], remaining_steps: int, key: str,
               directory: Path | None) -> tuple[str, str, CompileRecord | None]:
    """Rank 0's word before any compile: (eager | compile | measure, why, this machine's record)."""
    record = read_record(record_path(key, directory), key) if setting is Switch.auto else None
    action, reason = choose(setting, backend, remaining_steps, record,
                            # the fastest of a few steps: on a busy host the median can be 10x the cost
                            lambda: measure_eager(modules, batch, backend, ctx, steps=5, best=True))
    return action, reason, record


def _compile_here(action: str, setting: Switch, reason: str, record: CompileRecord | None,
                  modules: dict[str, nn.Module], batch: tuple, backend: Backend, ctx: Callable[[], object],
                  remaining_steps: int, key: str, directory: Path | None,
                  compiler: str | Callable) -> CompileDecision:
    """Rank 0's compile (on copies, so a failure shows before the first training step): forced, or auto
    with a record that says so (`compile`); or auto without a record (`measure`), timed against eager and
    kept as this machine's record."""
    if action == "compile":
        try:
            compile_copies(modules, batch, backend, ctx, compiler)
        except Exception as e:  # noqa: BLE001 - inductor raises many kinds; all mean "stay eager"
            return _failed(setting, e)
        return CompileDecision(True, setting, reason, record)
    try:
        compile_s, compiled_s = measure_compiled(modules, batch, backend, ctx, compiler=compiler)
    except Exception as e:  # noqa: BLE001
        return _failed(setting, e)
    eager_s = measure_eager(modules, batch, backend, ctx)
    record = CompileRecord(key, compile_s, eager_s, compiled_s)
    try:
        write_record(record_path(key, directory), record)
    except OSError as e:
        logger.warning("compile record not cached (%s): the next job measures again", e)
    _, reason = choose(setting, backend, remaining_steps, record, lambda: eager_s)
    return CompileDecision(worth_compiling(record, remaining_steps), setting, f"{reason}, measured now",
                           record)


def _failed(setting: Switch, error: BaseException) -> CompileDecision:
    logger.warning("trainer.compile=%s: the dense model's compile failed (%s: %s); it runs eager",
                   setting, type(error).__name__, _first_lines(error))
    return CompileDecision(False, setting, f"compile failed: {type(error).__name__}")


def _first_lines(error: BaseException, limit: int = 300) -> str:
    """The message's first line, and the next one where the first only introduces it ("... raised:")."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()] or [type(error).__name__]
    text = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return text[:limit]
