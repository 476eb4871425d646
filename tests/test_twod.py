"""2D sparse parallelism: torchrec's DMPCollection on the CPU (gloo), its glue pinned to torchrec's source,
the replicas' averaging schedule, parity with 1D, and checkpoints converted between layouts."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec.distributed import model_parallel
from torchrec.distributed.model_parallel import DMPCollection

from anyrec import parity
from anyrec._hydra import cli_problem, compose_job
from anyrec.backends.specs import get_sku
from anyrec.planner import CoDesignPlanner, InfeasiblePlanError, ShardingType, Topology
from anyrec.planner.estimators import all_reduce_time_s, dense_all_reduce_time_s
from anyrec.planner.planned import ParallelLayout, group_size_in_ranks
from anyrec.planner.report import format_group_choice
from anyrec.planner.twod import (
    GroupLayout,
    choose_group_size,
    dense_extra_time_s,
    price_group,
    replica_bytes,
    replica_sync_time_s,
)
from anyrec.planner.types import PlanResult, ReplicaUpdate, TableSpec
from anyrec.trainer.pipeline import ReplicaSync

from .conftest import ROOT, torchrun


@pytest.mark.parametrize("text, world, expected", [
    ("world", 4, 4), ("auto", 4, None), ("2", 4, 2), ("1", 4, 1), ("4", 4, 4), ("8", 16, 8)])
def test_group_size_values(text, world, expected):
    # parsed once where the config is built, resolved against the world where the job is planned
    size = compose_job([f"planner.sharding_group_size={text}"]).planner.sharding_group_size
    assert group_size_in_ranks(size, world) == expected


@pytest.mark.parametrize("text", ["3", "8"])
def test_a_group_size_that_does_not_divide_the_world_is_refused(text):
    size = compose_job([f"planner.sharding_group_size={text}"]).planner.sharding_group_size
    with pytest.raises(ValueError, match=f"^planner.sharding_group_size={text}: expected world, auto or a "
                                         f"divisor of the world size 4$"):
        group_size_in_ranks(size, 4)


@pytest.mark.parametrize("text", ["0", "-2", "half", "true"])
def test_a_group_size_that_is_no_number_of_ranks_is_refused_at_the_door(text):
    problem = cli_problem([f"planner.sharding_group_size={text}"])
    assert problem is not None and problem.startswith("planner.sharding_group_size=")
    assert problem.endswith(": expected world, auto or a number of ranks >= 1")


def test_the_layout_value_says_what_2d_does():
    one_d = ParallelLayout.one_d(4, 4)
    assert (one_d.is_2d, one_d.replicas, one_d.sync_every) == (False, 1, 1)
    averaged = ParallelLayout(4, 2, 2, replica_update=ReplicaUpdate.AVERAGE, replica_sync_every=3)
    assert (averaged.is_2d, averaged.replicas, averaged.sync_every, averaged.name) == (True, 2, 3, "strided")
    assert [averaged.group_rank(r) for r in range(4)] == [0, 0, 1, 1]
    exchanged = ParallelLayout(4, 2, 2, True, ReplicaUpdate.GRADIENTS, 1)
    assert exchanged.sync_every == 1 and exchanged.name == "contiguous"
    assert [exchanged.group_rank(r) for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="sharding group size 3 does not divide the world size 4"):
        ParallelLayout(4, 4, 3)


@pytest.mark.parametrize("world, local, group, expected", [
    (4, 4, 2, 2),  # one host: two groups of 2, each on it
    (16, 8, 8, 4),  # two hosts of 8: a group of 8 strides over both (ranks 0, 2, .., 14)
    (1024, 8, 128, 1),  # 8 replicas: one host holds one rank of each group, the replicas side by side
    (1024, 8, 64, 1),  # 16 replicas: a group's ranks are two hosts apart
    (1024, 8, 1024, 8),  # 1D
])
def test_a_groups_ranks_per_host_follow_torchrecs_strided_layout(world, local, group, expected):
    assert GroupLayout(world, local, group).group_local_size == expected


def _torchrec_mesh(world: int, group: int, inter_host: bool, monkeypatch) -> list[list[int]]:
    """The device mesh's rows (the sharding groups) DMPCollection._create_process_groups builds: its own
    code, run with DeviceMesh captured."""
    meshes = []

    class Mesh:
        def __init__(self, device_type, mesh, mesh_dim_names):
            meshes.append(mesh)

        def get_group(self, mesh_dim):
            return mesh_dim

        def __getitem__(self, dim):
            return dim

    monkeypatch.setattr(model_parallel, "DeviceMesh", Mesh)
    holder = type("Holder", (), {"_device": torch.device("cpu")})()
    DMPCollection._create_process_groups(holder, 0, world, group, use_inter_host_allreduce=inter_host)
    (rows,) = meshes
    return rows


def _fewest_on_a_host(groups: list[list[int]], local: int) -> int:
    """The fewest ranks of one group that a host holding any of them holds."""
    return min(sum(r // local == h for r in ranks) for ranks in groups for h in {r // local for r in ranks})


@pytest.mark.parametrize("inter_host", [False, True])
@pytest.mark.parametrize("world, group, local", [(4, 2, 2), (8, 2, 4), (8, 4, 2), (16, 4, 8), (16, 8, 4),
                                                 (6, 2, 3), (6, 3, 6), (8, 8, 4), (8, 1, 4)])
def test_both_layouts_rank_sets_are_torchrecs(world, group, local, inter_host, monkeypatch):
    """GroupLayout's sharding and replica groups are the rows and columns of torchrec's mesh for either
    use_inter_host_allreduce, and its per-host counts (what the group and replicas are priced on) are
    those groups' own."""
    rows = _torchrec_mesh(world, group, inter_host, monkeypatch)
    layout = GroupLayout(world, local, group, inter_host)
    assert layout.sharding_groups() == rows
    assert layout.replica_groups() == [list(col) for col in zip(*rows, strict=True)]
    assert layout.group_local_size == _fewest_on_a_host(rows, local)
    assert layout.replica_local_size == _fewest_on_a_host(layout.replica_groups(), local)
    assert [layout.group_rank(r) for r in range(world)] == [
        next(row.index(r) for row in rows if r in row) for r in range(world)]
    # contiguous groups are the strided ones only for one group or groups of one rank
    assert layout.as_measured() == (not inter_host or group in (1, world))


