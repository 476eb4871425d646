"""Output paths are checked before the work: every entry point fails in one line, having done nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from anyrec import calibrate
from anyrec.data import preprocess
from anyrec.io_checks import atomic_write, writable_dir, writable_file
from anyrec.plan import run as plan_run

from .conftest import ROOT, TORCHRUN_VARS, compose_config
from .test_data import write_tsv

# /sys refuses new files even to root, so the check bites whoever runs the tests.
UNWRITABLE = "/sys/anyrec-test"


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    return f


def test_paths(tmp_path, a_file):
    writable_dir(tmp_path / "new" / "deeper", "d")  # missing folders are fine (created later)
    writable_file(tmp_path / "new" / "x.json", "f")
    writable_dir(None, "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # the checks left nothing
    for check, path, message in [
        (writable_dir, a_file, "is a file, not a folder"),
        (writable_dir, a_file / "sub", f"{a_file} is a file, not a folder"),
        (writable_file, tmp_path, "is a folder, not a file"),
        (writable_file, a_file / "x.json", f"{a_file} is a file, not a folder"),
        (writable_dir, UNWRITABLE, "cannot write in /sys"),
        (writable_file, f"{UNWRITABLE}/x.json", "cannot write in /sys"),
    ]:
        with pytest.raises(ValueError, match=message):
            check(path, "what")


@pytest.mark.parametrize("key", ["plan.output", "plan.plot"])
def test_plan_fails_before_planning(tmp_path, key):
    _, cfg = compose_config(["model=dlrm_tiny", "hardware=h100", f"{key}={tmp_path}"])
    printed = []
    with pytest.raises(ValueError, match=f"{key} {tmp_path} is a folder, not a file"):
        plan_run(cfg, print_fn=printed.append)
    assert printed == []  # no report: nothing was planned


@pytest.mark.parametrize("bad", ["topology.local_world_size=0", "plan.batch_size=0"])
def test_plan_refuses_zero_counts(bad):
    with pytest.raises(ValueError, match=f"{bad.split('=')[0]} must be >= 1"):
        compose_config(["model=dlrm_tiny", "hardware=h100", bad])  # the typed config refuses it


def test_calibrate_fails_before_measuring(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Hydra's run folder
    with pytest.raises(SystemExit) as e:
        calibrate.cli([f"calibrate.output={UNWRITABLE}/cal.yaml", "calibrate.budget_s=30"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "anyrec.calibrate: error: calibrate.output /sys/anyrec-test/cal.yaml")


def test_preprocess_fails_before_converting(tmp_path, a_file, capsys):
    write_tsv(tmp_path / "day_0", 16)
    assert preprocess.main([str(tmp_path / "day_0"), "--out-dir", str(a_file)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no file converted
    assert captured.err.strip() == f"anyrec-preprocess: error: --out-dir {a_file} is a file, not a folder"


def test_atomic_write_replaces_whole_or_leaves_the_old_file(tmp_path):
    target = tmp_path / "sub" / "out.json"
    with atomic_write(target) as f:
        f.write("first")
    assert target.read_text() == "first"
    with pytest.raises(RuntimeError), atomic_write(target) as f:
        f.write("half of the second")
        raise RuntimeError("cut short")
    assert target.read_text() == "first"  # the failed write left the old file as it was
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.json"]  # and no temp file behind
    with atomic_write(target, "wb") as f:
        f.write(b"\x00bytes")
    assert target.read_bytes() == b"\x00bytes"


def _entry(module: str, args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for var in TORCHRUN_VARS:
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.integration
@pytest.mark.parametrize(("module", "prog"), [("anyrec.train", "anyrec-train"),
                                              ("anyrec.plan", "anyrec-plan")])
def test_a_missing_mandatory_value_is_one_line(tmp_path, module, prog):
    proc = _entry(module, ["model=dlrm_tiny", "model.name=???"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"{prog}: error: model.name: a value is required; set it on the command line, e.g. model.name=..."]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.integration
@pytest.mark.parametrize("where", ["read-only", "file"])
def test_an_unwritable_working_directory_is_one_line(tmp_path, where):
    if where == "read-only":  # /sys: read-only even to root
        cwd, cause = Path("/sys"), "cannot write in /sys"
    else:  # a file where Hydra's outputs/ folder would go
        cwd, cause = tmp_path, f"{tmp_path}/outputs is a file, not a folder"
        (tmp_path / "outputs").write_text("x")
    proc = _entry("anyrec.train", ["model=dlrm_tiny", "trainer.steps=1"], cwd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("anyrec-train: error: hydra.run.dir: Hydra's output folder ")
    assert cause in lines[0] and lines[0].endswith(
        "run from a writable folder or set hydra.run.dir=<a writable folder>"), lines
