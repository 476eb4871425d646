"""Planner end to end: the DLRMv2 done-when cases, torchrec plans, JSON, report, plot, CLI, errors."""

import itertools
import json
import math
import os
from unittest import mock

import pytest

from anyrec.backends import EmbeddingCost, resolve_hardware
from anyrec.backends.dispatch import get_impl
from anyrec.backends.specs import get_sku
from anyrec.config import PlannerConfig
from anyrec.kernels.optimizers import OptimizerConfig
from anyrec.kernels.tbe import TritonTableBatchedEmbedding
from anyrec.planner import CoDesignPlanner, InfeasiblePlanError, Placement, ShardingType, Topology
from anyrec.planner.estimators import simd_utilisation
from anyrec.planner.evaluate import evaluate_assignment
from anyrec.planner.job import plan_options
from anyrec.planner.planner import make_workload
from anyrec.planner.report import format_report, plan_json, plot_plan, write_json_atomic
from anyrec.planner.simple import simple_table_shardings, to_sharding_plan
from anyrec.planner.torchrec_plan import from_sharding_plan, meta_ebc
from anyrec.planner.torchrec_plan import to_sharding_plan as plan_to_sharding_plan
from anyrec.planner.types import Perf, Storage, TableSpec
from anyrec.planner.workloads import DLRMV2_DENSE_PARAMS, dlrmv2_tables

GB = 1e9
B = 8192



def _cost(kernel: str) -> EmbeddingCost:
    """Embedding implementation `kernel` with its built-in profiles, as the planner takes it."""
    return EmbeddingCost.builtin(get_impl("embedding", kernel))

def _plan(sku, w, **kw):
    return CoDesignPlanner().plan(
        dlrmv2_tables(), Topology(get_sku(sku), w), B, "adagrad", DLRMV2_DENSE_PARAMS, **kw
    )


def test_value_types():
    assert Storage(1, 2) + Storage(3, 4) == Storage(4, 6)
    assert Storage(1, 2).fits_in(Storage(1, 2)) and not Storage(2, 0).fits_in(Storage(1, 5))
    assert (Perf(1, 2, 3, 4) + Perf(1, 1, 1, 1)).total_s == 14
    with pytest.raises(ValueError):
        TableSpec("t", 0, 8, 1.0, ["f"])
    with pytest.raises(ValueError):
        Topology(get_sku("h100"), 12, 8)
    assert simd_utilisation(128, 64) == 1.0 and simd_utilisation(96, 64) == 0.75


def test_dlrmv2_adagrad_fits_one_mi350x_in_hbm():
    tables = dlrmv2_tables()
    assert sum(t.weight_bytes for t in tables) * 2 == pytest.approx(209 * GB, rel=0.01)
    res = _plan("mi350x", 1)
    assert {o.placement for o in res.tables.values()} == {Placement.HBM}
    assert res.rank_storage[0].hbm_bytes <= 288 * GB


def test_dlrmv2_adagrad_on_one_b200_uses_uvm_caching_or_says_why():
    res = _plan("b200", 1)
    off = [n for n, o in res.tables.items() if o.placement != Placement.HBM]
    assert off and all(res.tables[n].placement == Placement.UVM_CACHING for n in off)
    assert res.rank_storage[0].hbm_bytes <= res.caps.hbm_bytes
    assert "leave HBM" in format_report(res)
    with pytest.raises(InfeasiblePlanError) as e:
        _plan("b200", 1, allowed_placements=("hbm",))
    msg = str(e.value)
    assert "\n" not in msg and "B200" in msg and "209.1 GB" in msg
    assert "MI350X" in msg and "uvm_caching" in msg and "2 x B200" in msg


