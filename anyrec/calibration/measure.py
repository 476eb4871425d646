"""The calibration's measurements: what the planner costs, measured on this device and fitted in the
planner's own terms, as a hardware YAML's `measurements` and spec fields.

Copy and host->device bandwidth; per embedding implementation, a training step at several points fitted
into its KernelProfile; GEMM and DLRM-MLP FLOP/s; with 2+ ranks, collectives fitted into latency + bytes /
bus bandwidth, and where the world has sharding groups to form (4 ranks: groups of 2), 2D's all-to-all
within them and all-reduce across their replicas; and the trainer's framework costs
(anyrec.calibration.step). Within a `CalibrationRun`'s time limit and stop signals
(anyrec.calibration.run); the figures carry a verdict on whether they are this machine's
(anyrec.calibration.trust). `anyrec.calibrate` (the command) and the calibration on first
contact (anyrec.calibration.first_contact) both measure with `calibrate`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec.backends import Backend
from anyrec.backends.core_load import LoadMeter
from anyrec.backends.dispatch import Impl, KernelProfile, availability, implementations
from anyrec.backends.hardware import EmbeddingCost, Hardware
from anyrec.backends.specs import DeviceSpec
from anyrec.calibration.run import CalibrationRun, Timing
from anyrec.calibration.step import measure_step_costs
from anyrec.history.trust import MAX_FIT_ERROR, Trust, assess
from anyrec.kernels.optimizers import OptimizerConfig
from anyrec.planner.estimators import lookup_time_s
from anyrec.planner.twod import GroupLayout
from anyrec.planner.types import Placement, TableSpec, Topology
from anyrec.runtime.distributed import Runtime

logger = logging.getLogger("anyrec.calibrate")

# Each phase's share of the time left when it starts (the step points take the rest): the device and
# embedding phases took 4 % and 10 % of a default 2-rank calibration on a quiet 2-core host.
PHASE_SHARE = {"device": 0.1, "embedding": 0.3, "collectives": 0.2, "subgroups": 0.2, "step": 1.0}
OPTIMIZER = "adagrad"  # the default config's; the profile's bytes term covers any optimizer's state
# Embedding step points: (tables, rows, dim, batch, pooling). They vary ids (pooling, batch) and bytes per
# id (dim) independently, and one is tiny, so the fit can tell per-row, per-byte and per-launch costs apart.
EMB_POINTS = {
    "small": [(1, 1_000, 16, 32, 1), (2, 5_000, 16, 128, 8), (2, 5_000, 128, 128, 8),
              (2, 5_000, 64, 128, 32), (4, 10_000, 64, 64, 4), (2, 5_000, 256, 64, 2)],
    "large": [(1, 10_000, 16, 256, 1), (8, 1_000_000, 16, 16384, 8), (8, 1_000_000, 128, 16384, 8),
              (8, 1_000_000, 64, 16384, 32), (16, 1_000_000, 64, 8192, 4), (8, 1_000_000, 256, 8192, 2)],
}
EMB_POINTS["quick"] = EMB_POINTS["small"]  # tiny already: what takes time is the trainer's step points
# DLRM MLP shapes: bottom (13 dense features) and top (interaction output) stacks, batch per rank.
DLRM_MLP = {"small": dict(batch=256, layers=[13, 512, 256, 64, 512, 256, 1]),
            "large": dict(batch=8192, layers=[13, 512, 256, 128, 1024, 1024, 512, 256, 1])}
DLRM_MLP["quick"] = DLRM_MLP["small"]
SIZES = {  # "quick": the calibration a training job runs on first contact (first_contact)
    "quick": dict(gemm=256, comm_bytes=[1 << 10, 64 << 10, 1 << 20], copy_bytes=4 << 20),
    "small": dict(gemm=512, comm_bytes=[1 << 10, 16 << 10, 256 << 10, 2 << 20], copy_bytes=16 << 20),
    "large": dict(gemm=8192, comm_bytes=[64 << 10, 1 << 20, 16 << 20, 128 << 20], copy_bytes=1 << 30),
}


def timeit(fn: Callable[[], Any], backend: Backend, budget_s: float, min_reps: int = 3,
           reps: int | None = None, run: CalibrationRun | None = None) -> Timing:
    """Seconds per call of `fn` (median and spread): one warm-up, then repeat until the budget is spent
    (collectives pass a fixed `reps`: every rank must make the same number of calls). Within `run`, a
    stop signal ends it at once and the phase's end after one timed call."""
    run = run or CalibrationRun.unbounded()
    run.check()
    fn()
    backend.synchronize()
    times: list[float] = []
    start = time.perf_counter()
    while (len(times) < reps if reps is not None else
           not times or (not run.expired() and (len(times) < min_reps or (
               time.perf_counter() - start < budget_s and len(times) < 200)))):
        run.check()
        t0 = time.perf_counter()
        fn()
        backend.synchronize()
        times.append(time.perf_counter() - t0)
    return Timing.of(times)


