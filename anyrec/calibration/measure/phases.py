"""A whole calibration, phase by phase, within a `CalibrationRun`'s time limit and stop signals
(anyrec.calibration.run): the device's figures, the embedding implementations' profiles, with 2+ ranks the
collectives (and 2D's on sharding groups), then the trainer's framework costs (anyrec.calibration.step);
the figures carry a verdict on whether they are this machine's (anyrec.history.trust). The result is
a `Calibration`: the hardware file's `Measurements` (anyrec.backends.hardware_file) and the DeviceSpec
fields they set, written as a hardware file by `hardware_yaml`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from anyrec.backends import Backend
from anyrec.backends.core_load import LoadMeter
from anyrec.backends.dispatch import KernelProfile, implementations
from anyrec.backends.hardware import Hardware
from anyrec.backends.hardware_file import (
    Embedding,
    HardwareFile,
    Measurements,
    Step,
    TrustVerdict,
    read_hardware_file,
)
from anyrec.backends.records import from_data, to_data
from anyrec.calibration.measure.collectives import (
    BUS_FACTOR,
    link_fields,
    measure_collectives,
    measure_subgroup_collectives,
    subgroup_sizes,
)
from anyrec.calibration.measure.device import DeviceFigures, measure_device, spec_fields
from anyrec.calibration.measure.embedding import EMB_POINTS, measure_embedding
from anyrec.calibration.measure.timing import fit_nonnegative
from anyrec.calibration.run import CalibrationRun
from anyrec.calibration.step import measure_step_costs
from anyrec.history.trust import MAX_FIT_ERROR, assess
from anyrec.runtime.distributed import Runtime

# Each phase's share of the time left when it starts (the step points take the rest): the device and
# embedding phases took 4 % and 10 % of a default 2-rank calibration on a quiet 2-core host.
PHASE_SHARE = {"device": 0.1, "embedding": 0.3, "collectives": 0.2, "subgroups": 0.2, "step": 1.0}
SIZES = {  # "quick": the calibration a training job runs on first contact (first_contact)
    "quick": dict(gemm=256, comm_bytes=[1 << 10, 64 << 10, 1 << 20], copy_bytes=4 << 20),
    "small": dict(gemm=512, comm_bytes=[1 << 10, 16 << 10, 256 << 10, 2 << 20], copy_bytes=16 << 20),
    "large": dict(gemm=8192, comm_bytes=[64 << 10, 1 << 20, 16 << 20, 128 << 20], copy_bytes=1 << 30),
}


@dataclass(frozen=True)
class Calibration:
    """A calibration's result: the hardware file's measurements and the DeviceSpec fields they set."""

    measurements: Measurements
    spec_fields: dict[str, Any]

    def timed(self, seconds: float) -> Calibration:
        """The same, recording that the whole calibration took `seconds`."""
        return dataclasses.replace(self, measurements=dataclasses.replace(self.measurements, seconds=seconds))


def calibrate(runtime: Runtime, size: str = "small", budget_s: float = 0.5,
              run: CalibrationRun | None = None) -> Calibration:
    """Every measurement on `runtime`'s device, with its ranks, and the DeviceSpec fields they determine;
    the step points' trainers run in `runtime` (its group and core binding). Within `run`'s time limit
    (phases past their share keep the datasheet's figures) and stop signals; `trust` says whether the
    figures are this machine's (the load on the process's cores before binding, the spreads, the fits)."""
    run = run or CalibrationRun.unbounded()
    backend, device, world = runtime.backend, runtime.device, runtime.dist.world_size
    meter = LoadMeter(runtime.cores)
    s = SIZES[size]
    took: dict[str, float] = {}  # seconds per phase: what a calibration's time went to
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        took[phase], clock = time.perf_counter() - clock, time.perf_counter()

    run.expect((1 if device.type == "cpu" else 2 + backend.pins_host_memory()) + 3)
    run.phase(PHASE_SHARE["device"])
    mine = measure_device(backend, device, size, s["copy_bytes"], s["gemm"], budget_s, run)
    # Each rank measured alone; the figures every rank's step points are costed with are rank 0's.
    device_figures = from_data(DeviceFigures, run.agree("device figures", lambda: to_data(mine)), "device")
    lap("device")
    fields = spec_fields(backend, device_figures)
    spec = backend.device_spec().replace(**{k: v for k, v in fields.items() if k != "name"})
    run.expect(len(implementations("embedding")) * len(EMB_POINTS[size]))
    run.phase(PHASE_SHARE["embedding"])
    measured = measure_embedding(backend, device, spec, EMB_POINTS[size], budget_s, run)
    embedding = from_data(dict[str, Embedding], run.agree("embedding figures", lambda: to_data(measured)),
                          "measurements.embedding")
    lap("embedding")
    collectives = subgroups = None
    if world > 1:
        run.phase(PHASE_SHARE["collectives"])
        if run.agreed_left_s("collectives: time left") > 0:  # a collective: the ranks decide alike
            run.expect(len(BUS_FACTOR) * len(s["comm_bytes"]))
            collectives = measure_collectives(device, s["comm_bytes"], backend, budget_s, world, run)
            fields.update(link_fields(collectives))
        else:
            run.fell_back("collectives (time limit)")
        lap("collectives")
    if subgroup_sizes(world):  # 2D's groups: each size's all-to-all and replica all-reduce
        run.phase(PHASE_SHARE["subgroups"])
        run.expect(2 * len(subgroup_sizes(world)) * len(s["comm_bytes"]))
        subgroups = measure_subgroup_collectives(device, s["comm_bytes"], backend, budget_s, world, run)
        lap("subgroups")
    # The trainer's framework costs: what the figures measured so far leave unexplained in real steps,
    # at this world size (one rank's step has no collectives, no DDP and may skip sharding altogether).
    profiles = {n: KernelProfile(**dataclasses.asdict(e.profile)) for n, e in embedding.items()
                if e.profile is not None}
    spec = backend.device_spec().replace(**{k: v for k, v in fields.items() if k != "name"})
    run.phase(PHASE_SHARE["step"])
    step = from_data(Step, measure_step_costs(runtime, Hardware(spec, profiles), budget_s, fit_nonnegative,
                                              size == "quick", run), "measurements.step")
    if step.fit_max_rel_error is not None and step.fit_max_rel_error > MAX_FIT_ERROR:
        # a busy host's points scatter; its fit is still this host's figure, the built-in one is not
        run.approximate(f"trainer step (fit error {step.fit_max_rel_error * 100:.0f} %)")
    if step.fields is not None:
        fields.update(to_data(step.fields))
    lap("step")
    choice = runtime.binding.bind
    # the verdict (what is cached as trusted) is rank 0's: its load sample, spreads and fallbacks
    trust = run.agree("trust verdict", lambda: assess(meter.read(), meter.cores, run.spreads, run.fallbacks,
                                                      run.approximated).to_dict())
    measurements = Measurements(
        **dataclasses.asdict(device_figures.copy), gemm_flops=device_figures.gemm_flops,
        dlrm_mlp=device_figures.dlrm_mlp, embedding=embedding, collectives=collectives,
        collectives_subgroups=subgroups,
        # kept for the record when too few points to fit, under a name no DeviceSpec field is read from
        step=step if step.fields is not None else None, step_unused=step if step.fields is None else None,
        phase_s=took, threads=torch.get_num_threads(), bind_cores=runtime.bound, spread=dict(run.spreads),
        bind_rule=choice.describe() if choice is not None else None,
        trust=from_data(TrustVerdict, trust, "measurements.trust"),
        measured_fields=[k for k in fields if k != "name"])
    return Calibration(measurements, fields)


def hardware_yaml(backend: Backend, calibration: Calibration) -> dict[str, Any]:
    """The hardware file's data: the measurements, then the backend's spec with the measured fields
    replaced; checked as it will be read (anyrec never writes a file it would refuse)."""
    spec = backend.device_spec()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    m = calibration.measurements
    # Measurements first, the spec (ending with the measured fields) last: a file cut short anywhere then
    # lacks a field it claims to have measured, or its spec altogether, and is refused when read (an
    # assumed field with a default, such as auto_precision, is never the line a cut would lose unseen).
    kept = {k: v for k, v in spec.to_dict().items() if k not in calibration.spec_fields}
    fields = {**kept, "source": f"anyrec.calibrate on {backend.describe()}, {stamp}: "
                                f"{', '.join(m.measured_fields)} measured; the rest from "
                                f"{spec.source or spec.name}",
              **calibration.spec_fields}
    data = to_data(HardwareFile(measurements=m, spec=fields))
    read_hardware_file(data, "the calibration measured")
    return data
