"""2D's collectives measured on sub-groups of the job's ranks: the calibration file's
`collectives_subgroups`, and the planner pricing a group size with them (or the world's figures; the
layouts' rank sets against torchrec's are tested in tests/test_twod.py)."""

from __future__ import annotations

import time

import pytest
import torch
import yaml

from anyrec.backends import get_backend, load_hardware_file
from anyrec.backends.hardware import Hardware, LinkFit, SubgroupLinks, hardware_from_data
from anyrec.backends.hardware_file import Subgroup
from anyrec.backends.specs import get_sku
from anyrec.calibration.measure import collectives, phases
from anyrec.calibration.run import CalibrationRun
from anyrec.planner import CoDesignPlanner, ShardingType, Topology
from anyrec.planner.report import format_group_choice
from anyrec.planner.twod import choose_group_size
from anyrec.planner.types import PlanResult, TableSpec

from .conftest import torchrun

SKU = get_sku("h100")
A2A = LinkFit(latency_s=2e-3, bus_bw_bytes_per_s=1e8)  # far from the SKU's: the test sees which priced
REPLICAS = LinkFit(latency_s=4e-3, bus_bw_bytes_per_s=5e7)
MEASURED = {2: SubgroupLinks(2, 2, A2A, REPLICAS)}
WORLD = "from the datasheet's figures (test)"


@pytest.mark.parametrize("world, sizes", [(1, []), (2, []), (3, []), (4, [2]), (6, [2, 3]), (8, [2, 4])])
def test_calibration_measures_every_group_size_with_replicas(world, sizes):
    assert collectives.subgroup_sizes(world) == sizes


def _group_plan(topology: Topology) -> PlanResult:
    """Four tables of 64 MB planned table-wise: each of a group of 2's ranks holds two (weights + state)."""
    tables = [TableSpec(f"t{i}", 500_000, 32, 4.0, [f"f{i}"]) for i in range(4)]
    return CoDesignPlanner().plan(tables, topology, 1024, "adagrad", 100_000,
                                  allowed_shardings=(ShardingType.TABLE_WISE,), allowed_placements=("hbm",))


def _choose(world: int, local: int, measured: dict | None):
    choice = choose_group_size(world, local, SKU, None, _group_plan, sync_every=1, measured=measured,
                               world_source=WORLD)
    return {c.group_size: c for c in choice.candidates if not c.use_inter_host_allreduce}, choice


def test_a_group_size_measured_is_priced_with_its_fits():
    by_size, choice = _choose(4, 4, MEASURED)
    two = by_size[2]
    # the group's all-to-alls: on the fit measured on groups of 2
    link = two.plan.topology.device
    assert (link.scale_up_bw_bytes_per_s, link.scale_up_latency_s, link.comms_efficiency) == (1e8, 2e-3, 1.0)
    # the replicas' averaging: per rank, weights and adagrad state (128 MB each) all-reduced over 2
    # replicas, each latency + 2 n (R - 1) / R / bus bandwidth as fitted
    one = REPLICAS.latency_s + 2 * 128e6 * (2 - 1) / 2 / REPLICAS.bus_bw_bytes_per_s
    assert two.sync_s == pytest.approx(2 * one)
    assert two.figures == "all-to-all measured on groups of 2; replica all-reduce measured over 2 replicas"
    text = format_group_choice(choice)
    assert "     2: all-to-all measured on groups of 2; replica all-reduce measured over 2 replicas" in text
    assert f"     4: all-to-all {WORLD}" in text  # 1D: the world's figures
    # the contiguous layout's groups of 2 ({0, 1}, {2, 3}) are not the strided ones measured ({0, 2},
    # {1, 3}): the spec's figures, and the report says why
    (other,) = [c for c in choice.candidates if c.use_inter_host_allreduce]
    assert other.group_size == 2 and other.plan.topology.device == SKU
    note = f"{WORLD} (sub-groups measured in the strided layout only)"
    assert other.figures == f"all-to-all and replica all-reduce {note}"
    assert f"2 contiguous: all-to-all and replica all-reduce {note}" in text
    # the slow measured links cost more than the datasheet's
    unmeasured, _ = _choose(4, 4, None)
    assert two.step_s > unmeasured[2].step_s + 2 * one * 0.99
    assert unmeasured[2].figures == f"all-to-all and replica all-reduce {WORLD}"
    assert unmeasured[2].plan.topology.device == SKU


def test_sizes_not_measured_as_they_would_run_keep_the_worlds_figures():
    by_size, _ = _choose(4, 4, MEASURED)
    unmeasured, _ = _choose(4, 4, None)
    for g in (1, 4):  # not measured (1D, and groups of 1): priced exactly as without a calibration
        assert by_size[g].step_s == unmeasured[g].step_s and by_size[g].figures == unmeasured[g].figures
    # 8 ranks on one host in groups of 2: 4 replicas, not the 2 measured -> the averaging keeps the
    # world's figures, the all-to-all within a group of 2 on one host takes its fit
    eight, _ = _choose(8, 8, MEASURED)
    assert eight[2].figures == f"all-to-all measured on groups of 2; replica all-reduce {WORLD}"
    assert eight[2].plan.topology.device.scale_up_bw_bytes_per_s == A2A.bus_bw_bytes_per_s
    # 2 hosts of 2 ranks in groups of 2: each group strides over both hosts -> not as measured
    hosts, _ = _choose(4, 2, MEASURED)
    assert hosts[2].figures == f"all-to-all {WORLD}; replica all-reduce measured over 2 replicas"
    assert hosts[2].plan.topology.device == SKU
    # replicas over two hosts (8 ranks, 2 per host, groups of 2: 4 replicas): a fit over 4 replicas of one
    # host does not describe them
    spread, _ = _choose(8, 2, {2: SubgroupLinks(2, 4, A2A, REPLICAS)})
    assert spread[2].figures == f"all-to-all and replica all-reduce {WORLD}"