def test_dlrmv2_on_8_h100_within_80gb_and_torchrec_plan():
    res = _plan("h100", 8)
    assert all(s.hbm_bytes <= 80 * GB for s in res.rank_storage)
    assert res.predicted_step_s >= res.lower_bound_s
    plan = plan_to_sharding_plan(res, "model.ebc")
    per_table = plan.plan["model.ebc"]
    assert set(per_table) == {t.name for t in dlrmv2_tables()}
    for name, opt in res.tables.items():
        ps = per_table[name]
        assert ps.sharding_type == opt.sharding.value
        assert sorted(ps.ranks) == sorted(opt.ranks)
        assert ps.compute_kernel == ("dense" if opt.sharding == ShardingType.DATA_PARALLEL else "fused")
    # Round trip: the torchrec plan costs the same under anyrec's model.
    again = evaluate_assignment(from_sharding_plan(plan), res.topology, res.workload)
    assert again.predicted_step_s == pytest.approx(res.predicted_step_s, rel=1e-9)


def test_forced_row_wise_and_cpu_kernels():
    tables = dlrmv2_tables(dim=16)[:4]
    topo = Topology(get_sku("cpu"), 2, 2)
    res = CoDesignPlanner().plan(tables, topo, 64, "sgd", allowed_shardings=("row_wise",))
    assert {o.sharding for o in res.tables.values()} == {ShardingType.ROW_WISE}
    plan = plan_to_sharding_plan(res)
    kernels = {ps.compute_kernel for ps in next(iter(plan.plan.values())).values()}
    assert kernels == {"fused"}


def test_uvm_kernel_names_on_cuda():
    res = _plan("b200", 1)
    plan = plan_to_sharding_plan(res)
    kernels = {ps.compute_kernel for ps in next(iter(plan.plan.values())).values()}
    assert kernels == {"fused", "fused_uvm_caching"}


def test_json_schema_report_and_plot(tmp_path):
    res = _plan("h100", 8)
    d = plan_json(res)
    assert d["hardware"] == "H100" and d["world_size"] == 8 and d["predicted_step_ms"] > 0
    assert [r["rank"] for r in d["ranks"]] == list(range(8))
    assert set(d["ranks"][0]) == {"rank", "hbm_bytes", "hbm_cap_bytes", "ddr_bytes", "predicted_ms"}
    assert set(d["tables"][0]) == {"name", "sharding", "placement", "kernel", "ranks"}
    json.dumps(d)
    text = format_report(res)
    assert "t_cat_20" in text and "why" in text and "fewest devices" in text
    path = tmp_path / "plan.png"
    plot_plan(res, str(path), compare=_plan("mi350x", 8))
    assert path.stat().st_size > 10_000


def test_simd_advice_names_misaligned_dim():
    tables = [TableSpec("t0", 1_000_000, 96, 4.0, ["f0"]), TableSpec("t1", 1000, 128, 1.0, ["f1"])]
    res = CoDesignPlanner().plan(tables, Topology(get_sku("mi350x"), 2), 1024, "sgd")
    assert "dim 96" in format_report(res) and "64-wide SIMD" in format_report(res)


def test_atomic_write_leaves_no_partial_file(tmp_path):
    path = tmp_path / "x.json"
    with pytest.raises(TypeError):
        write_json_atomic(str(path), {"bad": object()})
    assert os.listdir(tmp_path) == []


def test_user_errors_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_workload(dlrmv2_tables(), B, "lion")
    with pytest.raises(ValueError, match="unknown embedding implementation 'cutlass'"):
        get_impl("embedding", "cutlass")
    spec = tmp_path / "hw.json"
    spec.write_text(json.dumps({"base": "h200", "memory_bw_bytes_per_s": 4.18e12}))
    assert resolve_hardware(str(spec)).spec.memory_bw_bytes_per_s == 4.18e12
    assert resolve_hardware("mi355x").spec.name == "MI355X"