def test_contiguous_groups_win_when_the_all_to_all_outweighs_the_replicas_traffic():
    """Two hosts of 2 ranks, groups of 2. Averaged every 1000 steps the replicas cost little and the
    group's all-to-all dominates: the contiguous layout keeps each group on one host's fast links and
    wins. Averaged every step, the 256 MB per rank the replicas all-reduce dominate: the strided layout
    keeps each rank's replica on its host, and its groups spanning the hosts win."""
    sku = get_sku("h100")
    rare = choose_group_size(4, 2, sku, None, _group_plan, sizes=[2], sync_every=1000)
    strided, contiguous = rare.candidates
    assert (strided.layout, contiguous.layout) == ("strided", "contiguous")
    assert contiguous.plan.topology.num_hosts == 1 and strided.plan.topology.num_hosts == 2
    assert contiguous.step_s < strided.step_s
    assert (rare.chosen, rare.use_inter_host_allreduce) == (2, True)
    assert "contiguous layout, use_inter_host_allreduce=True" in format_group_choice(rare).splitlines()[-1]

    every = choose_group_size(4, 2, sku, None, _group_plan, sizes=[2], sync_every=1)
    strided, contiguous = every.candidates
    # the same bytes averaged over the scale-out link (contiguous) and the scale-up one (strided)
    assert contiguous.sync_s > 3 * strided.sync_s
    assert (every.chosen, every.use_inter_host_allreduce) == (2, False)
    assert "strided layout, use_inter_host_allreduce=False" in format_group_choice(every).splitlines()[-1]


