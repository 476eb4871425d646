"""Output paths are checked before the work: every entry point fails in one line, having done nothing."""

from __future__ import annotations

import pytest

from anyrec import calibrate
from anyrec.data import preprocess
from anyrec.io_checks import atomic_write, writable_dir, writable_file
from anyrec.plan import run as plan_run

from .conftest import compose_config
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
    _, cfg = compose_config(["model=dlrm_tiny", "hardware=h100", bad])
    with pytest.raises(ValueError, match=f"{bad.split('=')[0]} must be >= 1"):
        plan_run(cfg, print_fn=lambda s: None)


def test_calibrate_fails_before_measuring(capsys):
    assert calibrate.main([f"output={UNWRITABLE}/cal.yaml", "budget_s=30"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anyrec.calibrate: error: output /sys/anyrec-test/cal.yaml")


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
