"""`anyrec-plan` (anyrec/plan.py): the done-when cases through Hydra configs, JSON schema, plot, compare,
and the one-line error with exit code 2."""

import json
import os
import stat
from pathlib import Path

import pytest

from anyrec.plan import run
from tests.conftest import compose_config

GB = 1e9
DLRMV2 = ["model=dlrmv2", "optim=adagrad", "plan.batch_size=8192"]

# The plan.output schema: key -> type, at the top level, per rank and per table.
TOP = {"hardware": str, "world_size": int, "predicted_step_ms": float, "ranks": list, "tables": list}
RANK = {"rank": int, "hbm_bytes": int, "hbm_cap_bytes": int, "ddr_bytes": int, "predicted_ms": float}
TABLE = {"name": str, "sharding": str, "placement": str, "kernel": str, "ranks": list}


def _run(overrides: list[str]):
    _, cfg = compose_config(DLRMV2 + overrides)
    lines: list[str] = []
    result = run(cfg, print_fn=lines.append)
    return result, "\n".join(lines)


def _check_schema(obj: dict, schema: dict) -> None:
    assert set(obj) == set(schema)
    for key, typ in schema.items():
        assert type(obj[key]) is typ, f"{key}: {type(obj[key]).__name__}, want {typ.__name__}"


def test_mi350x_keeps_every_table_in_hbm():
    result, text = _run(["hardware=mi350x", "topology.world_size=1"])
    assert {o.placement.value for o in result.tables.values()} == {"hbm"}
    assert "MI350X" in text


def test_b200_default_uses_uvm_caching_and_says_why():
    result, text = _run(["hardware=b200", "topology.world_size=1"])
    off = [n for n, o in result.tables.items() if o.placement.value == "uvm_caching"]
    assert off
    assert "leave HBM" in text and "B200" in text


def test_8_h100_every_rank_within_80gb():
    result, _ = _run(["hardware=h100", "topology.world_size=8"])
    assert len(result.rank_storage) == 8
    assert all(s.hbm_bytes <= 80 * GB for s in result.rank_storage)


def test_output_json_schema_plot_and_compare(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    _, text = _run(
        ["hardware=mi350x", "topology.world_size=1", f"plan.output={out}", f"plan.plot={png}",
         "plan.compare=b200"]
    )
    data = json.loads(out.read_text())
    compare = data.pop("compare")
    for d in (data, compare):
        _check_schema(d, TOP)
        for r in d["ranks"]:
            _check_schema(r, RANK)
        for t in d["tables"]:
            _check_schema(t, TABLE)
            assert all(type(r) is int for r in t["ranks"])
    assert data["hardware"] == "MI350X" and compare["hardware"] == "B200"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "compare: MI350X vs B200" in text
    assert "memory density: MI350X 288 GB vs B200 180 GB = 1.60x" in text
    assert "table_wise/hbm on MI350X -> table_wise/uvm_caching on B200" in text


def test_report_and_json_name_the_selected_kernel(tmp_path):
    """backend.embedding_kernel=triton shards with `fused_triton`: the report and JSON say so."""
    out = tmp_path / "plan.json"
    _, text = _run(["hardware=h100", "topology.world_size=8", "backend.embedding_kernel=triton",
                    f"plan.output={out}"])
    kernels = {t["kernel"] for t in json.loads(out.read_text())["tables"]}
    assert kernels == {"fused_triton"}
    assert "kernel triton" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("t_cat_")]
    assert len(rows) == 26 and all(" fused_triton " in ln for ln in rows)


def test_forced_sharding_that_changes_the_update_is_one_line(tmp_path):
    out = tmp_path / "plan.json"
    with pytest.raises(ValueError) as e:
        _run(["hardware=h100", "topology.world_size=8", "optim=rowwise_adagrad",
              "planner.sharding=column_wise", f"plan.output={out}"])
    assert str(e.value).startswith("planner.sharding=column_wise: column_wise sharding cannot train "
                                   "optim=rowwise_adagrad exactly") and "\n" not in str(e.value)
    assert not out.exists()


def test_infeasible_exits_2_with_one_stderr_line(tmp_path, run_here):
    out = tmp_path / "plan.json"
    args = ["hardware=b200", "topology.world_size=1", "planner.allow_uvm=false", f"plan.output={out}"]
    args += DLRMV2 + [f"hydra.run.dir={tmp_path / 'hydra'}"]
    proc = run_here("plan", args, tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("anyrec-plan: error:")]
    assert len(errors) == 1 and errors[0].startswith("anyrec-plan: error: cannot plan"), proc.stderr[-2000:]
    assert not out.exists()