def fit_nonnegative(rows: list[list[float]], y: list[float], scale: list[float] | None = None) -> list[float]:
    """Least squares of `y ~ rows @ c` with c >= 0, minimising error relative to `scale` (default `y`:
    the points span orders of magnitude): the best unconstrained fit over every subset of the columns
    whose coefficients all come out non-negative (exact; 2^columns small solves)."""
    n = len(rows[0])
    X = torch.tensor(rows, dtype=torch.float64)
    Y = torch.tensor(y, dtype=torch.float64)
    w = 1.0 / torch.tensor(scale if scale is not None else y, dtype=torch.float64)
    best, best_err = [0.0] * n, float("inf")
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            Xs = X[:, list(cols)] * w[:, None]
            sol = torch.linalg.lstsq(Xs, (Y * w)[:, None]).solution[:, 0]
            if (sol < 0).any():
                continue
            err = float(((Xs @ sol - Y * w) ** 2).sum())
            if err < best_err:
                best_err, best = err, [0.0] * n
                for c, v in zip(cols, sol.tolist(), strict=True):
                    best[c] = v
    return best


def _timed(name: str, fn: Callable[[], Any], backend: Backend, budget_s: float,
           run: CalibrationRun | None) -> float:
    """Median seconds of `fn` as measurement `name` (shown on the run's bar, its spread recorded)."""
    run = run or CalibrationRun.unbounded()
    run.measuring(name)
    timing = timeit(fn, backend, budget_s, run=run)
    run.measured(name, timing)
    return timing.median_s


def measure_copy(backend: Backend, device: torch.device, nbytes: int, budget_s: float,
                 run: CalibrationRun | None = None) -> dict[str, float]:
    """Device copy bandwidth (read + write); on accelerators host->device from pageable memory, and from
    page-locked memory where the backend can pin it (the spec's h2d figure; left unmeasured elsewhere)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    out = {"copy_bw_bytes_per_s": 2 * nbytes / _timed("copy", lambda: dst.copy_(src), backend, budget_s, run)}
    if device.type != "cpu":
        if backend.pins_host_memory():
            pinned = backend.pinned_empty(nbytes // 4, dtype=torch.float32)
            out["h2d_bw_bytes_per_s"] = nbytes / _timed(
                "h2d pinned", lambda: dst.copy_(pinned, non_blocking=True), backend, budget_s, run)
        pageable = torch.empty(nbytes // 4, dtype=torch.float32)
        out["h2d_pageable_bw_bytes_per_s"] = nbytes / _timed("h2d pageable", lambda: dst.copy_(pageable),
                                                             backend, budget_s, run)
    return out


def measure_gemm(backend: Backend, device: torch.device, n: int, budget_s: float,
                 run: CalibrationRun | None = None) -> dict[str, float]:
    """Achieved dense GEMM FLOP/s for fp32 and bf16 (n x n x n)."""
    out = {}
    for dtype, key in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        # CPUs without bf16 matrix units are slow at bf16: a smaller problem keeps the run short.
        m = n if device.type != "cpu" or dtype == torch.float32 else max(128, n // 2)
        a = torch.randn(m, m, device=device, dtype=dtype)
        b = torch.randn(m, m, device=device, dtype=dtype)
        out[key] = 2 * m**3 / _timed(f"gemm {key}", lambda a=a, b=b: torch.mm(a, b), backend, budget_s, run)
    return out


def measure_dlrm_mlp(backend: Backend, device: torch.device, batch: int, layers: list[int],
                     budget_s: float, run: CalibrationRun | None = None) -> dict[str, float]:
    """fp32 FLOP/s of a DLRM-shaped MLP's forward + backward, 6 per parameter per sample as planned."""
    mods: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(layers):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    mlp = torch.nn.Sequential(*mods[:-1]).to(device)
    x = torch.randn(batch, layers[0], device=device)
    params = sum(p.numel() for p in mlp.parameters())

    def step() -> None:
        mlp(x).sum().backward()

    sec = _timed("dlrm mlp", step, backend, budget_s, run)
    return {"flops": 6.0 * params * batch / sec, "params": params, "batch": batch, "step_s": sec}


