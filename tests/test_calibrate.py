"""anyrec.calibrate on CPU: a hardware YAML the planner plans with, fitted in the planner's own terms."""

from __future__ import annotations

import pytest
import torch
import yaml

from anyrec import calibrate
from anyrec.backends import get_backend, load_hardware_file, resolve_hardware
from anyrec.backends.dispatch import KernelProfile, availability, get_impl
from anyrec.backends.specs import get_sku
from anyrec.calibration import step as calibrate_step
from anyrec.calibration.measure import embedding, phases, timing
from anyrec.history import cache as calcache
from anyrec.plan import run
from anyrec.planner import estimators
from anyrec.planner.types import Topology

from .conftest import compose_config


def _check_file(path, world_size: int) -> dict:
    data = yaml.safe_load(path.read_text())
    assert set(data) == {"spec", "measurements"}
    m = data["measurements"]
    assert m["copy_bw_bytes_per_s"] > 1e8  # any host copies more than 100 MB/s
    assert m["gemm_flops"]["fp32"] > 1e8 and m["gemm_flops"]["bf16"] > 1e7
    assert m["dlrm_mlp"]["flops"] > 1e7
    emb = m["embedding"]
    for name in ("fbgemm", "torch"):  # every registered implementation that runs on CPU
        assert len(emb[name]["points"]) == len(embedding.EMB_POINTS["small"])
        assert all(p["step_s"] > 0 and p["spread"] >= 0 for p in emb[name]["points"])
        # a fit that misses a point by more than 30 % (a busy host) is used all the same, and the verdict
        # names it: such figures are not trusted later
        assert 0 < emb[name]["profile"]["bw_efficiency"] <= 1
        if emb[name]["fit_max_rel_error"] > 0.3:
            assert f"embedding {name} (fit error" in " ".join(m["trust"]["reasons"])
    assert m["spread"] and all(v >= 0 for v in m["spread"].values())  # each repeated measurement's
    assert isinstance(m["trust"]["trusted"], bool) and m["trust"]["cores"] >= 1
    # Triton is timed wherever it reaches the device (not on CPU without its interpreter).
    triton_runs = availability(get_backend("auto"), "embedding", "triton") is None
    assert ("skipped" in emb["triton"]) != triton_runs
    hardware = resolve_hardware(str(path))
    spec = hardware.spec
    assert spec.name.endswith("(calibrated)") and spec.vendor == get_backend("auto").device_spec().vendor
    assert spec.memory_bw_bytes_per_s == m["copy_bw_bytes_per_s"]
    assert spec.peak_fp32_flops == m["gemm_flops"]["fp32"]
    assert 0 < spec.dense_efficiency <= 1
    # The file's measured profiles travel in the value: the planner costs lookups with them.
    fbgemm = hardware.embedding_cost(get_impl("embedding", "fbgemm"))
    if "profile" in emb["fbgemm"]:
        assert fbgemm.profile.per_launch_s == emb["fbgemm"]["profile"]["per_launch_s"]
    if "profile" in emb["torch"]:
        assert "anyrec.calibrate" in fbgemm.dense_profile.source  # the torch implementation's, measured
    assert "memory_bw_bytes_per_s" in load_hardware_file(path).measured_fields
    if world_size > 1:
        c = m["collectives"]
        assert c["world_size"] == world_size
        assert c["all_to_all"]["bus_bw_bytes_per_s"] > 1e6 and c["all_reduce"]["bus_bw_bytes_per_s"] > 1e6
        assert len(c["all_to_all"]["seconds"]) == len(phases.SIZES["small"]["comm_bytes"])
        assert spec.scale_up_bw_bytes_per_s == c["all_to_all"]["bus_bw_bytes_per_s"]
        assert spec.scale_up_latency_s > 0 and "scale_up_latency_s" in m["measured_fields"]
    # The trainer's framework costs, from real training steps at this world size (one rank's too): a
    # step costs something beyond the bytes and FLOPs of these tiny tables, and the spec carries the fit.
    step = m["step"]  # used even where its fit missed a point by more than 30 % (then not trusted)
    assert (step["fit_max_rel_error"] <= 0.3) or not m["trust"]["trusted"]
    assert len(step["points"]) == len(calibrate_step.points_at(world_size))
    ratios = sorted(p["measured_s"] / p["model_s"] for p in step["points"] if p["model_s"] > 0)
    assert len(ratios) == len(step["points"]), ratios
    # one point may time below the model when the host is busy while the bandwidths are measured, not most
    # of them; on a host seen busy (the figures not trusted) most may: a CI run measured a median of 0.82
    # with a third process beside its two ranks
    assert ratios[len(ratios) // 2] > 1 or not m["trust"]["trusted"], (ratios, m["trust"])
    assert sum(step["fields"].values()) > 0
    for name, value in step["fields"].items():  # the spec carries the fit
        assert getattr(spec, name) == value and name in m["measured_fields"]
    assert "step_fixed_s" in m["measured_fields"]
    return m


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("quick", [False, True])
def test_step_points_tell_every_framework_term_apart(quick, world):
    # Each fitted term needs a point that moves it alone: the points' columns are independent. One rank
    # trains table-wise tables only (sharding groups and replicas are then no terms of their own).
    points = calibrate_step.points_at(world, quick)
    assert world > 1 or all(p.shardings == ("table_wise",) for p in points)
    X = torch.tensor([p.terms(world) for p in points], dtype=torch.float64)
    assert X.shape[1] == len(calibrate_step.STEP_FIELDS)
    terms = len(calibrate_step.STEP_FIELDS) - (2 if world == 1 else 0)
    assert int(torch.linalg.matrix_rank(X / X.abs().amax(dim=0).clamp(min=1))) == terms


@pytest.mark.integration
def test_calibrate_writes_a_hardware_yaml(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Hydra's run folder, as for anyrec-train
    out = tmp_path / "sub" / "cal.yaml"
    calibrate.cli([f"calibrate.output={out}", "calibrate.budget_s=0.02", "calibrate.time_limit_s=900"])
    m = _check_file(out, world_size=1)
    assert m["seconds"] > 0  # how long it took is the report's, not a bound a busy host could break
    table = capsys.readouterr().out
    # its fitted profile, or why it was not used (a fit past 30 % on a busy host)
    assert ("emb fbgemm" in table and "per_launch" in table) or \
        "(skipped) embedding fbgemm: fit error" in table
    assert f"wrote {out} in {m['seconds']:.1f} s" in table  # the time it reports is the one it stored
    assert "Units are in the key names" in out.read_text()
    assert not list(out.parent.glob(".*tmp*"))  # the atomic write left no temporary behind
    # the spec ends with the measured fields: a cut anywhere loses one it claims (an assumed field with a
    # default, auto_precision, comes before them)
    data = yaml.safe_load(out.read_text())
    measured = data["measurements"]["measured_fields"]
    assert set(list(data["spec"])[-len(measured):]) == set(measured)
    assert data["spec"]["auto_precision"] == "fp32"  # the CPU's: anyrec runs it in fp32 under auto


@pytest.mark.integration
@pytest.mark.cpu_only  # two ranks on one host: one device each only without an accelerator
def test_calibrate_under_torchrun_measures_collectives(two_rank_calibration):
    """The run's one 2-rank calibration (`two_rank_calibration`: calibrate.cache=true, every figure
    measured)."""
    proc, out, cache = two_rank_calibration.proc, two_rank_calibration.output, two_rank_calibration.cache
    m = _check_file(out, world_size=2)
    assert proc.stdout.count("wrote ") == 2  # rank 0 only: the file and this machine's cache entry
    # bind_cores=auto by default: what the rule chose, and from what, is recorded with the figures
    assert m["bind_rule"].startswith("backend.bind_cores=auto: other processes used")
    assert m["bind_cores"] == m["bind_rule"].endswith("bound")
    # cache=true: the thorough calibration is this machine's entry, as hardware=auto jobs look it up
    (entry,) = cache.glob("*.yaml")
    assert f"wrote the cache entry for this machine: {entry}" in proc.stdout
    key = calcache.CacheKey.from_dict(yaml.safe_load(entry.read_text())["cache"]["key"])
    spec = calcache.read_entry(entry, key).hardware.spec
    assert key.local_world_size == 2
    if "step" in m:
        assert spec.step_fixed_s == m["step"]["fields"]["step_fixed_s"]


def test_fit_recovers_known_costs():
    # step = 50 us + 3 ns per row + bytes term / 0.25: the fit gets the three terms back.
    rows = [[1.0, r, b] for r, b in [(1e3, 1e-5), (1e5, 1e-4), (4e5, 1e-3), (2e4, 5e-3), (3e5, 2e-4)]]
    y = [50e-6 + 3e-9 * r + b / 0.25 for _, r, b in rows]
    launch, per_row, per_byte = timing.fit_nonnegative(rows, y)
    assert launch == pytest.approx(50e-6, rel=1e-6) and per_row == pytest.approx(3e-9, rel=1e-6)
    assert per_byte == pytest.approx(4.0, rel=1e-6)
    # A negative best fit is not taken: costs are never negative.
    assert min(timing.fit_nonnegative([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], [3.0, 2.0, 1.0])) >= 0


def _cal_file(tmp_path, **profile) -> str:
    prof = {"bw_efficiency": 0.01, "per_row_s": 1e-6, "per_launch_s": 2e-3, "access_bytes": 64, **profile}
    data = {"sku": "cpu",
            "spec": {"name": "CPU (calibrated)", "scale_up_bw_bytes_per_s": 1e9, "scale_up_latency_s": 5e-4,
                     "comms_efficiency": 1.0},
            "measurements": {"embedding": {"fbgemm": {"profile": prof}, "triton": {"skipped": "no"}},
                             "measured_fields": ["scale_up_bw_bytes_per_s", "scale_up_latency_s"]}}
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_calibration_file_changes_the_plan(tmp_path):
    lines: list[str] = []
    # no evaluation: anyrec-plan builds each split's synthetic source to count what it keeps on the device
    args = ["model=dlrm_small", "topology.world_size=2", "plan.batch_size=256", "trainer.eval_steps=0"]
    before = run(compose_config(args + ["hardware.sku=cpu"])[1], print_fn=lambda *_: None)
    after = run(compose_config(args + [f"hardware.sku={_cal_file(tmp_path)}"])[1], print_fn=lines.append)
    # 2 ms per launch, 1 us per row and 1% of DDR bandwidth: a much slower predicted step.
    assert after.predicted_step_s > before.predicted_step_s + 2e-3
    # The measured 2 ms launch cost is paid once per rank and step (a third in forward).
    assert after.base.perf.fwd_compute_s - before.base.perf.fwd_compute_s == pytest.approx(2e-3 / 3, rel=0.01)
    assert after.base.perf.bwd_comms_s > before.base.perf.bwd_comms_s  # 500 us per collective measured
    text = "\n".join(lines)
    assert "measured (" in text and "scale_up_latency_s" in text and "embedding fbgemm profile" in text


@pytest.mark.parametrize(("profile", "error"), [({"bw_efficiency": 3.0}, "bw_efficiency"),
                                                ({"per_row_s": -1}, "per_row_s"),
                                                ({"speed": 1}, "unknown field")])
def test_nonsense_calibration_is_a_one_line_error(tmp_path, profile, error):
    with pytest.raises(ValueError, match=error) as e:
        resolve_hardware(_cal_file(tmp_path, **profile))
    assert "\n" not in str(e.value) and "cal.yaml" in str(e.value)


def test_collectives_pay_a_latency_each():
    topo = Topology(get_sku("cpu"), 2, 2)
    alpha = get_sku("cpu").scale_up_latency_s
    assert alpha > 0
    assert estimators.all_to_all_time_s(0.0, topo) == pytest.approx(alpha)
    assert estimators.all_to_all_time_s(0.0, topo, latency=False) == 0.0
    assert estimators.all_reduce_time_s(0.0, topo) == pytest.approx(2 * alpha)  # reduce-scatter + gather
    bw = estimators.all_to_all_time_s(1e6, topo, latency=False)
    assert estimators.all_to_all_time_s(1e6, topo) == pytest.approx(alpha + bw)


def test_profile_rejects_a_launch_cost_out_of_range():
    with pytest.raises(ValueError, match="per_launch_s"):
        KernelProfile(0.5, per_launch_s=-1.0)


@pytest.mark.parametrize(("argv", "error"), [
    ([], "calibrate.output=FILE.yaml is required (or calibrate.cache=true)"),
    (["calibrate.cache=maybe"], "calibrate.cache: Value 'maybe' is not a valid bool"),
    (["calibrate.out=x.yaml"], "calibrate.out: Key 'out' not in 'CalibrationConfig'"),
    (["calibrate.output=x.yaml", "calibrate.size=huge"], "calibrate.size: Invalid value 'huge'"),
    (["calibrate.output=x.yaml", "calibrate.budget_s=0"], "calibrate.budget_s must be a positive number"),
    (["calibrate.output=x.yaml", "calibrate.time_limit_s=-1"], "calibrate.time_limit_s must be a positive")])
def test_bad_arguments(argv, error, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        calibrate.cli(argv)
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("anyrec.calibrate: error: ") and error in line