@pytest.mark.parametrize("bad", ["topology.world_size=0"])
def test_user_mistakes_are_value_errors(bad):
    with pytest.raises(ValueError, match="topology.world_size must be >= 1, got 0"):
        compose_config(DLRMV2 + ["hardware=h100", bad])  # before anything plans


def _calibration(path, bw_efficiency: float, per_launch_s: float) -> str:
    """A calibrated CPU hardware YAML whose only measured figure is FBGEMM's lookup profile."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    prof = {"bw_efficiency": bw_efficiency, "per_row_s": 1e-6, "per_launch_s": per_launch_s,
            "access_bytes": 64}
    path.write_text(yaml.safe_dump({"sku": "cpu", "spec": {"name": f"CPU ({path.stem}, calibrated)"},
                                    "measurements": {"embedding": {"fbgemm": {"profile": prof}},
                                                     "measured_fields": []}}))
    return str(path)


# no evaluation: anyrec-plan builds each split's synthetic source to count what it keeps on the device
SMALL = ["model=dlrm_small", "topology.world_size=2", "backend.embedding_kernel=fbgemm",
         "trainer.eval_steps=0"]


def _plan(overrides: list[str]):
    lines: list[str] = []
    result = run(compose_config(SMALL + overrides)[1], print_fn=lines.append)
    return result, "\n".join(lines)


def test_compare_costs_each_plan_with_its_own_calibration(tmp_path):
    a = _calibration(tmp_path / "a.yaml", 0.5, 1e-4)
    b = _calibration(tmp_path / "b.yaml", 0.01, 2e-2)  # 50x slower lookups, 200x the launch cost
    alone, _ = _plan([f"hardware.sku={a}"])
    with_compare, text = _plan([f"hardware.sku={a}", f"plan.compare={b}"])
    other, _ = _plan([f"hardware.sku={b}"])
    # Resolving b for the comparison must not change how a's plan is costed.
    assert with_compare.predicted_step_s == alone.predicted_step_s
    assert other.predicted_step_s > 1.5 * alone.predicted_step_s
    rows = text[text.index("compare:"):].splitlines()
    row = next(line for line in rows if line.startswith("predicted step"))
    ms = [f"{p.predicted_step_s * 1e3:.3f}" for p in (alone, other)]
    assert row.split()[2:] == [ms[0], "ms", ms[1], "ms"]


def test_calibrated_yaml_as_group_option_plans_like_the_path(tmp_path):
    path = _calibration(tmp_path / "hardware" / "mycal.yaml", 0.01, 2e-2)
    uncalibrated, _ = _plan(["hardware=cpu"])
    by_group, group_text = _plan([f"hydra.searchpath=[file://{tmp_path}]", "hardware=mycal"])
    by_path, _ = _plan([f"hardware.sku={path}"])
    assert by_group.predicted_step_s == by_path.predicted_step_s != uncalibrated.predicted_step_s
    # The figures line says what was measured, not "all from the SKU table".
    figures = group_text[group_text.index("figures:"):]
    assert "embedding fbgemm profile: measured" in figures, figures
    assert "all device figures from the SKU table (datasheet)" not in figures


def test_the_planner_never_proposes_what_the_trainer_refuses():
    """FBGEMM's CPU TBE has no fused Adam: on a CPU the planner replicates every table (which the
    trainer accepts), on a GPU it shards as usual; both read the Impl record's answer."""
    from types import SimpleNamespace

    from anyrec.backends.dispatch import FBGEMM_EMBEDDING
    from anyrec.config import OptimConfig
    from anyrec.trainer.optim import check_embedding_optimizer

    cpu, _ = _plan(["hardware=cpu", "optim=adam"])
    kinds = {o.sharding.value for o in cpu.tables.values()}
    assert kinds == {"data_parallel"}
    plan = SimpleNamespace(plan={"ebc": {n: SimpleNamespace(sharding_type=o.sharding.value)
                                         for n, o in cpu.tables.items()}})
    check_embedding_optimizer(OptimConfig(name="adam"), FBGEMM_EMBEDDING, "cpu", plan)  # accepted
    gpu, _ = _plan(["hardware=h100", "optim=adam"])
    assert {o.sharding.value for o in gpu.tables.values()} - {"data_parallel"}
    adagrad, _ = _plan(["hardware=cpu", "optim=adagrad"])
    assert {o.sharding.value for o in adagrad.tables.values()} - {"data_parallel"}
    with pytest.raises(ValueError, match="planner.sharding=table_wise with optim=adam: the fbgemm embedding "
                                         "implementation has no fused adam on the CPU"):
        _plan(["hardware=cpu", "optim=adam", "planner.sharding=table_wise"])