def _embedding_step(impl: Impl, device: torch.device, point: tuple) -> Callable[[], Any]:
    """One training step of `impl` at `point`: forward, backward with the fused optimizer update."""
    t, rows, dim, batch, pooling = point
    g = torch.Generator().manual_seed(0)
    ids_N = torch.randint(0, rows, (t * batch * pooling,), generator=g).to(device)
    grad = torch.ones(batch, t * dim, device=device)
    if impl.unsharded_builder is not None:
        configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                                      feature_names=[f"f{i}"]) for i in range(t)]
        ebc = impl.build_unsharded(configs, optimizer=OptimizerConfig(kind=OPTIMIZER), device=device)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            [f"f{i}" for i in range(t)], ids_N, torch.full((t * batch,), pooling, device=device))
        return lambda: ebc(kjt).values().backward(grad)
    if impl.compute_kernel("hbm") != "fused":
        raise NotImplementedError(f"{impl.name} has no single-device build to time")
    # torchrec's "fused" kernel is FBGEMM's training TBE: time it directly, optimizer fused.
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    on_cpu = device.type == "cpu"
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST if on_cpu else EmbeddingLocation.DEVICE,
          ComputeDevice.CPU if on_cpu else ComputeDevice.CUDA)] * t,
        optimizer=EmbOptimType.EXACT_ADAGRAD, learning_rate=0.01, device=device)
    offsets = torch.arange(0, t * batch * pooling + 1, pooling, device=device)
    return lambda: tbe(ids_N, offsets).backward(grad)


def _lookup_s(profile: KernelProfile, impl: Impl, spec: DeviceSpec, compute: str, point: tuple) -> float:
    """The planner's lookup seconds (forward + backward) for one embedding step of `impl` at `point`."""
    t, rows, dim, batch, pooling = point
    table = TableSpec("t", rows, dim, float(pooling), ["f"])
    fwd, bwd = lookup_time_s(batch * pooling, batch, dim, table, Placement.HBM, Topology(spec, 1, 1, compute),
                             OPTIMIZER, EmbeddingCost.builtin(impl), profile=profile)
    return t * (fwd + bwd)


def _planner_terms(impl: Impl, spec: DeviceSpec, compute: str, point: tuple) -> tuple[float, float]:
    """(ids looked up, seconds of bytes at full bandwidth) for `point`, in the planner's own terms:
    the per-row term is charged 3x per id (forward, backward read and write), as lookup_time_s does."""
    t, _, _, batch, pooling = point
    unit = KernelProfile(1.0, impl.profile.access_bytes if impl.profile else 32)
    return 3.0 * t * batch * pooling, _lookup_s(unit, impl, spec, compute, point)