def test_the_trainer_and_anyrec_plan_pass_the_measured_figures():
    """Hardware carries the fits from the file (as values): what plan.py and the trainer hand down."""
    hardware = hardware_from_data(_file(), "test file", "test file")
    assert hardware.subgroups == {2: SubgroupLinks(2, 2, LinkFit(1e-4, 2e9), LinkFit(3e-4, 1e9))}
    assert Hardware(SKU).subgroups == {}


def _fit(latency: float, bw: float) -> dict:
    return {"sizes_bytes": [1024, 65536], "seconds": [latency, latency + 65536 / bw], "latency_s": latency,
            "bus_bw_bytes_per_s": bw}


def _file(subgroups: dict | None = None) -> dict:
    m = {"measured_fields": ["memory_bw_bytes_per_s"], "copy_bw_bytes_per_s": 1e11}
    m["collectives_subgroups"] = subgroups if subgroups is not None else {
        2: {"world_size": 4, "replicas": 2, "all_to_all": _fit(1e-4, 2e9),
            "all_reduce_replicas": _fit(3e-4, 1e9)}}
    return {"sku": "h100", "spec": {"memory_bw_bytes_per_s": 1e11}, "measurements": m}


def test_the_file_round_trips_the_subgroup_key(tmp_path):
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(_file()))
    hardware = load_hardware_file(path)
    assert hardware.subgroups[2].all_to_all == LinkFit(1e-4, 2e9)
    assert hardware.subgroups[2].all_reduce_replicas == LinkFit(3e-4, 1e9)
    # the fits price the group of 2 (the file's figures, as values)
    by_size = {c.group_size: c for c in choose_group_size(
        4, 4, hardware.spec, None, _group_plan, measured=hardware.subgroups,
        world_source=hardware.link_source).candidates if not c.use_inter_host_allreduce}
    assert by_size[2].plan.topology.device.scale_up_bw_bytes_per_s == 2e9
    assert "from the datasheet's figures" in by_size[4].figures  # the file measured no world collectives


def test_a_file_without_the_key_still_loads(tmp_path):
    data = _file()
    del data["measurements"]["collectives_subgroups"]
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_hardware_file(path).subgroups == {}


def test_a_size_skipped_for_time_loads_without_figures(tmp_path):
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(_file({2: {"skipped": "time limit"}})))
    assert load_hardware_file(path).subgroups == {}


@pytest.mark.parametrize("subgroups, error", [
    ({1: {"world_size": 1, "replicas": 1}}, "group size 1 is not an integer >= 2"),
    ({2: {"world_size": 6, "replicas": 2, "all_to_all": _fit(0, 1e9), "all_reduce_replicas": _fit(0, 1e9)}},
     "needs replicas >= 2 and world_size = 2 x replicas"),
    ({2: {"world_size": 4, "replicas": 2, "all_to_all": {"latency_s": 1e-4, "bus_bw_bytes_per_s": 0},
          "all_reduce_replicas": _fit(0, 1e9)}},
     "all_to_all.bus_bw_bytes_per_s = 0 is implausible: expected 1e"),
    ({2: {"world_size": 4, "replicas": 2, "all_to_all": _fit(1e-4, 1e9)}},
     "all_reduce_replicas has neither a fit nor a reason it was skipped"),
    ({2: {}}, "has neither its replicas nor a reason it was skipped"),
    ([2], "must be a mapping of group size to measurements"),
])
def test_a_broken_subgroup_entry_is_one_line_naming_it(subgroups, error, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_file(subgroups)))
    with pytest.raises(ValueError, match=f"{path}: measurements.collectives_subgroups.*{error}"):
        load_hardware_file(path)


def test_no_time_left_skips_the_subgroups_with_the_reason():
    """The phase's time spent: each size records why it was not measured (the ranks agree on it: without
    a process group, this rank's clock) and the run counts the fallback."""
    now = time.monotonic()
    run = CalibrationRun(limit_s=1.0, deadline=now - 1, until=now - 1)
    out = collectives.measure_subgroup_collectives(torch.device("cpu"), [1024], get_backend("cpu"), 0.01, 8,
                                                   run)
    skipped = Subgroup(skipped="time limit: the world's figures price this group size")
    assert out == {g: skipped for g in (2, 4)}
    assert run.fallbacks == [f"collectives on groups of {g} (time limit)" for g in (2, 4)]


@pytest.mark.integration
@pytest.mark.cpu_only  # four ranks on one host: one device each only without an accelerator
def test_calibrate_on_four_ranks_measures_groups_of_two(tmp_path):
    out = tmp_path / "cal4.yaml"
    proc = torchrun(["-m", "anyrec.calibrate", f"calibrate.output={out}", "calibrate.size=quick",
                     "calibrate.budget_s=0.01", "calibrate.time_limit_s=120"], nproc=4, timeout=240,
                    cwd=tmp_path, env={"ANYREC_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = yaml.safe_load(out.read_text())["measurements"]
    (entry,) = m["collectives_subgroups"].values()
    assert list(m["collectives_subgroups"]) == [2] and entry["world_size"] == 4 and entry["replicas"] == 2
    for op in ("all_to_all", "all_reduce_replicas"):
        assert entry[op]["bus_bw_bytes_per_s"] > 1e6 and entry[op]["latency_s"] >= 0
        assert len(entry[op]["seconds"]) == len(phases.SIZES["quick"]["comm_bytes"])
    assert load_hardware_file(out).subgroups[2].all_to_all.bus_bw_bytes_per_s == \
        entry["all_to_all"]["bus_bw_bytes_per_s"]
