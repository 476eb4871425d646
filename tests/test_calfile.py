"""Hardware / calibration files are checked whole before use (anyrec.backends.hardware_file)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from anyrec.backends import get_backend, load_hardware_file, resolve_hardware
from anyrec.backends.dispatch import KernelProfile
from anyrec.backends.hardware import check_spec
from anyrec.backends.hardware_file import PLAUSIBLE, SPEC_FIELDS
from anyrec.backends.specs import SKUS, get_sku

from .conftest import ROOT

CAL = Path(__file__).parent / "data" / "calibration_cpu_2rank.yaml"  # what anyrec.calibrate writes


def _write(tmp_path, data) -> Path:
    f = tmp_path / "cal.yaml"
    f.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return f


def _refused(path: Path, match: str) -> str:
    with pytest.raises(ValueError, match=match) as e:
        load_hardware_file(path)
    assert "\n" not in str(e.value) and path.name in str(e.value)
    return str(e.value)


def test_the_whole_calibration_file_loads():
    hw = load_hardware_file(CAL)
    assert "step_fixed_s" in hw.measured_fields and hw.spec.step_fixed_s > 0
    assert hw.profiles["fbgemm"].per_row_s > 0


@pytest.mark.integration
def test_every_truncation_of_a_calibration_file_is_refused(tmp_path):
    """Cut after any line (a disk full, a killed writer without the atomic rename), the file lacks a
    field it claims to have measured, or its spec: never a plan with the base SKU's figures."""
    lines = CAL.read_text().splitlines(keepends=True)
    body = [i for i, line in enumerate(lines) if not line.startswith("#")]
    accepted = []
    for cut in body[:-1]:
        f = _write(tmp_path, "".join(lines[:cut + 1]))
        try:
            load_hardware_file(f)
            accepted.append(cut + 1)
        except ValueError as e:
            assert "\n" not in str(e)
    assert accepted == [], f"truncated after line(s) {accepted[:10]} accepted"
    assert len(body) > 300


@pytest.mark.parametrize("field", ["step_fixed_s", "memory_bw_bytes_per_s", "scale_up_latency_s"])
def test_a_deleted_measured_field_is_refused(tmp_path, field):
    data = yaml.safe_load(CAL.read_text())
    del data["spec"][field]
    _refused(_write(tmp_path, data), f"claims to have measured {field}")


def test_measurements_without_measured_fields_are_refused(tmp_path):
    data = yaml.safe_load(CAL.read_text())
    del data["measurements"]["measured_fields"]
    _refused(_write(tmp_path, data), "lacks measurements.measured_fields")


@pytest.mark.parametrize(("where", "value", "match"), [
    (("measurements", "embedding", "fbgemm", "profile", "per_row_s"), float("nan"),
     "embedding.fbgemm.profile.per_row_s is not a finite number"),
    (("spec", "peak_fp32_flops"), float("inf"), "peak_fp32_flops must be a finite number > 0, got inf"),
    (("measurements", "collectives", "all_to_all", "seconds", 1), float("nan"), "all_to_all.seconds.1"),
    (("spec", "memory_bw_bytes_per_s"), 0, "memory_bw_bytes_per_s must be a finite number > 0"),
    (("spec", "step_per_id_s"), -1e-6, "step_per_id_s must be a finite number >= 0"),
])
def test_a_number_that_cannot_be_right_is_refused(tmp_path, where, value, match):
    data = yaml.safe_load(CAL.read_text())
    node = data
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    _refused(_write(tmp_path, data), match)


def test_a_nan_written_as_yaml_is_refused(tmp_path):
    text = CAL.read_text()
    assert "  step_per_id_s: " in text
    lines = [("  step_per_id_s: .nan" if line.startswith("  step_per_id_s: ") else line)
             for line in text.splitlines()]
    _refused(_write(tmp_path, "\n".join(lines) + "\n"), "step_per_id_s must be a finite number >= 0, got nan")


