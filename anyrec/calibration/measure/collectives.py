"""The collectives: with 2+ ranks, each collective over the world fitted into latency + bus bytes / bus
bandwidth, and where the world has sharding groups to form (4 ranks: groups of 2), 2D's all-to-all within
them and all-reduce across their replicas; and the DeviceSpec link fields they set."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from anyrec.backends import Backend
from anyrec.backends.hardware_file import Collectives, Link, Subgroup
from anyrec.calibration.measure.timing import fit_nonnegative, timeit
from anyrec.calibration.run import CalibrationRun
from anyrec.planner.twod import GroupLayout

# Bus bytes per collective of `n` input bytes over `w` ranks (nccl-tests' busbw conventions).
BUS_FACTOR: dict[str, Callable[[int, int], float]] = {
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


def measure_fit(op: str, sizes: list[int], ranks: int, device: torch.device, backend: Backend,
                budget_s: float, run: CalibrationRun, group: dist.ProcessGroup | None = None,
                label: str = "") -> Link:
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
        return Link(skipped=failed)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step waits for the slowest rank
    times = t.tolist()
    bus = BUS_FACTOR[op]
    alpha, per_byte = fit_nonnegative([[1.0, bus(n, ranks)] for n in sizes], times)
    return Link(sizes_bytes=sizes, seconds=times, latency_s=alpha,
                bus_bw_bytes_per_s=1.0 / per_byte if per_byte > 0 else max(
                    bus(n, ranks) / s for n, s in zip(sizes, times, strict=True)))


def measure_collectives(device: torch.device, sizes: list[int], backend: Backend, budget_s: float,
                        world: int, run: CalibrationRun | None = None) -> Collectives:
    """Each collective's seconds per size (slowest rank's median), fitted into latency + bus bytes / bw."""
    run = run or CalibrationRun.unbounded()
    return Collectives(world_size=world, **{op: measure_fit(op, sizes, world, device, backend, budget_s, run)
                                            for op in BUS_FACTOR})


def subgroup_sizes(world: int) -> list[int]:
    """The sharding group sizes 2D can run on `world` ranks with replicas to average: proper divisors >= 2."""
    return [g for g in range(2, world) if world % g == 0]


def measure_subgroup_collectives(device: torch.device, sizes: list[int], backend: Backend, budget_s: float,
                                 world: int, run: CalibrationRun | None = None) -> dict[int, Subgroup]:
    """Per sharding group size of `world` (`subgroup_sizes`), 2D's collectives on the job's own ranks laid
    out as torchrec's DMPCollection lays them out (anyrec.planner.twod.GroupLayout): the all-to-all within
    every sharding group at once and the all-reduce within every replica group at once, each fitted as
    `measure_collectives` fits the world's. A size the time limit leaves no room for says so (the ranks
    decide alike) and keeps the world's figures."""
    run = run or CalibrationRun.unbounded()
    out: dict[int, Subgroup] = {}
    for g in subgroup_sizes(world):
        if run.agreed_left_s(f"collectives on groups of {g}: time left") <= 0:
            out[g] = Subgroup(skipped="time limit: the world's figures price this group size")
            run.fell_back(f"collectives on groups of {g} (time limit)")
            continue
        layout = GroupLayout(world, world, g)  # one host: the calibration's ranks
        # every rank creates every group, in one order (new_group is collective over the world)
        shard_pg, _ = dist.new_subgroups_by_enumeration(layout.sharding_groups())
        replica_pg, _ = dist.new_subgroups_by_enumeration(layout.replica_groups())
        r = layout.replicas
        try:
            a2a = measure_fit("all_to_all", sizes, g, device, backend, budget_s, run, shard_pg,
                              f"groups of {g}: ")
            all_reduce = measure_fit("all_reduce", sizes, r, device, backend, budget_s, run, replica_pg,
                                     f"replicas of {g}: ")
            out[g] = Subgroup(world_size=world, replicas=r, all_to_all=a2a, all_reduce_replicas=all_reduce)
        finally:
            for pg in (shard_pg, replica_pg):
                dist.destroy_process_group(pg)
    return out


def link_fields(c: Collectives) -> dict[str, Any]:
    """DeviceSpec scale-up link fields (one launch's ranks share a host): the all-to-all bus bandwidth, as
    achieved (efficiency 1), and the median per-collective latency (an all-reduce counts as two)."""
    out: dict[str, Any] = {}
    if c.all_to_all is not None and c.all_to_all.bus_bw_bytes_per_s is not None:
        out["scale_up_bw_bytes_per_s"] = c.all_to_all.bus_bw_bytes_per_s
        out["comms_efficiency"] = 1.0
    links = {op: getattr(c, op) for op in BUS_FACTOR}
    alphas = sorted(link.latency_s / (2 if op == "all_reduce" else 1)
                    for op, link in links.items() if link is not None and link.latency_s is not None)
    if alphas:
        out["scale_up_latency_s"] = alphas[len(alphas) // 2]
    return out
