"""The embedding implementations' costs: per registered implementation, a training step timed at several
points and fitted into its KernelProfile, in the planner's own terms (anyrec.planner.estimators)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec.backends import Backend
from anyrec.backends.dispatch import Impl, KernelProfile, availability, implementations
from anyrec.backends.hardware import EmbeddingCost
from anyrec.backends.hardware_file import Embedding, EmbeddingPoint, Profile
from anyrec.backends.specs import DeviceSpec
from anyrec.calibration.measure.timing import fit_nonnegative, timed
from anyrec.calibration.run import CalibrationRun
from anyrec.history.trust import MAX_FIT_ERROR
from anyrec.kernels.optimizers import OptimizerConfig
from anyrec.planner.estimators import lookup_time_s
from anyrec.planner.types import Placement, TableSpec, Topology

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
                      budget_s: float, run: CalibrationRun | None = None) -> dict[str, Embedding]:
    """Per registered embedding implementation: step seconds per point and the fitted profile (none where
    the run's phase ended before every point was measured, or the fit misses a point by > MAX_FIT_ERROR:
    the implementation keeps its built-in profile, and the run says so)."""
    run = run or CalibrationRun.unbounded()
    compute = device.type  # the planner's compute device: cpu, or any accelerator's device type
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    out: dict[str, Embedding] = {}
    for impl in implementations("embedding"):
        reason = availability(backend, "embedding", impl.name)
        if reason is not None:
            out[impl.name] = Embedding(skipped=reason)
            continue
        measured: list[float] = []
        try:
            for point in points:
                if run.expired():
                    break
                measured.append(timed(f"embedding {impl.name} {_point_name(point)}",
                                      _embedding_step(impl, device, point), backend, budget_s, run))
        except (RuntimeError, NotImplementedError, ValueError) as e:
            out[impl.name] = Embedding(skipped=f"failed: {str(e).splitlines()[0][:160]}")
            continue
        if len(measured) < len(points):
            out[impl.name] = Embedding(skipped=f"{len(measured)} of {len(points)} points measured within the "
                                               "time limit: built-in profile")
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
        pts = [EmbeddingPoint(tables=p[0], rows=p[1], dim=p[2], batch=p[3], pooling=p[4], step_s=m, fit_s=f,
                              spread=run.spreads.get(f"embedding {impl.name} {_point_name(p)}", 0.0))
               for p, m, f in zip(points, measured, pred, strict=True)]
        if error > MAX_FIT_ERROR:  # this host's figure all the same (a busy host's points scatter)
            run.approximate(f"embedding {impl.name} (fit error {error * 100:.0f} %)")
        out[impl.name] = Embedding(profile=Profile(**dataclasses.asdict(profile)), points=pts,
                                   fit_max_rel_error=error)
    return out


def _point_name(point: tuple) -> str:
    t, rows, dim, batch, pooling = point
    return f"T{t} R{rows} D{dim} B{batch} P{pooling}"
