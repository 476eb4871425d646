"""The trainer's framework costs, measured: what a real training step spends beyond the bytes and FLOPs
the planner costs (Python, torchrec's awaitables and KJT handling, DDP, optimizers, synthetic data,
loss), fitted into the DeviceSpec `step_*`, `sharding_group_s` and `replicated_table_s` fields.

anyrec's Trainer trains a few tiny points, each with a plan given table by table; with 1,000-row tables
what is left is framework time. The planner's prediction (with the figures measured before) is
subtracted, and the rest fitted by non-negative least squares. The points are not the benchmarks'
workloads: calibration measures primitives, `benchmarks/planner_accuracy.py` validates.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from anyrec import _hydra
from anyrec.backends import Hardware
from anyrec.backends.hardware_file import STEP_FIELDS
from anyrec.calibration.run import STOP_GRACE_S, CalibrationRun, Timing
from anyrec.console import log_file_only
from anyrec.models.family import resolve_family
from anyrec.planner.planned import Assignment, PlannedJob, plan_job
from anyrec.runtime.distributed import Runtime
from anyrec.trainer.trainer import Trainer

logger = logging.getLogger(__name__)

ROWS = 1_000  # rows per table: lookups stay cheap, framework time dominates


@dataclass(frozen=True)
class StepPoint:
    """One calibration training job (`batch` samples per rank, `pooling` ids per sample per table), its
    tables split into equal blocks, one per sharding type; `hidden` extra 64-wide layers in each MLP."""

    tables: int
    dim: int
    batch: int
    pooling: int
    shardings: tuple[str, ...]
    hidden: int = 0

    @property
    def bottom_mlp(self) -> list[int]:
        return [64] * self.hidden + [self.dim]

    @property
    def top_mlp(self) -> list[int]:
        return [64] * self.hidden + [16, 1]

    @property
    def name(self) -> str:
        kinds = "+".join(s.replace("_wise", "").replace("data_parallel", "dp") for s in self.shardings)
        deep = f" H{self.hidden}" if self.hidden else ""
        return f"{kinds} T{self.tables} D{self.dim} B{self.batch} P{self.pooling}{deep}"

    def sharding_of(self, i: int) -> str:
        return self.shardings[i * len(self.shardings) // self.tables]

    def terms(self, world: int = 2) -> list[float]:
        """The fit's columns at `world` ranks: step, features, samples, ids, pooled values, dot-interaction
        entries ((tables + 1)^2 per sample), dense tensors (a weight and a bias per MLP layer), sharding
        groups and replicas (both 0 at one rank: its one group's cost is the step's; no replicas)."""
        groups = len({s for s in self.shardings if s != "data_parallel"}) if world > 1 else 0
        replicas = sum(self.sharding_of(i) == "data_parallel" for i in range(self.tables)) if world > 1 else 0
        return [1.0, self.tables, self.batch, self.batch * self.tables * self.pooling,
                self.batch * self.tables * self.dim, self.batch * (self.tables + 1) ** 2,
                2 * (len(self.bottom_mlp) + len(self.top_mlp)), groups, replicas]


# Each term varies alone against the first point: features (24 tables), samples (batch 512), ids (pooling
# 16 and 64), pooled values (dims 128 and 256), sharding groups (1, 2 and 3 types at dim 32), replicated
# tables, interaction entries (many features at a large batch), dense tensors (three more hidden layers).
POINTS = [
    StepPoint(8, 16, 32, 1, ("table_wise",)),
    StepPoint(24, 16, 32, 1, ("table_wise",)),
    StepPoint(8, 16, 512, 1, ("table_wise",)),
    StepPoint(24, 16, 512, 1, ("table_wise",)),
    StepPoint(8, 16, 32, 1, ("table_wise",), hidden=3),
    StepPoint(8, 16, 128, 16, ("table_wise",)),
    StepPoint(8, 16, 64, 64, ("table_wise",)),
    StepPoint(8, 128, 256, 1, ("table_wise",)),
    StepPoint(8, 256, 128, 1, ("table_wise",)),
    StepPoint(8, 32, 32, 1, ("table_wise",)),
    StepPoint(8, 32, 32, 1, ("table_wise", "column_wise")),
    StepPoint(8, 32, 32, 1, ("table_wise", "column_wise", "row_wise")),
    StepPoint(8, 16, 32, 1, ("data_parallel",)),
    StepPoint(24, 16, 32, 1, ("data_parallel",)),
]

# The quick calibration's subset (trainers dominate its time): each term still varies against the first
# point, one point each (features and interaction entries by 24 tables at two batches).
QUICK_POINTS = [POINTS[i] for i in (0, 1, 2, 3, 4, 5, 7, 10, 11, 12)]


def points_at(world: int, quick: bool = False) -> list[StepPoint]:
    """The points `world` ranks train (`quick`: the calibration on first contact's). One rank trains every
    table table-wise (the planner offers nothing else there): its points are the table-wise ones."""
    if world > 1:
        return QUICK_POINTS if quick else POINTS
    table_wise = [p for p in POINTS if p.shardings == ("table_wise",)]
    return table_wise[:9] if quick else table_wise


def _overrides(p: StepPoint, backend: str, steps: int) -> list[str]:
    rows = ",".join([str(ROWS)] * p.tables)
    hot = ",".join([str(p.pooling)] * p.tables) if p.pooling > 1 else ""
    return ["model=dlrm_small", f"model.table_rows=[{rows}]", f"model.multi_hot=[{hot}]",
            f"model.embedding_dim={p.dim}", f"model.bottom_mlp={p.bottom_mlp}", f"model.top_mlp={p.top_mlp}",
            f"data.batch_size={p.batch}", f"backend.name={backend}", f"trainer.steps={steps}",
            "trainer.eval_steps=0", "trainer.progress=false", "trainer.tensorboard=false",
            f"trainer.stop_grace_s={STOP_GRACE_S}", "trainer.checkpoint.dir=null", "trainer.run_dir=null"]


def _assignment(p: StepPoint, world: int) -> Assignment:
    """Table -> (sharding, placement, ranks); table-wise tables go round-robin over the ranks."""
    out = {}
    for i in range(p.tables):
        st = p.sharding_of(i)
        ranks = [i % world] if st == "table_wise" else list(range(world))
        out[f"t_cat_{i}"] = (st, "hbm", ranks)
    return out


def _train_point(p: StepPoint, runtime: Runtime, hardware: Hardware, steps: int,
                 run: CalibrationRun) -> tuple[float, float]:
    """(measured seconds per step of the slowest rank, the planner's seconds for the same plan), trained
    in this process's `runtime` (its group and binding); a signal its trainer caught (it stops at its next
    step boundary) stops the run."""
    run.check()
    backend, world = runtime.backend, runtime.dist.world_size
    cfg = _hydra.compose_job(_overrides(p, backend.name, steps))
    embedding = backend.select_kernels(cfg.backend)["embedding"]
    meta, family = torch.device("meta"), resolve_family(cfg.model)
    model = family.build_train(cfg.model, meta, meta, {})
    precision = backend.dense_precision(cfg.trainer.mixed_precision)  # planned and run in it
    planned = plan_job(cfg, model, family.sparse_module(model), family.sparse_path,
                       family.workload_facts(cfg.model), hardware, embedding, world,
                       runtime.dist.local_world_size, p.batch, backend.device_type,
                       assignment=_assignment(p, world),
                       precision=precision)
    # the trainer takes the plan alone: the points are costed without the step figures being fitted, a
    # prediction for the trainer to check or learn from is none
    given = PlannedJob(planned.plan, planned.layout)
    # one set-up log per point would bury the calibration's table: the points' own lines go to the log file
    with log_file_only():
        trainer = Trainer(cfg, given, runtime=runtime, hardware=hardware, family=family, precision=precision)
        run.check()  # a signal while it was built
        trainer.step_hooks.append(lambda _: run.check())  # the trainer's own catches one while it trains
        try:
            summary = trainer.train()
        finally:
            trainer.writer.close()
            del trainer
            gc.collect()
    run.stopped_by(summary.get("stopped_by"))
    return summary["measured_step_ms"] / 1e3, planned.predicted_step_s


def builtin_scale(rows: list[list[float]], measured: list[float], model: list[float], spec: Any) -> float:
    """The factor s >= 0 on `spec`'s built-in step figures that best explains the `measured` seconds of the
    points with `rows` terms (`model`: their bytes-and-FLOPs seconds), in relative least squares; 1 where
    the built-in figures explain nothing (all zero)."""
    builtin = [sum(getattr(spec, f) * x for f, x in zip(STEP_FIELDS, r, strict=True)) for r in rows]
    num = sum(b * (m - p) / m**2 for b, m, p in zip(builtin, measured, model, strict=True))
    den = sum(b * b / m**2 for b, m in zip(builtin, measured, strict=True))
    return max(0.0, num / den) if den > 0 else 1.0


def _shorten(steps: int, pass_s: float, left_s: float) -> tuple[int, float]:
    """(steps per point, seconds per pass): fewer steps where a pass at `steps` would not fit `left_s`."""
    if steps > 10 and pass_s > left_s:
        return 10, pass_s / 3  # most of a short point is its set-up, not its steps
    return steps, pass_s


def measure_step_costs(runtime: Runtime, hardware: Hardware, budget_s: float, fit: Any, quick: bool = False,
                       run: CalibrationRun | None = None) -> dict[str, Any]:
    """Train every point of `points_at(world, quick)` on the process group's ranks (in `runtime`: its
    group, device and binding) and fit with `fit` (measure.fit_nonnegative) what `hardware` leaves
    unexplained. Within `run`'s time: as many passes as fit (one started at least, ending with the time;
    points measured in part scale the spec's built-in step figures, none measured leave them as they are)."""
    run = run or CalibrationRun.unbounded()
    world = runtime.dist.world_size
    points = points_at(world, quick)
    # the points are costed from bytes and FLOPs alone (what is left is what the fit explains); the spec's
    # own (built-in) step figures are kept for scaling where the points are too few to fit
    builtin = hardware.spec
    hardware = dataclasses.replace(hardware, spec=builtin.replace(**{f: 0.0 for f in STEP_FIELDS}))
    # Five passes (median): with three, one noisy pass of the pooling points swung the per-id term
    # between 0 and 1.8e-7 s between two calibrations of this 2-core host.
    steps, passes = (40, 5) if budget_s >= 0.1 else (10, 1)
    if run.agreed_left_s("step points: time left") <= 0:
        run.fell_back("trainer step (time limit)")
        return {"steps_per_point": steps, "passes": 0, "points": []}
    run.expect(1 + len(points) * passes)
    # The first trainer in a process pays lazy set-up beyond its warm-up steps: the quick calibration's
    # first point measured 31 ms against 12 ms for the same point with six more layers (2 ranks).
    run.measuring(f"step warm-up {points[0].name}")
    start = time.monotonic()
    warm = _train_point(points[0], runtime, hardware, steps, run)
    run.measured("step warm-up")
    # Larger points take longer than the first: a pass is planned at twice its time per point (the
    # slowest rank's); the plan follows from figures agreed over the ranks, so it is the same on every rank.
    pass_s = run.agree("step points: pass time", lambda: 2 * (time.monotonic() - start) * len(points), "max")
    left_s = run.agreed_left_s("step points: time left after warm-up")
    steps, pass_s = _shorten(steps, pass_s, left_s)
    if pass_s > left_s:  # not even one pass fits: one is started, and ends with the time (points in part)
        run.expect(-len(points) * (passes - 1))
        passes = 1
    times: list[list[float]] = [[] for _ in points]
    model = [0.0] * len(points)
    done = 0
    for k in range(passes):  # alternate the order: a shared host's load drifts
        if k and run.agreed_left_s(f"step points: time left before pass {k + 1}") < pass_s:
            break
        started = time.monotonic()
        for i in (range(len(points)) if k % 2 == 0 else reversed(range(len(points)))):
            # a later pass may end part way: each point has one
            if run.agreed_left_s(f"step points: time left for {points[i].name} (pass {k + 1})") <= 0:
                break
            run.measuring(f"step {points[i].name} (pass {k + 1})")
            m, model[i] = _train_point(points[i], runtime, hardware, steps, run)
            times[i].append(m)
            run.measured(f"step {points[i].name}")
        done = k + 1
        pass_s = run.agree(f"step points: pass {k + 1} time", lambda s=started: time.monotonic() - s, "max")
    run.expect(sum(map(len, times)) - len(points) * passes)  # the bar's total: what was measured
    if any(not t for t in times):
        got = [i for i, t in enumerate(times) if t]
        out: dict[str, Any] = {"steps_per_point": steps, "passes": done, "points": [
            {"name": points[i].name, "measured_s": sorted(times[i])[len(times[i]) // 2]} for i in got]}
        # Too few points to fit each term, enough to say how far off the built-in figures are on this host
        # as it is now (a busy host's contention included): they are scaled to the points measured; with
        # none, to the warm-up point (its trainer's lazy set-up included: an over-estimate, never 5x under).
        rows = [points[i].terms(world) for i in got] or [points[0].terms(world)]
        seconds = [p["measured_s"] for p in out["points"]] or [warm[0]]
        scale = builtin_scale(rows, seconds, [model[i] for i in got] or [warm[1]], builtin)
        which = f"{len(got)} of {len(points)} points in time" if got else "the warm-up point only"
        run.approximate(f"trainer step ({which}: the built-in figures scaled x{scale:.2f} to it)")
        out["fields"] = {f: getattr(builtin, f) * scale for f in STEP_FIELDS}
        out["builtin_scale"] = scale
        return out
    measured = [sorted(t)[len(t) // 2] for t in times]
    for p, t in zip(points, times, strict=True):
        if len(t) > 1:
            run.spreads[f"step {p.name}"] = Timing.of(t).spread
    for p, m, pred in zip(points, measured, model, strict=True):
        logger.info("step point %s: %.2f ms measured (median of %d), %.2f ms from bytes and FLOPs",
                    p.name, m * 1e3, done, pred * 1e3)
    rows = [p.terms(world) for p in points]
    coeffs = fit(rows, [m - pred for m, pred in zip(measured, model, strict=True)], scale=measured)
    fitted = [pred + sum(c * x for c, x in zip(coeffs, r, strict=True))
              for pred, r in zip(model, rows, strict=True)]
    return {
        "fields": dict(zip(STEP_FIELDS, coeffs, strict=True)),  # in the order of `StepPoint.terms`
        "steps_per_point": steps, "passes": done,
        "points": [{"name": p.name, "tables": p.tables, "dim": p.dim, "batch": p.batch, "pooling": p.pooling,
                    "shardings": list(p.shardings), "measured_s": m, "model_s": pred, "fit_s": f,
                    "spread": Timing.of(t).spread}
                   for p, m, pred, f, t in zip(points, measured, model, fitted, times, strict=True)],
        "fit_max_rel_error": max(abs(f - m) / m for m, f in zip(measured, fitted, strict=True)),
    }
