"""anyrec.calibrate on CPU: a hardware YAML with sane numbers that `hardware.sku=FILE` accepts."""

from __future__ import annotations

import pytest
import yaml

from anyrec import calibrate
from anyrec.backends import get_backend, load_hardware_file, resolve_hardware

from .conftest import torchrun


def _check_file(path, world_size: int) -> dict:
    data = yaml.safe_load(path.read_text())
    assert set(data) == {"spec", "measurements"}
    m = data["measurements"]
    assert m["copy_bw_bytes_per_s"] > 1e8  # any host copies more than 100 MB/s
    assert m["gemm_flops"]["fp32"] > 1e8 and m["gemm_flops"]["bf16"] > 1e7
    lookups = m["embedding_lookup_bw_bytes_per_s"]
    assert lookups["torch"]["fp32"] > 1e7 and lookups["fbgemm"]["fp32"] > 1e7
    assert "skipped" in lookups["triton"]  # measured by the kernel benchmarks, not here
    spec = resolve_hardware(str(path))
    assert spec.name.endswith("(calibrated)") and spec.vendor == get_backend("auto").device_spec().vendor
    assert spec.memory_bw_bytes_per_s == m["copy_bw_bytes_per_s"]
    assert spec.peak_fp32_flops == m["gemm_flops"]["fp32"]
    assert load_hardware_file(path).measurements["lookup_shape"]["dim"] == 64
    if world_size > 1:
        assert m["world_size"] == world_size
        assert m["all_to_all_bw_bytes_per_s"] > 1e6 and m["all_reduce_bw_bytes_per_s"] > 1e6
        assert spec.scale_up_bw_bytes_per_s == m["all_to_all_bw_bytes_per_s"]
    return m


def test_calibrate_writes_a_hardware_yaml(tmp_path, capsys):
    out = tmp_path / "sub" / "cal.yaml"
    assert calibrate.main([f"output={out}", "budget_s=0.05"]) == 0
    m = _check_file(out, world_size=1)
    table = capsys.readouterr().out
    assert "lookup fbgemm" in table and "gemm" in table
    assert f"wrote {out} in {m['seconds']:.1f} s" in table  # the time it reports is the one it stored
    assert not list(out.parent.glob(".*tmp*"))  # the atomic write left no temporary behind


@pytest.mark.cpu_only  # two ranks on one host: one device each only without an accelerator
def test_calibrate_under_torchrun_measures_collectives(tmp_path):
    out = tmp_path / "cal2.yaml"
    proc = torchrun(["-m", "anyrec.calibrate", f"output={out}", "budget_s=0.05"], nproc=2, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_file(out, world_size=2)
    assert proc.stdout.count("wrote ") == 1  # rank 0 only


@pytest.mark.parametrize(("argv", "error"), [([], "output=FILE.yaml is required"),
                                             (["out=x.yaml"], "unknown argument"),
                                             (["output=x.yaml", "size=huge"], "size=huge")])
def test_bad_arguments(argv, error, capsys):
    assert calibrate.main(argv) == 2
    assert error in capsys.readouterr().err
