"""Where a step's time goes, measured: the last `trainer.breakdown_steps` steps of a run under
torch.profiler, split into the step's phases beside the plan's predicted split.

The trainer labels its three step functions (`anyrec.forward`, `anyrec.backward` with the fused
embedding update inside it, `anyrec.optimizer` for the dense one); the rest of a step on the training
thread (the next batch's input distribution, data, loss bookkeeping) is `other`. `collectives` is the
training thread's time issuing collectives (c10d ops) or waiting for their results (torchrec's
awaitables' `wait()`), counted once where they nest and also inside the phase it happened in: comms
are separable where the thread waits for them (gloo on a CPU). On an accelerator the thread runs
ahead of the device, so its phases measure launches; the device's own kernel time is added as
`device_compute` and `device_comms` (NCCL/RCCL kernels).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule, supported_activities

from anyrec.planner.types import Perf

logger = logging.getLogger(__name__)

PHASES = ("forward", "backward", "optimizer")
LABEL = "anyrec.{}"  # the record_function name of each phase
STEP_EVENT = "ProfilerStep"  # torch.profiler's range around each profiled step ("ProfilerStep*" or "#N")
COLLECTIVE_PREFIX = "c10d::"  # torch.distributed's collective ops as the profiler names them
# torchrec's ranges around waiting for a collective's result: "## <Awaitable> wait() ##" and the
# all-to-all autograd functions' "All2All_Pooled_Wait" / "..._WaitBackward".
WAIT_MARKS = ("wait()", "_Wait")
COMMS_KERNELS = ("nccl", "rccl")  # device kernels of the collectives libraries
# One step to start up in (it pays the profiler's set-up and, after a drain, the pipeline's refill)
PROFILER_WARMUP_STEPS = 1
KEYS = ("step", *PHASES, "other", "collectives", "device_compute", "device_comms")


def phase(name: str):
    """The profiler range of step phase `name` (one of PHASES); cheap when no profiler runs."""
    return record_function(LABEL.format(name))


def breakdown_window(steps: int, warm_step: int, breakdown_steps: int) -> int:
    """The first step of the profiled window (its warm-up step included) of a run that ends at `steps`
    and times from `warm_step`; ValueError without room for it and a timed step before it."""
    first = steps - breakdown_steps - PROFILER_WARMUP_STEPS
    if first <= warm_step:
        raise ValueError(f"trainer.breakdown_steps={breakdown_steps} needs trainer.steps > "
                         f"{warm_step + breakdown_steps + PROFILER_WARMUP_STEPS} (warm-up, timed steps, the "
                         f"profiler's own warm-up step, then the profiled steps); got {steps}")
    return first


class StepProfiler(profile):
    """torch.profiler over `steps` steps after one warm-up step; `step()` after each training step."""

    def __init__(self, steps: int, device_type: str) -> None:
        # the device's own activity where torch's profiler has one for its type and can record it here
        # (CUDA and ROCm, XPU, MTIA, HPU); other devices: host activity only
        device = getattr(ProfilerActivity, device_type.upper(), None)
        super().__init__(activities=list({ProfilerActivity.CPU} | ({device} & supported_activities())),
                         schedule=schedule(wait=0, warmup=PROFILER_WARMUP_STEPS, active=steps, repeat=1))
        self.steps = steps
        self._device = device_type != "cpu"

    def ms_per_step(self) -> dict[str, float]:
        """Milliseconds per profiled step in each of KEYS (after the profiler stopped)."""
        events = self.events()
        totals = dict.fromkeys(KEYS, 0.0)
        steps = 0
        labels = {LABEL.format(p): p for p in PHASES}
        # The training thread is the one that runs the steps; collectives' own threads (gloo's) are not it.
        thread = next((e.thread for e in events if e.name.startswith(STEP_EVENT)), None)
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU:
                if e.thread != thread:
                    continue
                if e.name.startswith(STEP_EVENT):
                    totals["step"] += e.cpu_time_total
                    steps += 1
                elif e.name in labels:
                    totals[labels[e.name]] += e.cpu_time_total
                if _is_comms(e.name) and not _inside_comms(e):
                    totals["collectives"] += e.cpu_time_total
            elif self._device:
                kind = "device_comms" if any(k in e.name.lower() for k in COMMS_KERNELS) else "device_compute"
                totals[kind] += e.device_time_total
        if steps == 0:
            return dict.fromkeys(KEYS, 0.0)
        totals["other"] = max(0.0, totals["step"] - sum(totals[p] for p in PHASES))
        return {k: v / steps / 1e3 for k, v in totals.items()}  # the profiler counts microseconds


def _is_comms(name: str) -> bool:
    """Whether a profiler range issues a collective or waits for one."""
    return name.startswith(COLLECTIVE_PREFIX) or any(m in name for m in WAIT_MARKS)


def _inside_comms(event: Any) -> bool:
    """Whether a comms range runs inside another (counted there)."""
    parent = event.cpu_parent
    while parent is not None:
        if _is_comms(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def predicted_phases(perf: Perf | None) -> dict[str, float] | None:
    """The plan's milliseconds per step of the rank it predicts slowest, in the phases it models."""
    if perf is None:
        return None
    return {"step": perf.total_s * 1e3, "forward": (perf.fwd_compute_s + perf.fwd_comms_s) * 1e3,
            "backward": (perf.bwd_compute_s + perf.bwd_comms_s) * 1e3, "collectives": perf.comms_s * 1e3}


def format_breakdown(per_rank: list[dict[str, float]], predicted: dict[str, float] | None) -> str:
    """A table: one row per rank, the plan's prediction last."""
    cols = [k for k in KEYS if any(r[k] for r in per_rank) or k in ("step", *PHASES, "other")]
    lines = ["ms/step  " + " ".join(f"{k:>14}" for k in cols)]
    for i, r in enumerate(per_rank):
        lines.append(f"rank {i:<3} " + " ".join(f"{r[k]:>14.3f}" for k in cols))
    if predicted is not None:
        lines.append("plan     " + " ".join(f"{predicted[k]:>14.3f}" if k in predicted else f"{'-':>14}"
                                            for k in cols))
    return "\n".join(lines)
