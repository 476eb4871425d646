"""resolve_hardware: `auto`, a SKU name or a hardware YAML (base SKU + overrides, or complete), to one
Hardware value (spec + measured profiles)."""

from __future__ import annotations

import pytest

from anyrec._hydra import cli_problem
from anyrec.backends import get_backend, load_hardware_file, resolve_hardware
from anyrec.backends.interface import DeviceFacts
from anyrec.backends.specs import SKUS

from .conftest import compose_config


@pytest.mark.parametrize("sku", sorted(SKUS))
def test_every_sku_option_resolves_to_its_capacity(sku):
    _, cfg = compose_config([f"hardware={sku}"])
    hardware = resolve_hardware(cfg.hardware.sku, cfg.hardware.spec, measurements=cfg.hardware.measurements)
    spec = hardware.spec
    assert hardware.profiles == {} and not hardware.measured_by
    assert spec == SKUS[sku] and spec.memory_bytes > 0


def test_auto_asks_the_backend():
    mi300x = DeviceFacts(cuda_available=True, hip_version="6.4", device_count=8,
                         device_name="AMD Instinct MI300X", arch="gfx942", memory_bytes=192 * 2**30)
    assert resolve_hardware("auto", backend=get_backend("auto", facts=mi300x)).spec.name == "MI300X"


@pytest.mark.cpu_only
def test_auto_on_a_cpu_host_is_the_cpu():
    assert resolve_hardware("auto", backend=get_backend("auto")).spec.vendor == "cpu"
    with pytest.raises(ValueError, match="needs the backend"):
        resolve_hardware("auto")


def test_overrides_and_their_errors():
    spec = resolve_hardware("MI350X", {"memory_bytes": "1.5e11", "memory_bw_bytes_per_s": 7e12}).spec
    assert spec.memory_bytes == 150_000_000_000 and spec.memory_bw_bytes_per_s == 7e12
    with pytest.raises(ValueError, match="unknown DeviceSpec field.*hbm_gb"):
        resolve_hardware("h200", {"hbm_gb": 1})
    with pytest.raises(ValueError, match="expected a number"):
        resolve_hardware("h200", {"memory_bytes": "lots"})
    with pytest.raises(ValueError, match="unknown hardware 'tpu-v9'"):
        resolve_hardware("tpu-v9")


def test_yaml_with_base_sku_and_measurements(tmp_path):
    f = tmp_path / "h200_cal.yaml"
    f.write_text("sku: h200\nspec:\n  memory_bw_bytes_per_s: 4.18e12\n  name: H200 (calibrated)\n"
                 "measurements:\n  copy_bw_bytes_per_s: 4.18e12\n"
                 "  measured_fields: [memory_bw_bytes_per_s]\n")
    hardware = resolve_hardware(str(f), {"h2d_bw_bytes_per_s": 5.5e10})
    spec = hardware.spec
    assert spec.name == "H200 (calibrated)" and spec.memory_bw_bytes_per_s == 4.18e12
    assert spec.memory_bytes == SKUS["h200"].memory_bytes and spec.h2d_bw_bytes_per_s == 5.5e10
    assert hardware.measured_fields == ("memory_bw_bytes_per_s",) and hardware.measured_by == str(f)
    assert load_hardware_file(f) == resolve_hardware(str(f))


@pytest.mark.parametrize(
    ("text", "error"),
    [("spec:\n  name: X\n", "lacks vendor"),
     ("sku: h200\nbogus: 1\n", "unknown key"),
     ("sku: h200\nbase: h100\n", "base SKU once"),
     ("sku: h200\nspec:\n  hbm: 1\n", "unknown DeviceSpec field"),
     ("sku: other.yaml\n", "must be a SKU name"),
     ("- a\n- b\n", "expected a mapping"),
     ("sku: [\n", "not valid YAML"),
     # a 572-byte alias bomb used to hang, 100,000 brackets to end in a RecursionError traceback
     ("a: &a [" + ",".join(['"lol"'] * 9) + "]\n" + "".join(
         f"{c}: &{c} [{','.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)),
      "expands to more than"),
     ("spec: " + "[" * 100_000 + "]" * 100_000 + "\n", "nests deeper than 64"),
     ("sku: h200\n# " + "x" * (2 * 2**20) + "\n", "larger than 1048576 bytes")],
    ids=["incomplete", "unknown-key", "two-bases", "unknown-field", "file-base", "list", "syntax",
         "alias-bomb", "deep", "oversize"],
)
def test_bad_yaml_fails_in_one_line(tmp_path, text, error):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=error) as e:
        resolve_hardware(str(f))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_hardware(str(tmp_path / "missing.yaml"))


