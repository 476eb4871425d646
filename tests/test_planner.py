"""Planner end to end: the DLRMv2 done-when cases, torchrec plans, JSON, report, plot, CLI, errors."""

import json
import os

import pytest

from anyrec.backends import resolve_hardware
from anyrec.backends.specs import get_sku
from anyrec.planner import CoDesignPlanner, InfeasiblePlanError, Placement, ShardingType, Topology
from anyrec.planner.cli import run_plan, write_json_atomic
from anyrec.planner.estimators import simd_utilisation
from anyrec.planner.planner import evaluate_assignment, make_workload
from anyrec.planner.torchrec_plan import from_sharding_plan
from anyrec.planner.types import Perf, Storage, TableSpec
from anyrec.planner.workloads import DLRMV2_DENSE_PARAMS, dlrmv2_tables

GB = 1e9
B = 8192


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
    assert "leave HBM" in res.report()
    with pytest.raises(InfeasiblePlanError) as e:
        _plan("b200", 1, allowed_placements=("hbm",))
    msg = str(e.value)
    assert "\n" not in msg and "B200" in msg and "209.1 GB" in msg
    assert "MI350X" in msg and "uvm_caching" in msg and "2 x B200" in msg


def test_dlrmv2_on_8_h100_within_80gb_and_torchrec_plan():
    res = _plan("h100", 8)
    assert all(s.hbm_bytes <= 80 * GB for s in res.rank_storage)
    assert res.predicted_step_s >= res.lower_bound_s
    plan = res.to_sharding_plan("model.ebc")
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
    plan = res.to_sharding_plan()
    kernels = {ps.compute_kernel for ps in next(iter(plan.plan.values())).values()}
    assert kernels == {"fused"}


def test_uvm_kernel_names_on_cuda():
    res = _plan("b200", 1)
    plan = res.to_sharding_plan()
    kernels = {ps.compute_kernel for ps in next(iter(plan.plan.values())).values()}
    assert kernels == {"fused", "fused_uvm_caching"}


def test_json_schema_report_and_plot(tmp_path):
    res = _plan("h100", 8)
    d = res.to_json_dict()
    assert d["hardware"] == "H100" and d["world_size"] == 8 and d["predicted_step_ms"] > 0
    assert [r["rank"] for r in d["ranks"]] == list(range(8))
    assert set(d["ranks"][0]) == {"rank", "hbm_bytes", "hbm_cap_bytes", "ddr_bytes", "predicted_ms"}
    assert set(d["tables"][0]) == {"name", "sharding", "placement", "kernel", "ranks"}
    json.dumps(d)
    text = res.report()
    assert "t_cat_20" in text and "why" in text and "fewest devices" in text
    path = tmp_path / "plan.png"
    res.plot(str(path), compare=_plan("mi350x", 8))
    assert path.stat().st_size > 10_000


def test_simd_advice_names_misaligned_dim():
    tables = [TableSpec("t0", 1_000_000, 96, 4.0, ["f0"]), TableSpec("t1", 1000, 128, 1.0, ["f1"])]
    res = CoDesignPlanner().plan(tables, Topology(get_sku("mi350x"), 2), 1024, "sgd")
    assert "dim 96" in res.report() and "64-wide SIMD" in res.report()


def test_run_plan_writes_json_png_and_compares(tmp_path):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    lines = []
    res = run_plan(
        dlrmv2_tables(),
        get_sku("mi350x"),
        1,
        1,
        B,
        "adagrad",
        DLRMV2_DENSE_PARAMS,
        output=str(out),
        plot=str(png),
        compare=get_sku("b200"),
        print_fn=lines.append,
    )
    data = json.loads(out.read_text())
    assert data["hardware"] == "MI350X" and data["compare"]["hardware"] == "B200"
    assert png.exists() and res.predicted_step_s > 0
    text = "\n".join(lines)
    assert "memory density: MI350X 288 GB vs B200 180 GB = 1.60x" in text
    assert "table_wise/hbm on MI350X -> table_wise/uvm_caching on B200" in text


def test_run_plan_infeasible_writes_nothing(tmp_path):
    out = tmp_path / "p.json"
    with pytest.raises(InfeasiblePlanError):
        run_plan(
            dlrmv2_tables(),
            get_sku("h100"),
            1,
            1,
            B,
            "adam",
            0,
            output=str(out),
            allowed_placements=("hbm",),
            print_fn=lambda s: None,
        )
    assert not out.exists()


def test_atomic_write_leaves_no_partial_file(tmp_path):
    path = tmp_path / "x.json"
    with pytest.raises(TypeError):
        write_json_atomic(str(path), {"bad": object()})
    assert os.listdir(tmp_path) == []


def test_user_errors_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_workload(dlrmv2_tables(), B, "lion")
    with pytest.raises(ValueError, match="unknown embedding kernel"):
        make_workload(dlrmv2_tables(), B, "sgd", kernel="cutlass")
    spec = tmp_path / "hw.json"
    spec.write_text(json.dumps({"base": "h200", "memory_bw_bytes_per_s": 4.18e12}))
    assert resolve_hardware(str(spec)).memory_bw_bytes_per_s == 4.18e12
    assert resolve_hardware("mi355x").name == "MI355X"


def test_simple_planner_shares_the_torchrec_mapping():
    from anyrec.planner.simple import simple_table_shardings, to_sharding_plan
    from anyrec.planner.torchrec_plan import meta_ebc

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
    from anyrec.config import PlannerConfig
    from anyrec.planner.job import plan_options

    opts = plan_options(PlannerConfig(), "triton")
    assert opts["allowed_placements"] == (Placement.HBM,)
    assert ShardingType.DATA_PARALLEL not in opts["allowed_shardings"]
    fbgemm = _plan("h100", 8, **plan_options(PlannerConfig(), "fbgemm"))
    assert any(o.sharding == ShardingType.DATA_PARALLEL for o in fbgemm.tables.values())  # the case bites
    res = _plan("h100", 8, **opts)
    assert all(o.sharding != ShardingType.DATA_PARALLEL for o in res.tables.values())
    assert {o.placement for o in res.tables.values()} == {Placement.HBM}
    per_table = res.to_sharding_plan("m.ebc").plan["m.ebc"]
    assert {ps.compute_kernel for ps in per_table.values()} == {"fused_triton"}
    # One B200 needs UVM caching for DLRMv2 + Adagrad: the triton kernel cannot, so no plan (not a UVM one).
    with pytest.raises(InfeasiblePlanError):
        _plan("b200", 1, **opts)


def test_optimizer_state_bytes_follow_the_kernel():
    from anyrec.kernels.optimizers import state_bytes_per_row as tbe_state_bytes_per_row
    from anyrec.planner.estimators import state_bytes_per_row

    for kernel in ("fbgemm", "triton", "torch"):
        # FBGEMM layout (EXACT_ROWWISE_ADAGRAD momentum1: one fp32 per row) and anyrec's TBE agree.
        assert state_bytes_per_row("rowwise_adagrad", 128, kernel) == 4
        assert state_bytes_per_row("adagrad", 64, kernel) == 4 * 64
        assert state_bytes_per_row("adam", 64, kernel) == 8 * 64
        assert state_bytes_per_row("sgd", 64, kernel) == 0
    for opt in ("sgd", "rowwise_adagrad", "adagrad", "adam"):
        assert state_bytes_per_row(opt, 96, "triton") == tbe_state_bytes_per_row(opt, 96)
