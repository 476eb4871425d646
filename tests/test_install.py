"""A non-editable `pip install .` ships the config groups and works from any directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.integration  # every test here starts processes


def test_wheel_ships_configs_and_composes_elsewhere(tmp_path):
    # Build from a copy: an in-place build would leave build/ and *.egg-info in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md", "requirements", "anyrec", "configs"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                          if (ROOT / name).is_dir() else {}))
    target = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    assert (target / "anyrec" / "configs" / "config.yaml").is_file()
    assert (target / "anyrec" / "configs" / "model" / "dlrm_small.yaml").is_file()
    code = (
        "import anyrec, anyrec.config as c;"
        "from hydra import compose, initialize_config_dir;"
        "from anyrec import _hydra; _hydra.setup();"
        "ctx = initialize_config_dir(str(c.config_dir()), version_base='1.3'); ctx.__enter__();"
        "cfg = _hydra.to_object(compose('config', overrides=['model=dlrm_tiny']));"
        "print(anyrec.__file__); print(c.config_dir()); print(cfg.model.name)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    file_, cfg_dir, name = run.stdout.split()[-3:]
    assert file_.startswith(str(target)) and cfg_dir.startswith(str(target)) and name == "dlrm_tiny"