@pytest.mark.parametrize("missing", ["per_launch_s", "bw_efficiency"])
def test_a_profile_lacking_a_figure_is_refused(tmp_path, missing):
    data = yaml.safe_load(CAL.read_text())
    del data["measurements"]["embedding"]["fbgemm"]["profile"][missing]
    _refused(_write(tmp_path, data), f"fbgemm.profile lacks {missing}")


def test_a_measured_section_without_its_fields_is_refused(tmp_path):
    data = yaml.safe_load(CAL.read_text())
    data["measurements"]["measured_fields"].remove("sharding_group_s")
    del data["spec"]["sharding_group_s"]
    _refused(_write(tmp_path, data), "measured step but measured_fields lacks sharding_group_s")


def test_a_spec_only_file_needs_no_measurements(tmp_path):
    f = _write(tmp_path, {"sku": "cpu", "spec": {"memory_bw_bytes_per_s": 2e10}})
    assert load_hardware_file(f).spec.memory_bw_bytes_per_s == 2e10


def test_kernel_profile_refuses_nan():
    with pytest.raises(ValueError, match="per_row_s"):
        KernelProfile(0.5, per_row_s=float("nan"))


OLD_LAYOUT = Path(__file__).parents[1] / "benchmarks" / "results" / "2026-12-01_cpu-2core" / \
    "calibration_cpu_2ranks.yaml"  # the older layout: spec first, measurements after it


def test_an_old_layout_file_cut_in_its_spec_is_refused(tmp_path):
    """Cut at byte 1500 it used to plan with defaults for the lost figures (1.4 ms predicted, not 7.9)."""
    assert OLD_LAYOUT.read_text().index("spec:") < OLD_LAYOUT.read_text().index("measurements:")
    text = OLD_LAYOUT.read_text()
    cut = text[:text.rindex("\n", 0, 1500) + 1]  # the last whole line before byte 1500: valid YAML
    _refused(_write(tmp_path, cut), "calibrate again")
    spec_only = text[:text.index("measurements:")]
    assert "calibrate again" in _refused(_write(tmp_path, spec_only), "has no `measurements`")


def test_a_whole_old_layout_file_still_loads():
    hw = load_hardware_file(OLD_LAYOUT)
    assert hw.spec.step_fixed_s > 0 and "replicated_table_s" in hw.measured_fields


@pytest.mark.integration
def test_every_truncation_of_an_old_layout_file_is_refused_or_loses_nothing(tmp_path):
    whole = load_hardware_file(OLD_LAYOUT)
    lines = OLD_LAYOUT.read_text().splitlines(keepends=True)
    changed = []
    for cut in range(len(lines)):
        f = _write(tmp_path, "".join(lines[:cut + 1]))
        try:
            hw = load_hardware_file(f)
        except ValueError as e:
            assert "\n" not in str(e)
            continue
        if (hw.spec, hw.profiles, hw.measured_fields) != (whole.spec, whole.profiles, whole.measured_fields):
            changed.append(cut + 1)
    assert changed == [], f"truncated after line(s) {changed[:10]} accepted with other figures"


def test_a_spec_without_a_base_names_the_figures_it_lacks(tmp_path):
    data = yaml.safe_load(CAL.read_text())
    del data["measurements"]
    data["spec"]["source"] = "a datasheet"  # written by hand, not by anyrec.calibrate
    assert load_hardware_file(_write(tmp_path, data)).spec.replicated_table_s > 0
    del data["spec"]["replicated_table_s"]  # a default exists, but without a base nothing may default
    _refused(_write(tmp_path, data), "spec lacks replicated_table_s")
    data["sku"] = "cpu"
    base = get_sku("cpu").replicated_table_s
    assert load_hardware_file(_write(tmp_path, data)).spec.replicated_table_s == base  # the base's