def test_simple_planner_shares_the_torchrec_mapping():
    tables = dlrmv2_tables(dim=16)[:4]
    ebc = meta_ebc(tables)
    shardings = simple_table_shardings(ebc.embedding_bag_configs(), 4, force="table_row_wise")
    shardings[tables[0].name] = ("column_wise", [1, 3])
    shardings[tables[1].name] = ("data_parallel", [0, 1, 2, 3])
    plan = to_sharding_plan(ebc, shardings, "m.ebc", 4, 2, "cuda", compute_kernel="fused_uvm")
    per_table = plan.plan["m.ebc"]
    assert per_table[tables[0].name].ranks == [1, 3]
    assert per_table[tables[1].name].compute_kernel == "dense"
    # table_row_wise() takes no compute_kernel: passing one was a TypeError before.
    assert per_table[tables[2].name].sharding_type == "table_row_wise"
    assert per_table[tables[2].name].compute_kernel == "fused_uvm"


def test_forced_sharding_without_options_says_why():
    tables = dlrmv2_tables(dim=8)[:3]
    with pytest.raises(InfeasiblePlanError, match="cannot plan 3 of 3 tables .* column_wise .* >= 16"):
        CoDesignPlanner().plan(
            tables, Topology(get_sku("cpu"), 2, 2), 64, "sgd", allowed_shardings=("column_wise",)
        )


def test_triton_kernel_plan_is_hbm_only_without_data_parallel():
    opts = plan_options(PlannerConfig(), _cost("triton"), "adagrad")
    assert opts["allowed_placements"] == (Placement.HBM,)
    assert ShardingType.DATA_PARALLEL not in opts["allowed_shardings"]
    fbgemm = _plan("h100", 8, **plan_options(PlannerConfig(), _cost("fbgemm"), "adagrad"))
    assert any(o.sharding == ShardingType.DATA_PARALLEL for o in fbgemm.tables.values())  # the case bites
    res = _plan("h100", 8, **opts)
    assert all(o.sharding != ShardingType.DATA_PARALLEL for o in res.tables.values())
    assert {o.placement for o in res.tables.values()} == {Placement.HBM}
    per_table = plan_to_sharding_plan(res, "m.ebc").plan["m.ebc"]
    assert {ps.compute_kernel for ps in per_table.values()} == {"fused_triton"}
    # One B200 needs UVM caching for DLRMv2 + Adagrad: the triton kernel cannot, so no plan (not a UVM one).
    with pytest.raises(InfeasiblePlanError):
        _plan("b200", 1, **opts)


def test_optimizer_state_bytes_are_what_the_kernel_allocates():
    """The planner charges each implementation the optimizer state its kernel really keeps: anyrec's
    TBE (triton, torch) is measured from the tensors it allocates; FBGEMM's against its documented
    layout (EXACT_ROWWISE_ADAGRAD one fp32 per row, EXACT_ADAGRAD one per element, ADAM two)."""
    rows, dim = 10, 96
    for opt, kernel in itertools.product(("sgd", "rowwise_adagrad", "adagrad", "adam"), ("torch", "triton")):
        # The Triton execution allocates without launching a kernel; the interpreter lets it exist on CPU.
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
            tbe = TritonTableBatchedEmbedding([(rows, dim)], [0], optimizer=OptimizerConfig(kind=opt),
                                              execution=kernel)
        state = {n: b for n, b in tbe.named_buffers() if n.startswith("momentum")}
        allocated = sum(b.numel() * b.element_size() for b in state.values())
        assert allocated == rows * _cost(kernel).state_bytes_per_row(opt, dim), (opt, kernel)
    assert allocated > 0  # adam: the loop checked a kernel that keeps state
    fbgemm = {"sgd": 0, "rowwise_adagrad": 4, "adagrad": 4 * dim, "adam": 8 * dim}
    assert {o: _cost("fbgemm").state_bytes_per_row(o, dim) for o in fbgemm} == fbgemm