def measure_embedding(backend: Backend, device: torch.device, spec: DeviceSpec, points: list[tuple],
                      budget_s: float, run: CalibrationRun | None = None) -> dict[str, Any]:
    """Per registered embedding implementation: step seconds per point and the fitted profile (none where
    the run's phase ended before every point was measured, or the fit misses a point by > MAX_FIT_ERROR:
    the implementation keeps its built-in profile, and the run says so)."""
    run = run or CalibrationRun.unbounded()
    compute = device.type  # the planner's compute device: cpu, or any accelerator's device type
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    out: dict[str, Any] = {}
    for impl in implementations("embedding"):
        reason = availability(backend, "embedding", impl.name)
        if reason is not None:
            out[impl.name] = {"skipped": reason}
            continue
        measured: list[float] = []
        try:
            for point in points:
                if run.expired():
                    break
                measured.append(_timed(f"embedding {impl.name} {_point_name(point)}",
                                       _embedding_step(impl, device, point), backend, budget_s, run))
        except (RuntimeError, NotImplementedError, ValueError) as e:
            out[impl.name] = {"skipped": f"failed: {str(e).splitlines()[0][:160]}"}
            continue
        if len(measured) < len(points):
            out[impl.name] = {"skipped": f"{len(measured)} of {len(points)} points measured within the time "
                                         "limit: built-in profile"}
            run.fell_back(f"embedding {impl.name} (time limit)")
            continue
        rows = [[1.0, *_planner_terms(impl, spec, compute, p)] for p in points]
        launch, per_row, per_byte = fit_nonnegative(rows, measured)
        profile = KernelProfile(
            bw_efficiency=min(1.0, 1.0 / per_byte) if per_byte > 0 else 1.0,
            access_bytes=impl.profile.access_bytes if impl.profile else 32,
            per_row_s=per_row, per_launch_s=min(launch, 0.5),
            source=f"measured by anyrec.calibrate on {backend.describe()} ({stamp}): forward + backward "
                   f"+ fused {OPTIMIZER} at {len(points)} points, least squares")
        pred = [_lookup_s(profile, impl, spec, compute, p) + profile.per_launch_s for p in points]
        error = max(abs(f - m) / m for m, f in zip(measured, pred, strict=True))
        pts = [{"tables": p[0], "rows": p[1], "dim": p[2], "batch": p[3], "pooling": p[4], "step_s": m,
                "fit_s": f, "spread": run.spreads.get(f"embedding {impl.name} {_point_name(p)}", 0.0)}
               for p, m, f in zip(points, measured, pred, strict=True)]
        if error > MAX_FIT_ERROR:  # this host's figure all the same (a busy host's points scatter)
            run.approximate(f"embedding {impl.name} (fit error {error * 100:.0f} %)")
        out[impl.name] = {"profile": dataclasses.asdict(profile), "points": pts, "fit_max_rel_error": error}
    return out


def _point_name(point: tuple) -> str:
    t, rows, dim, batch, pooling = point
    return f"T{t} R{rows} D{dim} B{batch} P{pooling}"


# Bus bytes per collective of `n` input bytes over `w` ranks (nccl-tests' busbw conventions).
_BUS_FACTOR = {
    "all_to_all": lambda n, w: n * (w - 1) / w,
    "all_reduce": lambda n, w: 2 * n * (w - 1) / w,
    "reduce_scatter": lambda n, w: n * (w - 1) / w,
}


