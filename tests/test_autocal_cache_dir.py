"""An unusable ANYREC_CACHE_DIR (a file, an unwritable folder) is one line before anything is measured."""

from __future__ import annotations

import pytest

from anyrec.calibration.first_contact import check_cache_dir

from .conftest import ROOT

UNWRITABLE = "/sys"  # refuses new files even to root


def test_check_cache_dir(tmp_path, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for path, message in [(a_file, rf"ANYREC_CACHE_DIR .* {a_file} is a file, not a folder"),
                          (UNWRITABLE, r"cannot write in /sys .*nothing was measured")]:
        monkeypatch.setenv("ANYREC_CACHE_DIR", str(path))
        with pytest.raises(ValueError, match=message):
            check_cache_dir()
    monkeypatch.setenv("ANYREC_CACHE_DIR", str(tmp_path / "new" / "cache"))
    check_cache_dir()


def test_train_refuses_an_unusable_cache_before_measuring(tmp_path, train_here):
    """One unusable folder (a file) end to end; test_check_cache_dir covers each cause's line, which reaches
    the job the same way."""
    path = tmp_path / "a_file"
    path.write_text("x")
    env = {"ANYREC_CACHE_DIR": str(path), "ANYREC_CALIBRATE": "auto"}
    args = ["model=dlrm_tiny", "trainer.steps=2", "trainer.progress=false", "trainer.tensorboard=false",
            f"hydra.run.dir={tmp_path / 'run'}"]
    proc = train_here(args, ROOT, env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "ANYREC_CACHE_DIR" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "calibration:" not in proc.stdout + proc.stderr
