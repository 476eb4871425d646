"""Library entry for offline planning: plan, print the report (and a comparison), write JSON and PNG.

The Hydra entry point (`anyrec/plan.py`) calls `run_plan` and turns InfeasiblePlanError into one
stderr line and exit code 2.
"""

from __future__ import annotations

import json
import os
import tempfile

from anyrec.backends.specs import DeviceSpec
from anyrec.planner.planner import CoDesignPlanner, InfeasiblePlanError, PlanResult
from anyrec.planner.report import format_compare
from anyrec.planner.types import TableSpec, Topology


def write_json_atomic(path: str, data: dict) -> None:
    """Write JSON through a temp file in the same folder and rename it: never a half-written file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".plan-", suffix=".json", dir=folder)
    try:
        # mkstemp creates the file 0600; give it the mode open() would (0666 less the umask).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def run_plan(
    model_tables: list[TableSpec],
    device: DeviceSpec,
    world_size: int,
    local_world_size: int | None,
    batch_size_per_rank: int,
    optimizer: str,
    dense_param_count: int = 0,
    output: str | None = None,
    plot: str | None = None,
    compare: DeviceSpec | None = None,
    compute_device: str | None = None,
    planner: CoDesignPlanner | None = None,
    print_fn=print,
    **options: object,
) -> PlanResult:
    """Plan on `world_size` x `device`, print the report, and write `output` (JSON) and `plot` (PNG).

    `options` are PlanOptions fields (allowed_shardings, allowed_placements, kernel, uvm_cache_ratio,
    reserve_fraction, reserve_bytes, pipeline_depth, ...). With `compare`, the same job is also planned
    on `world_size` x `compare` and shown side by side; an infeasible comparison is reported, not raised.
    Raises InfeasiblePlanError (a ValueError) with a one-line message when nothing fits on `device`.
    """
    planner = planner or CoDesignPlanner()
    topo = Topology(device, world_size, local_world_size, compute_device)
    result = planner.plan(model_tables, topo, batch_size_per_rank, optimizer, dense_param_count, **options)
    print_fn(result.report())
    other: PlanResult | None = None
    if compare is not None:
        try:
            other = planner.plan(
                model_tables,
                topo.replace(device=compare),
                batch_size_per_rank,
                optimizer,
                dense_param_count,
                **options,
            )
        except InfeasiblePlanError as e:
            print_fn(f"\ncompare: {e}")
        if other is not None:
            print_fn(f"\ncompare: {device.name} vs {compare.name}, {world_size} device(s) each")
            print_fn(format_compare(result, other))
    if output:
        data = result.to_json_dict()
        if other is not None:
            data["compare"] = other.to_json_dict()
        write_json_atomic(output, data)
    if plot:
        result.plot(plot, compare=other)
    return result