def test_hydra_spelling_for_a_file(tmp_path):
    f = tmp_path / "cal.yaml"
    f.write_text("sku: cpu\nspec:\n  memory_bw_bytes_per_s: 1.0e10\n")
    _, cfg = compose_config([f"hardware.sku={f}"])
    assert resolve_hardware(cfg.hardware.sku, cfg.hardware.spec).spec.memory_bw_bytes_per_s == 1e10


@pytest.mark.parametrize("value", ["/abs/cal.yaml", "cal.yaml", "cal.json", "results/cal"])
def test_a_file_as_the_hardware_group_option_is_refused_naming_hardware_sku(value):
    """`hardware.sku=FILE` is the one way to name a file: `hardware=FILE` fails at compose time."""
    assert cli_problem(["model=dlrm_tiny", f"hardware={value}"]) == (
        f"hardware={value}: a hardware file is named with hardware.sku={value} (hardware= takes a group "
        "option: auto, a SKU name, or a YAML's name on hydra.searchpath)")
    assert cli_problem(["model=dlrm_tiny", "hardware=h200"]) is None


def test_a_file_as_the_hardware_group_option_exits_2_with_one_line(tmp_path, run_here):
    f = tmp_path / "cal.yaml"
    f.write_text("sku: cpu\n")
    proc = run_here("plan", [f"hardware={f}"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"anyrec-plan: error: {cli_problem([f'hardware={f}'])}"]
    assert not (tmp_path / "outputs").exists()


def test_flat_json_with_base_is_accepted(tmp_path):
    f = tmp_path / "cal.json"
    f.write_text('{"base": "mi300x", "memory_bw_bytes_per_s": 4.9e12}')
    spec = resolve_hardware(str(f)).spec
    assert spec.name == "MI300X" and spec.memory_bw_bytes_per_s == 4.9e12


@pytest.mark.parametrize(("override", "message"), [
    ({"simd_width": 0}, "simd_width must be a finite number > 0, got 0"),
    ({"memory_bw_bytes_per_s": float("nan")}, "memory_bw_bytes_per_s must be a finite number > 0, got nan"),
    ({"scale_up_bw_bytes_per_s": "inf"}, "scale_up_bw_bytes_per_s must be a finite number > 0, got inf"),
    ({"simd_width": "inf"}, "simd_width must be a finite number > 0, got inf"),
])
def test_spec_numbers_must_be_finite_and_positive(override, message):
    with pytest.raises(ValueError, match=message):
        resolve_hardware("h200", override)
    assert resolve_hardware("h200", {"h2d_bw_bytes_per_s": 0}).spec.h2d_bw_bytes_per_s == 0  # 0 = unknown


def test_a_hardware_file_with_nan_fails_in_one_line(tmp_path):
    f = tmp_path / "cal.yaml"
    f.write_text("sku: h200\nspec:\n  memory_bw_bytes_per_s: .nan\n")
    with pytest.raises(ValueError, match=f"hardware file {f}: memory_bw_bytes_per_s must be a finite"):
        resolve_hardware(str(f))


def test_measurements_travel_in_the_value_not_a_registry(tmp_path):
    """Two calibrations of one SKU resolved in one process: each value costs with its own profile, and
    the Impl records stay as built (nothing is registered)."""
    from anyrec.backends.dispatch import FBGEMM_EMBEDDING, get_impl

    def cal(name: str, eff: float):
        f = tmp_path / f"{name}.yaml"
        f.write_text(f"sku: cpu\nmeasurements:\n  embedding:\n    fbgemm:\n      profile:\n"
                     f"        bw_efficiency: {eff}\n        access_bytes: 32\n        per_row_s: 0.0\n"
                     f"        per_launch_s: 0.0\n  measured_fields: []\n")
        return resolve_hardware(str(f))

    a, b = cal("a", 0.5), cal("b", 0.01)
    assert a.embedding_cost(FBGEMM_EMBEDDING).profile.bw_efficiency == 0.5
    assert b.embedding_cost(FBGEMM_EMBEDDING).profile.bw_efficiency == 0.01
    assert get_impl("embedding", "fbgemm") is FBGEMM_EMBEDDING
    # The group-option spelling: the same measurements in the config's `hardware.measurements`.
    profile = {"bw_efficiency": 0.01, "access_bytes": 32, "per_row_s": 0.0, "per_launch_s": 0.0}
    measured = {"embedding": {"fbgemm": {"profile": profile}}, "measured_fields": []}
    group = resolve_hardware("cpu", measurements=measured)
    assert group.embedding_cost(FBGEMM_EMBEDDING).profile == b.embedding_cost(FBGEMM_EMBEDDING).profile
    assert group.measured_by == "hardware.measurements"