def _collective(op: str, nbytes: int, ranks: int, device: torch.device,
                group: dist.ProcessGroup | None = None) -> Callable[[], Any]:
    x = torch.ones(nbytes // 4 // ranks * ranks, dtype=torch.float32, device=device)
    if op == "all_to_all":
        y = torch.empty_like(x)
        return lambda: dist.all_to_all_single(y, x, group=group)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    y = torch.empty(x.numel() // ranks, dtype=x.dtype, device=x.device)
    return lambda: dist.reduce_scatter_tensor(y, x, group=group)


def _measure_fit(op: str, sizes: list[int], ranks: int, device: torch.device, backend: Backend,
                 budget_s: float, run: CalibrationRun, group: dist.ProcessGroup | None = None,
                 label: str = "") -> dict:
    """`op`'s seconds per size over `group` of `ranks` ranks (default: the world), the slowest rank's
    median (every rank of the world takes part), fitted into latency + bus bytes / bus bandwidth; or why
    it was skipped."""
    times: list[float] = []
    failed = None
    try:
        for n in sizes:
            name = f"{label}{op} {n} B"
            run.measuring(name)
            timing = timeit(_collective(op, n, ranks, device, group), backend, budget_s, reps=10, run=run)
            run.measured(name, timing)
            times.append(timing.median_s)
    except (RuntimeError, NotImplementedError) as e:  # e.g. a process group without the op
        failed = str(e).splitlines()[0][:160]
    # a rank whose op failed skips the reduction below: every rank must know before it
    failed = run.agree(f"{label}{op}: failed on a rank", lambda: failed or "", "max")
    if failed:
        return {"skipped": failed}
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step waits for the slowest rank
    times = t.tolist()
    bus = _BUS_FACTOR[op]
    alpha, per_byte = fit_nonnegative([[1.0, bus(n, ranks)] for n in sizes], times)
    return {"sizes_bytes": sizes, "seconds": times, "latency_s": alpha,
            "bus_bw_bytes_per_s": 1.0 / per_byte if per_byte > 0 else max(
                bus(n, ranks) / s for n, s in zip(sizes, times, strict=True))}


def measure_collectives(device: torch.device, sizes: list[int], backend: Backend, budget_s: float,
                        world: int, run: CalibrationRun | None = None) -> dict:
    """Each collective's seconds per size (slowest rank's median), fitted into latency + bus bytes / bw."""
    run = run or CalibrationRun.unbounded()
    out: dict[str, Any] = {"world_size": world}
    for op in _BUS_FACTOR:
        out[op] = _measure_fit(op, sizes, world, device, backend, budget_s, run)
    return out


def subgroup_sizes(world: int) -> list[int]:
    """The sharding group sizes 2D can run on `world` ranks with replicas to average: proper divisors >= 2."""
    return [g for g in range(2, world) if world % g == 0]


def measure_subgroup_collectives(device: torch.device, sizes: list[int], backend: Backend, budget_s: float,
                                 world: int, run: CalibrationRun | None = None) -> dict[int, dict]:
    """Per sharding group size of `world` (`subgroup_sizes`), 2D's collectives on the job's own ranks laid
    out as torchrec's DMPCollection lays them out (anyrec.planner.twod.GroupLayout): the all-to-all within
    every sharding group at once and the all-reduce within every replica group at once, each fitted as
    `measure_collectives` fits the world's. A size the time limit leaves no room for says so (the ranks
    decide alike) and keeps the world's figures."""
    run = run or CalibrationRun.unbounded()
    out: dict[int, dict] = {}
    for g in subgroup_sizes(world):
        if run.agreed_left_s(f"collectives on groups of {g}: time left") <= 0:
            out[g] = {"skipped": "time limit: the world's figures price this group size"}
            run.fell_back(f"collectives on groups of {g} (time limit)")
            continue
        layout = GroupLayout(world, world, g)  # one host: the calibration's ranks
        # every rank creates every group, in one order (new_group is collective over the world)
        shard_pg, _ = dist.new_subgroups_by_enumeration(layout.sharding_groups())
        replica_pg, _ = dist.new_subgroups_by_enumeration(layout.replica_groups())
        r = layout.replicas
        try:
            out[g] = {"world_size": world, "replicas": r,
                      "all_to_all": _measure_fit("all_to_all", sizes, g, device, backend, budget_s, run,
                                                 shard_pg, f"groups of {g}: "),
                      "all_reduce_replicas": _measure_fit("all_reduce", sizes, r, device, backend, budget_s,
                                                          run, replica_pg, f"replicas of {g}: ")}
        finally:
            for pg in (shard_pg, replica_pg):
                dist.destroy_process_group(pg)
    return out


def calibrate(runtime: Runtime, size: str = "small", budget_s: float = 0.5,
              run: CalibrationRun | None = None) -> dict:
    """Every measurement on `runtime`'s device, with its ranks, as a hardware YAML's `measurements`
    (`spec_fields`: the DeviceSpec fields they determine); the step points' trainers run in `runtime` (its
    group and core binding). Within `run`'s time limit (phases past their share keep the datasheet's
    figures) and stop signals; `trust` says whether the figures are this machine's (the load on the
    process's cores before binding, the spreads, the fits)."""
    run = run or CalibrationRun.unbounded()
    backend, device, world = runtime.backend, runtime.device, runtime.dist.world_size
    meter = LoadMeter(runtime.cores)
    s = SIZES[size]
    m: dict[str, Any] = {}
    took: dict[str, float] = {}  # seconds per phase: what a calibration's time went to
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        took[phase], clock = time.perf_counter() - clock, time.perf_counter()

    run.expect((1 if device.type == "cpu" else 2 + backend.pins_host_memory()) + 3)
    run.phase(PHASE_SHARE["device"])
    m.update(measure_copy(backend, device, s["copy_bytes"], budget_s, run))
    m["gemm_flops"] = measure_gemm(backend, device, s["gemm"], budget_s, run)
    m["dlrm_mlp"] = measure_dlrm_mlp(backend, device, budget_s=budget_s, run=run, **DLRM_MLP[size])
    # Each rank measured alone; the figures every rank's step points are costed with are rank 0's.
    m = run.agree("device figures", lambda: m)
    lap("device")
    fields = spec_fields(backend, m)
    spec = backend.device_spec().replace(**{k: v for k, v in fields.items() if k != "name"})
    run.expect(len(implementations("embedding")) * len(EMB_POINTS[size]))
    run.phase(PHASE_SHARE["embedding"])
    embedding = measure_embedding(backend, device, spec, EMB_POINTS[size], budget_s, run)
    m["embedding"] = run.agree("embedding figures", lambda: embedding)
    lap("embedding")
    if world > 1:
        run.phase(PHASE_SHARE["collectives"])
        if run.agreed_left_s("collectives: time left") > 0:  # a collective: the ranks decide alike
            run.expect(len(_BUS_FACTOR) * len(s["comm_bytes"]))
            m["collectives"] = measure_collectives(device, s["comm_bytes"], backend, budget_s, world, run)
            fields.update(link_fields(m["collectives"]))
        else:
            run.fell_back("collectives (time limit)")
        lap("collectives")
    if subgroup_sizes(world):  # 2D's groups: each size's all-to-all and replica all-reduce
        run.phase(PHASE_SHARE["subgroups"])
        run.expect(2 * len(subgroup_sizes(world)) * len(s["comm_bytes"]))
        m["collectives_subgroups"] = measure_subgroup_collectives(device, s["comm_bytes"], backend, budget_s,
                                                                  world, run)
        lap("subgroups")
    # The trainer's framework costs: what the figures measured so far leave unexplained in real steps,
    # at this world size (one rank's step has no collectives, no DDP and may skip sharding altogether).
    profiles = {n: KernelProfile(**e["profile"]) for n, e in m["embedding"].items() if "profile" in e}
    spec = backend.device_spec().replace(**{k: v for k, v in fields.items() if k != "name"})
    run.phase(PHASE_SHARE["step"])
    step = measure_step_costs(runtime, Hardware(spec, profiles), budget_s, fit_nonnegative, size == "quick",
                              run)
    error = step.get("fit_max_rel_error")
    if error is not None and error > MAX_FIT_ERROR:
        # a busy host's points scatter; its fit is still this host's figure, the built-in one is not
        run.approximate(f"trainer step (fit error {error * 100:.0f} %)")
    if "fields" in step:
        fields.update(step["fields"])
        m["step"] = step
    else:  # kept for the record, under a name no DeviceSpec field is read from
        m["step_unused"] = step
    lap("step")
    m.update(phase_s=took, threads=torch.get_num_threads(), bind_cores=runtime.bound,
             spread=dict(run.spreads))
    choice = getattr(backend, "bind_choice", None)
    if choice is not None:
        m["bind_rule"] = choice.describe()
    # the verdict (what is cached as trusted) is rank 0's: its load sample, spreads and fallbacks
    m["trust"] = run.agree("trust verdict",
                           lambda: assess(meter.read(), meter.cores, run.spreads, run.fallbacks,
                                          run.approximated).to_dict())
    m.update(measured_fields=[k for k in fields if k != "name"], spec_fields=fields)
    return m


def spec_fields(backend: Backend, m: dict) -> dict[str, Any]:
    """DeviceSpec fields set by the device measurements (copy, host->device, GEMM)."""
    spec = backend.device_spec()
    peak = m["gemm_flops"]["fp32"]
    fields: dict[str, Any] = {
        "name": f"{spec.name} (calibrated)",
        "memory_bw_bytes_per_s": m["copy_bw_bytes_per_s"],
        "peak_fp32_flops": peak,
        "peak_bf16_flops": m["gemm_flops"]["bf16"],
        # A small MLP can beat a mid-size square GEMM on a loaded host; the fraction stays <= 1.
        "dense_efficiency": min(1.0, m["dlrm_mlp"]["flops"] / peak),
    }
    if "h2d_bw_bytes_per_s" in m:
        fields["h2d_bw_bytes_per_s"] = m["h2d_bw_bytes_per_s"]
    if backend.device_type == "cpu":
        fields["host_memory_bw_bytes_per_s"] = m["copy_bw_bytes_per_s"]
    return fields


def link_fields(c: dict) -> dict[str, Any]:
    """DeviceSpec scale-up link fields (one launch's ranks share a host): the all-to-all bus bandwidth, as
    achieved (efficiency 1), and the median per-collective latency (an all-reduce counts as two)."""
    out: dict[str, Any] = {}
    if "bus_bw_bytes_per_s" in c.get("all_to_all", {}):
        out["scale_up_bw_bytes_per_s"] = c["all_to_all"]["bus_bw_bytes_per_s"]
        out["comms_efficiency"] = 1.0
    alphas = sorted(c[op]["latency_s"] / (2 if op == "all_reduce" else 1)
                    for op in _BUS_FACTOR if "latency_s" in c.get(op, {}))
    if alphas:
        out["scale_up_latency_s"] = alphas[len(alphas) // 2]
    return out


def hardware_yaml(backend: Backend, m: dict) -> dict:
    """The hardware file: the backend's spec with measured fields replaced, plus the measurements."""
    spec = backend.device_spec()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    measurements = {k: v for k, v in m.items() if k != "spec_fields"}
    fields = {**spec.to_dict(), **m["spec_fields"],
              "source": f"anyrec.calibrate on {backend.describe()}, {stamp}: "
                        f"{', '.join(m['measured_fields'])} measured; the rest from "
                        f"{spec.source or spec.name}"}
    # Measurements first, the spec (ending with measured fields) last: a file cut short anywhere then
    # lacks a field it claims to have measured, or its spec altogether, and is refused when read.
    return {"measurements": measurements, "spec": fields}


def format_table(m: dict) -> str:
    """The measurements as a small text table."""
    rows = [("copy", "", m["copy_bw_bytes_per_s"] / 1e9, "GB/s")]
    rows += [("host->device", variant, m[key] / 1e9, "GB/s") for key, variant in
             (("h2d_bw_bytes_per_s", "pinned"), ("h2d_pageable_bw_bytes_per_s", "pageable")) if key in m]
    rows += [("gemm", dtype, v / 1e12, "TFLOP/s") for dtype, v in m["gemm_flops"].items()]
    rows.append(("dlrm mlp f+b", "fp32", m["dlrm_mlp"]["flops"] / 1e12, "TFLOP/s"))
    skipped = []
    for impl, e in m["embedding"].items():
        if "profile" not in e:
            skipped.append(f"embedding {impl}: {e['skipped']}")
            continue
        p = e["profile"]
        rows += [(f"emb {impl}", "bw_eff", p["bw_efficiency"], "fraction"),
                 (f"emb {impl}", "per_row", p["per_row_s"] * 1e9, "ns"),
                 (f"emb {impl}", "per_launch", p["per_launch_s"] * 1e6, "us"),
                 (f"emb {impl}", "fit_err", e["fit_max_rel_error"] * 100, "% (max)")]
    for op, c in m.get("collectives", {}).items():
        if not isinstance(c, dict):
            continue
        if "skipped" in c:
            skipped.append(f"{op}: {c['skipped']}")
            continue
        variant = f"{m['collectives']['world_size']} ranks"
        rows += [(op, variant, c["bus_bw_bytes_per_s"] / 1e9, "GB/s (bus)"),
                 (op, "latency", c["latency_s"] * 1e6, "us")]
    for g, entry in m.get("collectives_subgroups", {}).items():
        if "skipped" in entry:
            skipped.append(f"collectives on groups of {g}: {entry['skipped']}")
            continue
        for op, ranks in (("all_to_all", f"{g} of {entry['world_size']}"),
                          ("all_reduce_replicas", f"{entry['replicas']} of {entry['world_size']}")):
            c = entry[op]
            if "skipped" in c:
                skipped.append(f"{op} (groups of {g}): {c['skipped']}")
                continue
            name = "all_to_all" if op == "all_to_all" else "all_reduce rep"
            rows += [(name, ranks, c["bus_bw_bytes_per_s"] / 1e9, "GB/s (bus)"),
                     (name, "latency", c["latency_s"] * 1e6, "us")]
    step = m.get("step", {}).get("fields", {})
    rows += [("trainer step", k.removesuffix("_s"), v * 1e6, "us") for k, v in step.items()]
    if "fit_max_rel_error" in m.get("step", {}):
        rows.append(("trainer step", "fit_err", m["step"]["fit_max_rel_error"] * 100, "% (max)"))
    lines = [f"{'measurement':<16} {'variant':<10} {'value':>12}  unit"]
    lines += [f"{a:<16} {b:<10} {v:>12.3f}  {u}" for a, b, v, u in rows]
    return "\n".join(lines + [f"(skipped) {s}" for s in skipped])


def report_trust(m: dict) -> None:
    """Rank 0's one line on whether the figures are this machine's (a warning when they are not)."""
    trust = Trust(**m["trust"])
    (logger.info if trust.trusted else logger.warning)("%s", trust.line())