def test_rowwise_adagrad_is_never_split_by_columns():
    """Row-wise Adagrad keeps one accumulator per row; over column shards each piece would keep its own,
    so the planners never propose column-wise for it, and forcing it fails in one line."""
    adagrad = _plan("h100", 8)
    assert any(o.sharding == ShardingType.COLUMN_WISE for o in adagrad.tables.values())  # the case bites
    rowwise = CoDesignPlanner().plan(dlrmv2_tables(), Topology(get_sku("h100"), 8), B, "rowwise_adagrad",
                                     DLRMV2_DENSE_PARAMS)
    assert {o.sharding for o in rowwise.tables.values()} <= {
        ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL}
    assert all(o.sharding != ShardingType.COLUMN_WISE
               for opts in rowwise.options_by_table.values() for o in opts)
    tables = dlrmv2_tables(dim=32)[:3]
    with pytest.raises(ValueError, match="^column_wise sharding cannot train optim=rowwise_adagrad ex") as e:
        CoDesignPlanner().plan(tables, Topology(get_sku("cpu"), 2, 2), 64, "rowwise_adagrad",
                               allowed_shardings=("column_wise",))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="^planner.sharding=column_wise: column_wise sharding cannot train"):
        plan_options(PlannerConfig(sharding="column_wise"), _cost("fbgemm"), "rowwise_adagrad")
    forced = plan_options(PlannerConfig(sharding="column_wise"), _cost("fbgemm"), "adagrad")
    assert forced["allowed_shardings"] == (ShardingType.COLUMN_WISE,)
    configs = meta_ebc(tables).embedding_bag_configs()
    with pytest.raises(ValueError, match="^planner.sharding=column_wise: column_wise sharding cannot train"):
        simple_table_shardings(configs, 2, force="column_wise", optimizer="rowwise_adagrad")
    assert {k for k, _ in simple_table_shardings(configs, 2, optimizer="rowwise_adagrad").values()} <= {
        "table_wise", "row_wise"}
    assert simple_table_shardings(configs, 2, force="column_wise", optimizer="adam")[tables[0].name][0] == (
        "column_wise")


def test_plan_names_the_compute_kernel_the_trainer_shards_with():
    """The report, the JSON and the torchrec plan all name the embedding implementation's kernel."""
    for kernel, expected in (("fbgemm", "fused"), ("triton", "fused_triton"), ("torch", "fused_triton")):
        res = _plan("h100", 8, **plan_options(PlannerConfig(), _cost(kernel), "adagrad"))
        sharded = {n for n, o in res.tables.items() if o.sharding != ShardingType.DATA_PARALLEL}
        assert sharded
        assert {t["kernel"] for t in plan_json(res)["tables"] if t["name"] in sharded} == {expected}
        per_table = plan_to_sharding_plan(res, "m.ebc").plan["m.ebc"]
        assert {per_table[n].compute_kernel for n in sharded} == {expected}
        rows = [ln for ln in format_report(res).splitlines() if ln.split(" ")[0] in sharded]
        assert len(rows) == len(sharded) and all(f" {expected} " in ln for ln in rows)


def test_fused_backward_updates_each_distinct_row_once():
    """The TBE sorts a batch's ids and updates each touched row and its optimizer state once: a
    small table hit a million times costs its rows, not a million row updates; a large table
    hit a few times costs about one update per id."""
    from anyrec.planner.estimators import lookup_time_s, touched_rows

    assert touched_rows(1e6, 100) == pytest.approx(100.0)
    assert touched_rows(10, 1e9) == pytest.approx(10.0, rel=1e-6)
    assert touched_rows(1000, 1000) == pytest.approx(1000 * (1 - math.exp(-1)))
    topo = Topology(get_sku("h100"), 1)

    def bwd(n_ids, rows, fused=True):
        table = TableSpec("t", rows, 128, n_ids / 1000, ["f"])
        return lookup_time_s(n_ids, 1000, 128, table, Placement.HBM, topo, "adagrad", _cost("fbgemm"),
                             fused_optimizer=fused)[1]

    base = bwd(1000, 10)  # ids and output gradients, 10 rows updated
    assert bwd(1_000_000, 10) - base < 0.01 * (bwd(1_000_000, 10**9) - bwd(1000, 10**9))
    # Unfused (data-parallel) lookups scatter every id into a dense gradient: no such saving.
    assert bwd(1_000_000, 10, fused=False) > 100 * bwd(1_000_000, 10)
