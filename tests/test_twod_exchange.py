"""2D's replicas kept one model by exchanging gradients (anyrec/trainer/replica_exchange.py): the merged
batch is 1D's, the choice between exchanging and averaging, its price and memory in the planner, and the
default job (Adagrad) in two groups of two training as 1D."""

from __future__ import annotations

import json

import pytest
import torch

from anyrec import parity
from anyrec._hydra import cli_problem
from anyrec.backends.specs import get_sku
from anyrec.config import ReplicaUpdateChoice
from anyrec.planner import CoDesignPlanner, ShardingType, Topology
from anyrec.planner.estimators import ID_BYTES, OUTPUT_BYTES
from anyrec.planner.memory import alloc_bytes, predict_memory
from anyrec.planner.planned import resolve_replica_update
from anyrec.planner.twod import (
    GroupLayout,
    dense_extra_time_s,
    exchange_bytes,
    price_group,
    replica_bytes,
    replica_exchange_time_s,
    replica_sync_time_s,
)
from anyrec.planner.types import PlanResult, ReplicaUpdate, TableSpec
from anyrec.trainer.replica_exchange import merge_lookups

F, DT = 3, 4  # features, output dim


def _rank_batch(gen: torch.Generator, bags: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's lookups: bag lengths [F, bags], ids feature-major, output gradients [bags, DT]."""
    lengths = torch.randint(0, 4, (F, bags), generator=gen)
    ids = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
    return lengths, ids, torch.randn(bags, DT, generator=gen)


def _group_batch(ranks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """The lookup a group's kernel sees: its ranks' batches concatenated in each feature, in rank order
    (torchrec's all-to-all orders by source rank)."""
    lengths = torch.cat([r[0] for r in ranks], dim=1)
    per_feature = [torch.split(r[1], r[0].sum(1).tolist()) for r in ranks]
    ids = torch.cat([per_feature[i][f] for f in range(F) for i in range(len(ranks))])
    return lengths, ids, torch.cat([r[2] for r in ranks])


@pytest.mark.parametrize("inter_host", [False, True])
@pytest.mark.parametrize("world, group", [(4, 2), (4, 1), (8, 2), (8, 4)])
def test_the_merged_replicas_are_1ds_batch_in_world_rank_order(world, group, inter_host):
    """R replicas of groups of G in either of torchrec's layouts (strided: group g holds ranks g, g + R,
    ..., merged interleaving the G ranks' blocks; contiguous: g G .. g G + G - 1, merged replica after
    replica, as TwoDModelParallel passes them). The merged batch is the batch 1D's kernel sees, the
    world's ranks in order, bit for bit, and its gradients the world's mean (the groups' all-to-all
    divided by G, the merge by R)."""
    gen = torch.Generator().manual_seed(world * 10 + group)
    replicas = world // group
    ranks = [_rank_batch(gen, 2) for _ in range(world)]
    layout = GroupLayout(world, world, group, inter_host)
    groups = [_group_batch([ranks[r] for r in members]) for members in layout.sharding_groups()]
    ids, offsets, psw, grads = merge_lookups([g[1] for g in groups], [g[0] for g in groups], None,
                                             [g[2] for g in groups], 1 if inter_host else group)
    lengths_1d, ids_1d, grads_1d = _group_batch(ranks)
    assert torch.equal(ids, ids_1d)
    assert offsets[0] == 0 and torch.equal(offsets[1:], lengths_1d.reshape(-1).cumsum(0))
    assert psw is None
    assert torch.equal(grads, grads_1d / replicas)


def test_unequal_batches_merge_replica_by_replica_in_each_feature():
    """Batches of different sizes cannot be split into their ranks': each feature holds replica 0's bags,
    then replica 1's, with their ids and per-sample weights alongside."""
    gen = torch.Generator().manual_seed(0)
    a, b = _rank_batch(gen, 4), _rank_batch(gen, 2)
    weights = [torch.rand(a[1].numel(), generator=gen), torch.rand(b[1].numel(), generator=gen)]
    ids, offsets, psw, grads = merge_lookups([a[1], b[1]], [a[0], b[0]], weights, [a[2], b[2]], group_size=2)
    lengths = torch.cat([a[0], b[0]], dim=1)
    assert torch.equal(offsets[1:], lengths.reshape(-1).cumsum(0))
    split_a, split_b = (torch.split(t, r[0].sum(1).tolist()) for t, r in ((a[1], a), (b[1], b)))
    assert torch.equal(ids, torch.cat([x for f in range(F) for x in (split_a[f], split_b[f])]))
    wa, wb = (torch.split(w, r[0].sum(1).tolist()) for w, r in zip(weights, (a, b), strict=True))
    assert torch.equal(psw, torch.cat([x for f in range(F) for x in (wa[f], wb[f])]))
    assert torch.equal(grads, torch.cat([a[2], b[2]]) / 2)


def test_a_replica_without_samples_takes_part_with_an_empty_batch():
    gen = torch.Generator().manual_seed(1)
    a = _rank_batch(gen, 2)
    empty = (torch.zeros(F, 0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0, DT))
    ids, offsets, _, grads = merge_lookups([a[1], empty[1]], [a[0], empty[0]], None, [a[2], empty[2]], 2)
    assert torch.equal(ids, a[1]) and torch.equal(offsets[1:], a[0].reshape(-1).cumsum(0))
    assert torch.equal(grads, a[2] / 2)


@pytest.mark.parametrize("text, optimizer, every, expected", [
    ("auto", "adagrad", 1, ReplicaUpdate.GRADIENTS),
    ("auto", "rowwise_adagrad", 1, ReplicaUpdate.GRADIENTS),
    ("auto", "adam", 1, ReplicaUpdate.GRADIENTS),
    ("auto", "sgd", 1, ReplicaUpdate.AVERAGE),  # averaging SGD's replicas is 1D's update
    ("auto", "adagrad", 100, ReplicaUpdate.AVERAGE),  # replicas meant to drift between averagings
    ("average", "adagrad", 1, ReplicaUpdate.AVERAGE),
    ("gradients", "sgd", 1, ReplicaUpdate.GRADIENTS),
])
def test_auto_exchanges_gradients_where_averaging_is_not_1ds_update(text, optimizer, every, expected):
    assert resolve_replica_update(ReplicaUpdateChoice[text], optimizer, every) == expected


def test_gradients_with_a_sync_interval_is_one_line():
    with pytest.raises(ValueError, match="^planner.replica_update=gradients keeps the replicas equal every "
                                         "step; planner.replica_sync_every=4 applies to average only$"):
        resolve_replica_update(ReplicaUpdateChoice.gradients, "adagrad", 4)


def test_an_unknown_replica_update_is_refused_at_the_door():
    assert cli_problem(["planner.replica_update=mean"]) == ("planner.replica_update: Invalid value 'mean', "
                                                            "expected one of [auto, average, gradients]")


# ---- the cost model ----------------------------------------------------------------------------------

def _plan(topology: Topology, rows: int = 500_000) -> PlanResult:
    """Four tables (fp32, dim 32, 4 ids a sample) planned table-wise on `topology`, Adagrad."""
    tables = [TableSpec(f"t{i}", rows, 32, 4.0, [f"f{i}"]) for i in range(4)]
    return CoDesignPlanner().plan(tables, topology, 1024, "adagrad", 100_000,
                                  allowed_shardings=(ShardingType.TABLE_WISE,), allowed_placements=("hbm",))


def test_the_exchange_is_priced_as_an_all_gather_of_the_groups_lookups_and_their_replay():
    layout = GroupLayout(16, 8, 4)  # 4 replicas on one host
    plan = _plan(layout.group_topology(get_sku("h100")))
    # one table a rank: the group's 4 x 1024 samples' ids (4 each), bags and pooled gradients (dim 32)
    samples = 4 * 1024
    assert exchange_bytes(plan) == [ID_BYTES * (samples * 4 + samples) + OUTPUT_BYTES * samples * 32] * 4
    priced = price_group(plan, layout, update=ReplicaUpdate.GRADIENTS)
    assert priced.replica_update == ReplicaUpdate.GRADIENTS
    assert priced.replica_s == pytest.approx(replica_exchange_time_s(plan, layout)
                                             + dense_extra_time_s(plan, layout))
    shard = next(iter(plan.tables.values())).shards[0]
    replay = 4 * shard.perf.fwd_compute_s + 3 * shard.perf.bwd_compute_s
    assert replica_exchange_time_s(plan, layout) > replay > 0
    # the whole tables' averaging every step moves far more than this batch's lookups
    assert replica_exchange_time_s(plan, layout) < replica_sync_time_s(plan, layout)
    assert replica_exchange_time_s(plan, GroupLayout(4, 4, 4)) == 0.0  # 1D


def test_the_averagings_flat_buffer_is_in_a_cpu_ranks_peak():
    """gloo flattens the coalesced all-reduce of a rank's shards into one buffer (the weights', then the
    state's): on the CPU, with big tables and a small batch, that buffer is the step's peak."""
    layout = GroupLayout(4, 4, 2)
    plan = price_group(_plan(layout.group_topology(get_sku("cpu"), "cpu")), layout)
    weights, state = replica_bytes(plan)[0]
    memory = predict_memory(plan)
    assert {m.peak_phase for m in memory} == {"replica sync"}
    assert memory[0].workspace_bytes == alloc_bytes(max(weights, state)) > 0
    exchanged = predict_memory(price_group(plan, layout, update=ReplicaUpdate.GRADIENTS))
    assert exchanged[0].peak_phase != "replica sync"  # nothing to average
    on_gpus = predict_memory(price_group(_plan(layout.group_topology(get_sku("h100"))), layout))
    assert on_gpus[0].peak_phase != "replica sync"  # NCCL reduces each tensor in place


def test_exchanging_gradients_holds_the_gathered_lookups_in_the_update():
    layout = GroupLayout(4, 4, 2)
    group_plan = _plan(layout.group_topology(get_sku("h100")), rows=1000)
    average = predict_memory(price_group(group_plan, layout))[0]
    exchange = predict_memory(price_group(group_plan, layout, update=ReplicaUpdate.GRADIENTS))[0]
    assert exchange.peak_phase == "update"
    gathered = 2 * alloc_bytes(2 * exchange_bytes(group_plan)[0])
    assert exchange.workspace_bytes >= gathered + average.workspace_bytes * (average.peak_phase == "update")


# ---- the default job, 4 ranks ------------------------------------------------------------------------

@pytest.mark.integration
def test_the_default_adagrad_job_in_two_groups_trains_as_1d(tmp_path, monkeypatch, capsys):
    """Adagrad's replicas exchanging their gradients apply 1D's update: two groups of two (and four groups
    of one) train as one group of four, every step's loss and every weight within anyrec-parity's
    default tolerance (measured: bit for bit). Averaging them instead (torchrec's sync) does not: checked
    against the 1D run's saved record, not a second run of it."""
    monkeypatch.chdir(tmp_path)
    one_group = "nproc=4 planner.sharding_group_size=4"
    variants = [one_group, "nproc=4 planner.sharding_group_size=2", "nproc=4 planner.sharding_group_size=1"]
    base = ["model=dlrm_tiny", "data.batch_size=64", "trainer.steps=6", "hardware.sku=cpu"]
    records = tmp_path / "records.json"
    code = parity.main([*base, "parity.variants=[" + ",".join(json.dumps(v) for v in variants) + "]",
                        f"parity.save={records}"])
    assert code == 0
    assert [r["label"] for r in json.loads(records.read_text())["runs"]] == variants  # the 1D run first
    averaged = "nproc=4 planner.sharding_group_size=2 planner.replica_update=average"
    capsys.readouterr()
    code = parity.main([*base, f"parity.variants=[{json.dumps(averaged)}]", f"parity.against={records}"])
    out = capsys.readouterr().out
    assert f"reference: {one_group} from {records}" in out
    row = next(line for line in out.splitlines() if "replica_update=average |" in line)
    assert code == 1 and row.startswith(f"| {averaged} | 6 |") and row.endswith("| DIFFERS |")
