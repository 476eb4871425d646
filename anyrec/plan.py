"""`anyrec-plan` / `python -m anyrec.plan`: plan a job's sharding offline, for any hardware.

    anyrec-plan model=dlrmv2 optim=adagrad hardware=mi350x topology.world_size=8
    anyrec-plan model=dlrmv2 hardware=mi350x plan.compare=b200 plan.output=plan.json plan.plot=plan.png

The model is built on the meta device (no table memory), so any model plans on any machine, read as the
trainer reads its real one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from omegaconf import DictConfig

from anyrec import _hydra
from anyrec.backends import Hardware, get_backend, resolve_hardware
from anyrec.backends.dispatch import FBGEMM_EMBEDDING, get_impl
from anyrec.backends.hardware import figure_sources
from anyrec.calibration.first_contact import recorded_hstu_rates
from anyrec.config import AnyrecConfig, Precision
from anyrec.data import resolve_batch_size
from anyrec.history.cache import find_for_device
from anyrec.io_checks import writable_file
from anyrec.models.dlrmv4 import ATTENTION_OP
from anyrec.models.family import resolve_family
from anyrec.planner.planned import PlannedJob, plan_job
from anyrec.planner.planner import CoDesignPlanner
from anyrec.planner.report import (
    format_compare,
    format_group_choice,
    format_report,
    plan_json,
    plot_plan,
    write_json_atomic,
)
from anyrec.planner.sequence import offline_attention
from anyrec.planner.types import InfeasiblePlanError, PlanResult
from anyrec.runtime.distributed import ONE_PROCESS, DistInfo
from anyrec.signing import resolve_key
from anyrec.trainer.inputs import host_estimate_of_resident_bytes


def run(cfg: AnyrecConfig, print_fn: Callable[[str], None] = print,
        planner: CoDesignPlanner | None = None) -> PlanResult:
    """Plan, print the report, write plan.output (JSON) and plan.plot (PNG); InfeasiblePlanError (one
    line) when nothing fits, before anything is written. `plan.compare` plans the same job on that SKU
    or file too, each plan costed with its own hardware's figures (an infeasible one is reported)."""
    writable_file(cfg.plan.output, "plan.output")
    writable_file(cfg.plan.plot, "plan.plot")
    backend = get_backend(cfg.backend.name) if cfg.hardware.sku == "auto" else None
    local_ranks = cfg.topology.local_world_size or cfg.topology.world_size
    look = backend is not None and not cfg.hardware.measurements and cfg.trainer.calibrate != "never"
    signing_key = resolve_key(cfg.trainer.signing_key_file)
    cached = find_for_device(backend, ONE_PROCESS, local_ranks, signing_key=signing_key) if look else None
    sku = str(cached.path) if cached is not None else cfg.hardware.sku
    hardware = resolve_hardware(sku, cfg.hardware.spec, backend, cfg.hardware.measurements)
    compare = resolve_hardware(cfg.plan.compare) if cfg.plan.compare else None
    kernel = cfg.backend.embedding_kernel
    # hardware=auto plans for this machine: the implementation its backend would run; offline, auto is
    # FBGEMM's (what an accelerator SKU runs)
    kernels = backend.select_kernels(cfg.backend) if backend is not None else {}
    impl = (kernels["embedding"] if backend is not None
            else FBGEMM_EMBEDDING if kernel == "auto" else get_impl("embedding", kernel))
    # an HSTU model's attention: this machine's choice, or offline what the planned device runs (Triton's
    # on an accelerator, torch's on a CPU)
    chosen = cfg.backend.attention_kernel
    offline = offline_attention(hardware.spec.torch_device_type) if chosen == "auto" else chosen
    attention = kernels[ATTENTION_OP] if backend is not None else get_impl(ATTENTION_OP, offline)
    meta, family = torch.device("meta"), resolve_family(cfg.model)
    model = family.build_train(cfg.model, meta, meta, {ATTENTION_OP: attention})
    facts = family.workload_facts(cfg.model)
    world, local = cfg.topology.world_size, cfg.topology.local_world_size or cfg.topology.world_size
    # an HSTU job's kernels as a training job of it on this machine measured them (first contact), beside
    # the cached calibration: planned with them, as that job was
    job_batch = resolve_batch_size(cfg.data, world).batch_size
    # the dense part's precision: as this machine's backend resolves it (as the trainer does), or the choice
    # as configured for a device planned offline (auto: as its spec says, DeviceSpec.auto_precision)
    chosen_precision = cfg.trainer.mixed_precision
    precision = backend.dense_precision(chosen_precision) if backend is not None else chosen_precision
    recorded = (recorded_hstu_rates(cached.path, attention.name, precision == Precision.bf16, facts.hstu,
                                    job_batch)
                if cached is not None and facts.hstu is not None else None)
    if recorded is not None:
        hardware = dataclasses.replace(hardware, hstu_rates=(recorded[0],))
    resident = host_estimate_of_resident_bytes(cfg, DistInfo(0, world, 0, local))
    batch = cfg.plan.batch_size or job_batch

    def plan_on(hw: Hardware) -> PlannedJob:
        # this machine's device type for its own hardware (as the trainer plans); a SKU's otherwise
        here = backend is not None and hw is hardware
        return plan_job(cfg, model, family.sparse_module(model), family.sparse_path, facts, hw, impl, world,
                        local, batch, backend.device_type if here else None, resident, planner,
                        attention=attention.name, what_if=True,
                        precision=precision if here else chosen_precision)

    planned = plan_on(hardware)
    if planned.result is None:
        raise ValueError(f"planner={cfg.planner.name} predicts nothing to report; anyrec-plan reports the "
                         f"co-design planner's plan (planner=codesign)")
    result, groups = planned.result, planned.groups
    if groups is not None:
        print_fn(f"sharding group sizes on {world} x {hardware.spec.name} ({local} per host):")
        print_fn(format_group_choice(groups) + "\n")
    print_fn(format_report(result))
    print_fn("figures: " + "\n         ".join(figure_sources(hardware, hardware.embedding_cost(impl))))
    if cached is not None:
        print_fn(f"         this machine's cached calibration ({local_ranks} local rank(s)): {cached.path}")
        if recorded is not None:
            print_fn(f"         HSTU kernels as a training job of this model measured them: {recorded[1]}")
    elif backend is not None:
        print_fn(f"         no calibration cached for this machine at {local_ranks} local rank(s): the "
                 f"{backend.name} backend's datasheet figures (a hardware=auto training job measures one)")
    other = None
    if compare is not None:
        try:
            other_job = plan_on(compare)
            other, other_groups = other_job.result, other_job.groups
            if other_groups is not None:
                print_fn(f"\ncompare: sharding group sizes on {world} x {compare.spec.name}:")
                print_fn(format_group_choice(other_groups))
        except InfeasiblePlanError as e:
            print_fn(f"\ncompare: {e}")
    if other is not None:
        print_fn(f"\ncompare: {hardware.spec.name} vs {compare.spec.name}, {cfg.topology.world_size} "
                 f"device(s) each")
        print_fn(format_compare(result, other))
        print_fn(f"compare figures: {figure_sources(compare, compare.embedding_cost(impl))[0]}")
    if cfg.plan.output:
        data = plan_json(result)
        if other is not None:
            data["compare"] = plan_json(other)
        write_json_atomic(cfg.plan.output, data)
    if cfg.plan.plot:
        plot_plan(result, cfg.plan.plot, compare=other)
    return result


def main(cfg: DictConfig) -> None:
    """Plan a composed config; infeasible plans and user mistakes: one line, exit status 2."""
    _hydra.run_typed("anyrec-plan", run, cfg)


def cli() -> None:
    """Console entry: the job under Hydra's runner (`_hydra.launch`), one line and exit 2 for a mistake."""
    _hydra.launch("anyrec-plan", main)


if __name__ == "__main__":
    cli()
