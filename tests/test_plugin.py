"""An out-of-tree backend: pip-install tests/plugin_pkg into a temporary target and train through it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import ROOT, last_json_line, pip_install_target, single_process_env

PKG = ROOT / "tests" / "plugin_pkg"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """The fake accelerator installed with pip into a fresh target directory (not the venv)."""
    return pip_install_target(PKG, tmp_path_factory.mktemp("plugin"))


def test_plugin_is_discovered_detected_and_resolves_its_hardware(plugin_path, monkeypatch):
    import anyrec.backends as backends

    monkeypatch.syspath_prepend(str(plugin_path))
    monkeypatch.setattr(backends, "_registry", None)  # discovered again, with the plugin on sys.path
    monkeypatch.setattr(backends, "_plugin_errors", {})
    assert list(backends.registry()) == ["fakeaccel", "rocm", "cuda", "cpu"]
    b = backends.get_backend("auto")  # a plugin is probed before the CPU: its device is "present"
    assert b.name == "fakeaccel" and b.dist_backend == "gloo"
    assert backends.resolve_hardware("auto", backend=b).spec.name == "FakeAccel-1"
    assert b.select_kernels()["embedding"].name == "fbgemm"


@pytest.mark.integration
def test_train_one_process_through_the_plugin(plugin_path, tmp_path):
    env = single_process_env(plugin_path)
    proc = subprocess.run(
        [sys.executable, "-m", "anyrec.train", "backend.name=fakeaccel", "model=dlrm_tiny",
         "trainer.steps=2", "trainer.eval_steps=0", "trainer.progress=false", f"hydra.run.dir={tmp_path}/r"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert summary["backend"] == "fakeaccel" and summary["steps"] == 2
    assert summary["embedding_kernel"] == "fbgemm"
    log = (tmp_path / "r" / "train_rank0.log").read_text()
    assert "backend: fakeaccel" in log and "op embedding -> fbgemm" in log


def test_unknown_backend_name_fails_clearly():
    import anyrec.backends as backends

    with pytest.raises(ValueError, match="unknown backend 'nosuchaccel'; choose one of auto, .*cpu"):
        backends.get_backend("nosuchaccel")