def _cached_entry(folder: Path) -> Path:
    """This machine's calibration entry at 2 local ranks in the cache `folder`, signed as a job on this
    machine signs it (with the per-user key anyrec created in the cache folder)."""
    import dataclasses

    import yaml

    from anyrec.backends import get_backend
    from anyrec.history import cache as calcache
    from anyrec.runtime.distributed import ONE_PROCESS
    from anyrec.signing import resolve_key

    key = dataclasses.replace(calcache.local_key(get_backend("cpu"), ONE_PROCESS), local_world_size=2,
                              cores_per_rank=((0,), (1,)))
    data = yaml.safe_load((Path(__file__).parent / "data" / "calibration_cpu_2rank.yaml").read_text())
    return calcache.write_entry(folder / key.file_name(), key, data, signing_key=resolve_key(None))


def test_plan_uses_this_machines_cached_calibration_and_says_so(tmp_path, monkeypatch):
    """hardware=auto: the cached calibration for the local device at the planned local ranks, named;
    without one (or for another SKU) the figures are said to be the datasheet's."""
    from anyrec.history import cache as calcache

    monkeypatch.setenv(calcache.CACHE_DIR_ENV, str(tmp_path))
    args = ["hardware=auto", "backend=cpu", "topology.world_size=2", "plan.compare=h100",
            "trainer.calibrate=auto"]
    datasheet, text = _plan(args)
    assert "no calibration cached for this machine at 2 local rank(s)" in text and "datasheet" in text
    assert "compare figures: all device figures from the SKU table (datasheet)" in text
    path = _cached_entry(tmp_path)
    cached, text = _plan(args)
    assert f"this machine's cached calibration (2 local rank(s)): {path}" in text
    assert f"measured ({path})" in text
    assert cached.predicted_step_s > 2 * datasheet.predicted_step_s  # the measured framework costs
    _, text = _plan(args + ["topology.local_world_size=1"])  # another shape: not this calibration
    assert "no calibration cached for this machine at 1 local rank(s)" in text
    _, text = _plan(args + ["trainer.calibrate=never"])
    assert "cached calibration" not in text


def test_plan_of_an_hstu_job_uses_the_kernels_its_training_job_measured(tmp_path, monkeypatch):
    """hardware=auto for dlrmv4_small: the HSTU record a training job of it kept beside this machine's
    cached calibration (first contact) is what the plan costs the dense part by, as that job did, named."""
    from anyrec.backends.hardware import HSTURates
    from anyrec.calibration.first_contact import hstu_record_key
    from anyrec.data import resolve_batch_size
    from anyrec.history import cache as calcache
    from anyrec.history.hstu_records import record_path, write_record
    from anyrec.models.family import resolve_family

    monkeypatch.setenv(calcache.CACHE_DIR_ENV, str(tmp_path))
    entry = _cached_entry(tmp_path)
    overrides = ["model=dlrmv4_small", "hardware=auto", "backend=cpu", "topology.world_size=2",
                 "trainer.calibrate=auto"]

    def planned() -> tuple[float, str]:
        lines: list[str] = []
        return run(compose_config(overrides)[1], print_fn=lines.append).predicted_step_s, "\n".join(lines)

    assumed, text = planned()
    assert "(torch, 10% of peak, assumed)" in text and "HSTU kernels as a training job" not in text
    cfg = compose_config(overrides)[1]
    key = hstu_record_key(entry, "torch", False, resolve_family(cfg.model).workload_facts(cfg.model).hstu,
                          resolve_batch_size(cfg.data, 2).batch_size)
    rate = HSTURates(impl="torch", dtype="fp32", heads=2, qk_dim=16, v_dim=16, mean_tokens=51.7,
                     rms_tokens=52.0, longest_tokens=57, batch=128, forward_s=0.01, step_s=0.04,
                     flops_per_s=2e9, gemm_flops_per_s=5e10, elementwise_bw_bytes_per_s=8e9, dense_step_s=0.5)
    write_record(record_path(key), key, rate)
    measured, text = planned()
    assert "attention" in text and "measured 2.0 GFLOP/s" in text
    assert f"HSTU kernels as a training job of this model measured them: {record_path(key)}" in text
    assert assumed < 0.5 < measured  # the record's half-second dense step, not the assumed rates