def test_figures_taken_from_the_base_sku_are_logged(tmp_path, caplog):
    f = _write(tmp_path, {"sku": "h200", "spec": {"memory_bw_bytes_per_s": 4.0e12}})
    with caplog.at_level("INFO", logger="anyrec.backends.hardware"):
        load_hardware_file(f)
    lines = [r.getMessage() for r in caplog.records if r.name == "anyrec.backends.hardware"]
    assert len(lines) == 1 and "from the base h200" in lines[0] and "peak_bf16_flops" in lines[0]
    assert "memory_bw_bytes_per_s" not in lines[0].replace("host_memory_bw_bytes_per_s", "")


@pytest.mark.parametrize(("where", "value", "message"), [
    (("spec", "memory_bw_bytes_per_s"), 1e-300,
     "memory_bw_bytes_per_s = 1e-300 is implausible: expected 1e+06 to 1e+14 bytes/s"),
    (("spec", "peak_fp32_flops"), 1e300,
     "peak_fp32_flops = 1e+300 is implausible: expected 1e+06 to 1e+17 FLOP/s"),
    (("spec", "peak_bf16_flops"), 1e300, "peak_bf16_flops = 1e+300 is implausible"),
    (("spec", "memory_bytes"), 10**20, "memory_bytes = 1e+20 is implausible: expected 1e+06 to 1e+15 bytes"),
    (("spec", "scale_up_bw_bytes_per_s"), 1e-300, "scale_up_bw_bytes_per_s = 1e-300 is implausible"),
    (("spec", "scale_up_latency_s"), 3600.0,
     "scale_up_latency_s = 3600 is implausible: expected 1e-09 to 1 s (or 0: unknown)"),
    (("spec", "dense_efficiency"), 1e-300, "dense_efficiency = 1e-300 is implausible: expected 0.0001 to 1"),
    (("spec", "step_fixed_s"), 7000.0, "step_fixed_s = 7000 is implausible: expected 0 to 60 s"),
    (("spec", "simd_width"), 10**6, "simd_width = 1e+06 is implausible: expected 1 to 1024"),
    (("measurements", "embedding", "fbgemm", "profile", "per_row_s"), 5.0,
     "measurements.embedding.fbgemm.profile.per_row_s = 5 is implausible: expected 0 to 1 s"),
    (("measurements", "embedding", "torch", "profile", "bw_efficiency"), 1e-300,
     "measurements.embedding.torch.profile.bw_efficiency = 1e-300 is implausible"),
])
def test_an_implausible_figure_is_one_line_naming_it(tmp_path, where, value, message):
    data = yaml.safe_load(CAL.read_text())
    node = data
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    _refused(_write(tmp_path, data), re.escape(message))


def test_an_implausible_subgroup_link_is_refused(tmp_path):
    fit = {"sizes_bytes": [1024], "seconds": [1e-4], "latency_s": 1e-4, "bus_bw_bytes_per_s": 1e-300}
    data = {"sku": "h100", "spec": {"memory_bw_bytes_per_s": 1e11},
            "measurements": {"measured_fields": ["memory_bw_bytes_per_s"], "collectives_subgroups": {
                2: {"world_size": 4, "replicas": 2, "all_to_all": fit, "all_reduce_replicas": fit}}}}
    _refused(_write(tmp_path, data), re.escape(
        "collectives_subgroups.2.all_to_all.bus_bw_bytes_per_s = 1e-300 is implausible"))


def test_an_implausible_override_is_refused():
    with pytest.raises(ValueError, match=re.escape("hardware.spec: peak_fp32_flops = 1e+300 is implausible")):
        resolve_hardware("h100", {"peak_fp32_flops": 1e300})


def test_every_device_figure_has_a_plausible_range():
    numeric = {name for name, f in SPEC_FIELDS.items() if f.type in ("int", "float")}
    assert len(numeric) > 20 and set(PLAUSIBLE) == numeric


def test_shipped_figures_and_real_calibrations_are_plausible():
    for name, spec in SKUS.items():
        check_spec(spec, name)
    check_spec(get_backend("cpu").device_spec(), "this host")
    files = [CAL, *sorted((ROOT / "benchmarks" / "results").glob("*/*.yaml"))]
    assert len(files) > 3
    for path in files:
        assert load_hardware_file(path).spec.memory_bw_bytes_per_s > 0