class _CountingDMP(DMPCollection):
    """A DMPCollection that only counts sync() calls (the schedule is what is tested)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.calls = 0

    def sync(self, include_optimizer_state: bool = True) -> None:
        self.calls += 1


@pytest.mark.parametrize("every, steps, during, at_end", [(1, 5, 5, 0), (3, 5, 2, 1), (3, 6, 2, 1)])
def test_the_eager_loop_averages_on_torchrecs_schedule_and_at_the_end_of_a_chunk(every, steps, during,
                                                                                  at_end):
    """torchrec's pipeline syncs after the backward of batch i when i % every == 0; the eager loop does the
    same, and a chunk that ends with k > 1 leaves no replica behind."""
    model = _CountingDMP()
    replicas = ReplicaSync(model, every)
    for _ in range(steps):
        replicas.after_backward()
    assert model.calls == during
    replicas.drained(training=False)  # the end of an evaluation: nothing trained, nothing to average
    assert model.calls == during
    replicas.drained(training=True)
    assert model.calls == during + at_end


def test_a_1d_model_is_never_synced():
    replicas = ReplicaSync(nn.Linear(1, 1))
    replicas.after_backward()
    replicas.drained(training=True)  # nothing to call: no error


# ---- real runs: 4 ranks on the CPU, two groups of two -------------------------------------------
# Every single-host 2D job of this file runs in one 4-rank torchrun launch (tests/dist/jobs_check.py:
# anyrec-train's loop, one job after the other, one interpreter start and one rendezvous); the tests
# read its records. The two-host test launches `anyrec.train` itself.

JOB = ["model=dlrm_tiny", "data.batch_size=64", "trainer.eval_steps=2", "trainer.progress=false",
       "trainer.tensorboard=false", "trainer.fingerprint_weights=true", "trainer.calibrate=never",
       "hardware.sku=cpu"]
TWO_GROUPS = ["planner.sharding_group_size=2", "trainer.steps=4"]  # the job several tests compare with
SHARDINGS = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]
# anyrec-parity's variants (its record: per-step losses and whole weights, no evaluation or checkpoint)
PARITY = ["trainer.eval_steps=0", "trainer.checkpoint.dir=null", "trainer.progress=false",
          "trainer.tensorboard=false", "model=dlrm_tiny", "data.batch_size=64", "trainer.steps=3",
          "hardware.sku=cpu"]
SGD = [*PARITY, "optim=sgd", "optim.embedding_lr=0.5", "planner.sharding=table_wise"]
SIMDEV = [*PARITY, "backend.embedding_kernel=torch", "planner.sharding_group_size=2"]


def _jobs(tmp: Path) -> dict[str, list[str]]:
    """The launch's jobs by label, in the order they run (a checkpoint is written before it is read)."""
    ck2d, ck1d = (f"trainer.checkpoint.dir={tmp / d}" for d in ("ck2d", "ck1d"))
    return {
        "two_groups": [*JOB, *TWO_GROUPS],
        "eager_every_1": [*JOB, *TWO_GROUPS, "trainer.pipeline=false"],
        "pipelined_every_3": [*JOB, *TWO_GROUPS, "planner.replica_sync_every=3"],
        "eager_every_3": [*JOB, *TWO_GROUPS, "planner.replica_sync_every=3", "trainer.pipeline=false"],
        "sgd_group_4": [*SGD, "planner.sharding_group_size=4"],
        "sgd_group_2": [*SGD, "planner.sharding_group_size=2"],
        **{f"sharding_{s}": [*JOB, "planner=simple", f"planner.sharding={s}", "planner.sharding_group_size=2",
                             "trainer.steps=2"] for s in SHARDINGS},
        # checkpoints between layouts: a 2D one resumed in another group size and in 1D, a 1D one in 2D
        "saved_2d": [*JOB, "planner.sharding_group_size=2", "trainer.steps=2", ck2d],
        "2d_resumed_in_4": [*JOB, "planner.sharding_group_size=4", "trainer.steps=2", ck2d],
        "2d_resumed_in_1": [*JOB, "planner.sharding_group_size=1", "trainer.steps=2", ck2d],
        "saved_1d": [*JOB, "planner.sharding_group_size=world", "trainer.steps=2", ck1d],
        "1d_resumed_in_2d": [*JOB, "planner.sharding_group_size=2", "trainer.steps=2", ck1d],
        "2d_continued": [*JOB, *TWO_GROUPS, ck2d],  # 2 + 2 steps, against the 4 of two_groups
        "on_cpu": [*SIMDEV, "backend=cpu"],
        "on_simdev": [*SIMDEV, "backend=simdev"],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, simdev_site) -> dict[str, dict]:
    """Every job of `_jobs`, run once in one 4-rank launch with the simdev plugin importable; the records
    by label."""
    tmp = tmp_path_factory.mktemp("twod")
    (tmp / "jobs.json").write_text(json.dumps(_jobs(tmp)))
    script = ROOT / "tests" / "dist" / "jobs_check.py"
    proc = torchrun([str(script), str(tmp / "jobs.json"), str(tmp / "out.json"), str(tmp / "runs")], nproc=4,
                    timeout=900, env={"PYTHONPATH": str(simdev_site)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())


def _agree(a: dict, b: dict, loss_rtol: float = 1e-5, weight_atol: float = 1e-5) -> None:
    """anyrec-parity's check of record `b` against `a`: per-step losses and every weight within tolerance."""
    diff = parity.compare(a, b)
    assert len(a["losses"]) == 3 and diff["loss_rel"] <= loss_rtol and diff["weight_abs"] <= weight_atol, diff


@pytest.mark.integration
def test_the_jobs_ran_where_they_were_asked_to(runs):
    """The plugin on the path moves no job off the CPU; only backend=simdev runs there."""
    assert all(r["summary"]["backend"] != "simdev" for k, r in runs.items() if k != "on_simdev")
    assert runs["on_simdev"]["summary"]["backend"] == "simdev"
    assert runs["on_cpu"]["summary"]["backend"] == "cpu"
    assert all(r["summary"]["world_size"] == 4 for r in runs.values())


@pytest.mark.integration
@pytest.mark.parametrize("every", [1, 3])
def test_two_groups_of_two_train_pipelined_and_eager_alike_with_evaluation(runs, every):
    """torchrec's pipeline and the eager loop average the replicas on one schedule (every step, or every
    third and at the end): the same weights bit for bit."""
    pipelined = runs["two_groups" if every == 1 else "pipelined_every_3"]["summary"]
    eager = runs[f"eager_every_{every}"]["summary"]
    if every == 1:  # the default: the shared TWO_GROUPS job is composed alike
        default = compose_job([*JOB, *TWO_GROUPS])
        assert compose_job([*JOB, *TWO_GROUPS, "planner.replica_sync_every=1"]) == default
    assert pipelined["sharding_group_size"] == 2 and pipelined["world_size"] == 4
    assert pipelined["eval_auc"] is not None and pipelined["steps"] == 4
    assert pipelined["final_loss"] == eager["final_loss"]
    assert pipelined["weights_sha256"] == eager["weights_sha256"]
    if every == 3:  # averaging less often is another run, not the same one
        assert pipelined["weights_sha256"] != runs["two_groups"]["summary"]["weights_sha256"]


@pytest.mark.integration
def test_sgd_in_two_groups_trains_as_1d(runs):
    """torchrec divides the embeddings' gradients by the sharding group's size, so a group's SGD update
    is its ranks' mean gradient, and the replicas' average is the world's mean: 1D's update. Two groups
    of two train as one group of four, per step and per weight, to rounding; without the averaging each
    group would follow its own half of the data."""
    one, two = runs["sgd_group_4"], runs["sgd_group_2"]
    assert one["summary"]["sharding_group_size"] == 4 and two["summary"]["sharding_group_size"] == 2
    _agree(one, two)


@pytest.mark.integration
def test_checkpoints_convert_between_1d_2d_and_group_sizes(runs):
    """A 2D checkpoint resumes in 1D and in another group size with the same weights, a 1D one in 2D,
    and a 2D run resumed in 2D continues as the uninterrupted run."""
    saved = runs["saved_2d"]["summary"]
    for group in ("4", "1"):
        resumed = runs[f"2d_resumed_in_{group}"]["summary"]
        assert resumed["sharding_group_size"] == int(group)
        assert resumed["resumed_from_step"] == 2 and resumed["weights_sha256"] == saved["weights_sha256"]
    saved_1d, into_2d = runs["saved_1d"]["summary"], runs["1d_resumed_in_2d"]["summary"]
    assert saved_1d["sharding_group_size"] == 4 and into_2d["resumed_from_step"] == 2
    assert into_2d["sharding_group_size"] == 2 and into_2d["weights_sha256"] == saved_1d["weights_sha256"]
    # optimizer state and data position: 2D 2 + 2 steps train as the 4 uninterrupted 2D steps of TWO_GROUPS
    continued, whole = runs["2d_continued"]["summary"], runs["two_groups"]["summary"]
    assert continued["resumed_from_step"] == 2 and continued["steps"] == whole["steps"] == 4
    assert continued["final_loss"] == pytest.approx(whole["final_loss"], abs=1e-6)


# ---- the cost model: pricing a group and choosing its size -----------------------------------------

def _group_plan(topology: Topology) -> PlanResult:
    """A small model (four tables, 64 MB each in fp32) planned table-wise on `topology`."""
    tables = [TableSpec(f"t{i}", 500_000, 32, 4.0, [f"f{i}"]) for i in range(4)]
    return CoDesignPlanner().plan(tables, topology, 1024, "adagrad", 100_000,
                                  allowed_shardings=(ShardingType.TABLE_WISE,), allowed_placements=("hbm",))


def test_replica_averaging_is_priced_as_all_reduces_of_each_ranks_shards_over_its_replicas():
    layout = GroupLayout(16, 8, 4)  # 4 replicas: ranks 4q..4q+3 of one host average one another
    plan = _group_plan(layout.group_topology(get_sku("h100")))
    rank_bytes = replica_bytes(plan)
    # adagrad's table-wise shards: weights and a same-sized state, one table per rank of the group
    assert rank_bytes == [(64_000_000, 64_000_000)] * 4
    topo = Topology(get_sku("h100"), 4, 4)
    expected = 2 * all_reduce_time_s(64_000_000, topo)
    assert replica_sync_time_s(plan, layout) == pytest.approx(expected)
    assert replica_sync_time_s(plan, layout, sync_every=10) == pytest.approx(expected / 10)
    assert replica_sync_time_s(plan, GroupLayout(4, 4, 4)) == 0.0  # 1D: nothing to average
    priced = price_group(plan, layout)
    assert priced.replicas == 4
    assert priced.predicted_step_s == pytest.approx(plan.predicted_step_s + expected
                                                    + dense_extra_time_s(plan, layout))


def test_replicas_beyond_a_host_average_over_the_scale_out_link():
    """16 replicas on hosts of 8 span two hosts: the same bytes take longer than 8 on one host."""
    one_host, two_hosts = GroupLayout(64, 8, 8), GroupLayout(128, 8, 8)
    plan = _group_plan(one_host.group_topology(get_sku("h100")))
    assert replica_sync_time_s(plan, two_hosts) > 1.5 * replica_sync_time_s(plan, one_host)


def test_the_chooser_takes_the_fastest_size_that_fits_and_reports_every_size_weighed():
    sku = get_sku("h100")

    def plan_for(topology: Topology) -> PlanResult:  # 250 MB usable per rank: a table (128 MB) at most
        cap = sku.runtime_reserved_bytes + 250 * 10**6
        return _group_plan(dataclasses.replace(topology, hbm_cap_bytes=cap))

    choice = choose_group_size(8, 8, sku, None, plan_for, sync_every=1000)
    # sizes 2 and 4 in both of torchrec's layouts; 1 and 8 have one (every rank its own group, or one group)
    assert [c.label for c in choice.candidates] == ["1", "2", "2 contiguous", "4", "4 contiguous", "8"]
    by_size = {c.group_size: c for c in choice.candidates if not c.use_inter_host_allreduce}
    assert by_size[1].plan is None and by_size[2].plan is None  # 4 tables on 1 or 2 ranks do not fit
    assert "does not fit" not in by_size[4].infeasible and by_size[4].plan is not None
    fitting = [c for c in choice.candidates if c.plan is not None]
    assert choice.best is min(fitting, key=lambda c: c.step_s)
    assert (choice.chosen, choice.use_inter_host_allreduce) == (choice.best.group_size,
                                                                choice.best.use_inter_host_allreduce)
    text = format_group_choice(choice)
    assert text.count("does not fit") == 3 and text.count("<- chosen") == 1
    assert f"sharding group size {choice.chosen} " in text.splitlines()[-1]
    assert f"{choice.best.layout} layout" in text.splitlines()[-1]


def test_frequent_averaging_of_big_replicas_keeps_the_whole_world_as_one_group():
    """Averaging every step costs more than the all-to-all it saves for this model; every 1000 steps,
    smaller groups win (the curve anyrec-plan prints)."""
    every_step = choose_group_size(64, 8, get_sku("h100"), None, _group_plan, sync_every=1)
    assert every_step.chosen == 64
    rare = choose_group_size(64, 8, get_sku("h100"), None, _group_plan, sync_every=1000)
    assert rare.chosen < 64


def test_nothing_fitting_is_one_error_naming_every_size():
    def plan_for(topology: Topology) -> PlanResult:
        raise InfeasiblePlanError(f"{topology.world_size} ranks: too small")

    with pytest.raises(InfeasiblePlanError, match="no sharding group size fits: 1: 1 ranks: too small; "
                                                  "2: 2 ranks: too small"):
        choose_group_size(2, 2, get_sku("h100"), None, plan_for)


@pytest.mark.integration
def test_two_hosts_of_two_ranks_train_in_two_groups_with_host_local_replicas(tmp_path, runs):
    """Two torchrun agents on loopback (2 ranks each), two sharding groups of 2, laid out as the planner
    chose: strided groups spanning both hosts (ranks 0, 2 and 1, 3; each rank's replica its neighbour on
    its own host) or contiguous ones on one host each (0, 1 and 2, 3; the replicas across the hosts).
    torchrec builds the chosen layout, the group's plan is for its hosts, and the job trains as the same
    2D job on one host of four ranks."""
    from .test_multihost import launch_hosts

    job = ["-m", "anyrec.train", *JOB, *TWO_GROUPS, f"hydra.run.dir={tmp_path}/h"]
    run = launch_hosts(job, tmp_path)
    assert run.returncodes == [0, 0], run.out[-4000:]
    assert run.strays == []
    two = run.summary()
    assert two["hosts"] == 2 and two["world_size"] == 4 and two["sharding_group_size"] == 2
    log = (tmp_path / "h" / "train_rank0.log").read_text()
    chosen = re.search(r"2D: sharding group size 2 \(2 replica\(s\), (strided|contiguous) layout, "
                       r"use_inter_host_allreduce=(True|False)\)", log)
    assert chosen is not None, log[-4000:]
    layout, flag = chosen.groups()
    assert (layout == "contiguous") == (flag == "True")
    # the chosen layout is the one torchrec built (its own log line) and anyrec reports
    assert f"[2D] Use inter host all reduce: {flag}" in log
    assert f"2 sharding groups of 2 ranks, {layout} layout (use_inter_host_allreduce={flag})" in log
    # the group's plan: its two ranks on one host (contiguous) or on two hosts, one each (strided)
    assert f"tables on 2 x CPU ({'1 host(s) x 2' if flag == 'True' else '2 host(s) x 1'})" in log
    one_host = runs["two_groups"]["summary"]  # the same job on one host
    assert one_host["hosts"] == 1
    assert two["final_loss"] == pytest.approx(one_host["final_loss"], rel=1e-5)


@pytest.mark.integration
def test_two_groups_train_on_the_simulated_plugin_device_as_on_the_cpu(runs):
    """torchrec's DMPCollection machinery on a plugin device (examples/simdev, its own process-group
    backend): anyrec's torch TBE joins torchrec's averaging, and the job trains as on the CPU, per step
    and per weight within anyrec-parity's tolerance."""
    assert runs["on_simdev"]["summary"]["sharding_group_size"] == 2
    _agree(runs["on_cpu"], runs["on_simdev"])


def test_data_parallel_tables_gradients_are_all_reduced_over_the_world_not_the_group():
    layout = GroupLayout(64, 8, 8)
    topo = layout.group_topology(get_sku("h100"))
    tables = [TableSpec(f"t{i}", 1000, 32, 1.0, [f"f{i}"]) for i in range(4)]
    replicated = CoDesignPlanner().plan(tables, topo, 1024, "sgd", 100_000,
                                        allowed_shardings=(ShardingType.DATA_PARALLEL,))
    n = 100_000 + 4 * 1000 * 32
    world = layout.world_topology(get_sku("h100"))
    assert replica_bytes(replicated) == [(0, 0)] * 8  # DDP's, not the replicas' averaging
    assert dense_extra_time_s(replicated, layout) == pytest.approx(
        dense_all_reduce_time_s(n, world) - dense_all_reduce_time_s(n, topo))


@pytest.mark.integration
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_every_sharding_type_trains_within_a_group(runs, sharding):
    """Each sharding type within groups of two; table-row-wise keeps a table's rows on the group's ranks
    of one host (torchrec's node group, which anyrec sets from the layout: its default, all ranks of a
    host, is refused by torchrec for a group smaller than a host)."""
    s = runs[f"sharding_{sharding}"]["summary"]
    assert s["sharding_group_size"] == 2 and s["steps"] == 2 and 0 < s["final_loss"] < 1
