"""The device's own figures: copy and host->device bandwidth, GEMM and DLRM-MLP FLOP/s, and the
DeviceSpec fields they set."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from anyrec.backends import Backend
from anyrec.backends.hardware_file import BYTES_PER_S, DlrmMlp, GemmFlops
from anyrec.backends.records import figure
from anyrec.calibration.measure.timing import timed
from anyrec.calibration.run import CalibrationRun

# DLRM MLP shapes: bottom (13 dense features) and top (interaction output) stacks, batch per rank.
DLRM_MLP = {"small": dict(batch=256, layers=[13, 512, 256, 64, 512, 256, 1]),
            "large": dict(batch=8192, layers=[13, 512, 256, 128, 1024, 1024, 512, 256, 1])}
DLRM_MLP["quick"] = DLRM_MLP["small"]


@dataclass(frozen=True, kw_only=True)
class Copy:
    """Copy bandwidths (the hardware file's top-level figures of the same names)."""

    copy_bw_bytes_per_s: float = figure(*BYTES_PER_S, required=True)  # device copy: read + write
    h2d_bw_bytes_per_s: float | None = figure(*BYTES_PER_S)  # host->device from page-locked memory
    h2d_pageable_bw_bytes_per_s: float | None = figure(*BYTES_PER_S)  # host->device from pageable memory


@dataclass(frozen=True, kw_only=True)
class DeviceFigures:
    """What the device phase measures, as one value (the ranks agree on rank 0's)."""

    copy: Copy
    gemm_flops: GemmFlops
    dlrm_mlp: DlrmMlp


def measure_copy(backend: Backend, device: torch.device, nbytes: int, budget_s: float,
                 run: CalibrationRun | None = None) -> Copy:
    """Device copy bandwidth (read + write); on accelerators host->device from pageable memory, and from
    page-locked memory where the backend can pin it (the spec's h2d figure; left unmeasured elsewhere)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_bw = 2 * nbytes / timed("copy", lambda: dst.copy_(src), backend, budget_s, run)
    if device.type == "cpu":
        return Copy(copy_bw_bytes_per_s=copy_bw)
    h2d = None
    if backend.pins_host_memory():
        pinned = backend.pinned_empty(nbytes // 4, dtype=torch.float32)
        h2d = nbytes / timed("h2d pinned", lambda: dst.copy_(pinned, non_blocking=True), backend, budget_s,
                             run)
    pageable = torch.empty(nbytes // 4, dtype=torch.float32)
    pageable_bw = nbytes / timed("h2d pageable", lambda: dst.copy_(pageable), backend, budget_s, run)
    return Copy(copy_bw_bytes_per_s=copy_bw, h2d_bw_bytes_per_s=h2d, h2d_pageable_bw_bytes_per_s=pageable_bw)


def measure_gemm(backend: Backend, device: torch.device, n: int, budget_s: float,
                 run: CalibrationRun | None = None) -> GemmFlops:
    """Achieved dense GEMM FLOP/s for fp32 and bf16 (n x n x n)."""
    out = {}
    for dtype, key in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        # CPUs without bf16 matrix units are slow at bf16: a smaller problem keeps the run short.
        m = n if device.type != "cpu" or dtype == torch.float32 else max(128, n // 2)
        a = torch.randn(m, m, device=device, dtype=dtype)
        b = torch.randn(m, m, device=device, dtype=dtype)
        out[key] = 2 * m**3 / timed(f"gemm {key}", lambda a=a, b=b: torch.mm(a, b), backend, budget_s, run)
    return GemmFlops(**out)


def measure_dlrm_mlp(backend: Backend, device: torch.device, batch: int, layers: list[int],
                     budget_s: float, run: CalibrationRun | None = None) -> DlrmMlp:
    """fp32 FLOP/s of a DLRM-shaped MLP's forward + backward, 6 per parameter per sample as planned."""
    mods: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(layers):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    mlp = torch.nn.Sequential(*mods[:-1]).to(device)
    x = torch.randn(batch, layers[0], device=device)
    params = sum(p.numel() for p in mlp.parameters())

    def step() -> None:
        mlp(x).sum().backward()

    sec = timed("dlrm mlp", step, backend, budget_s, run)
    return DlrmMlp(flops=6.0 * params * batch / sec, params=params, batch=batch, step_s=sec)


def measure_device(backend: Backend, device: torch.device, size: str, copy_bytes: int, gemm: int,
                   budget_s: float, run: CalibrationRun) -> DeviceFigures:
    """Copy, GEMM and DLRM-MLP figures of `device` at calibration `size`."""
    return DeviceFigures(copy=measure_copy(backend, device, copy_bytes, budget_s, run),
                         gemm_flops=measure_gemm(backend, device, gemm, budget_s, run),
                         dlrm_mlp=measure_dlrm_mlp(backend, device, budget_s=budget_s, run=run,
                                                   **DLRM_MLP[size]))


def spec_fields(backend: Backend, m: DeviceFigures) -> dict[str, Any]:
    """DeviceSpec fields set by the device measurements (copy, host->device, GEMM)."""
    spec = backend.device_spec()
    peak = m.gemm_flops.fp32
    fields: dict[str, Any] = {
        "name": f"{spec.name} (calibrated)",
        "memory_bw_bytes_per_s": m.copy.copy_bw_bytes_per_s,
        "peak_fp32_flops": peak,
        "peak_bf16_flops": m.gemm_flops.bf16,
        # A small MLP can beat a mid-size square GEMM on a loaded host; the fraction stays <= 1.
        "dense_efficiency": min(1.0, m.dlrm_mlp.flops / peak),
    }
    if m.copy.h2d_bw_bytes_per_s is not None:
        fields["h2d_bw_bytes_per_s"] = m.copy.h2d_bw_bytes_per_s
    if backend.device_type == "cpu":
        fields["host_memory_bw_bytes_per_s"] = m.copy.copy_bw_bytes_per_s
    return fields
