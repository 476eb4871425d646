"""Calibration on first contact (anyrec.calibration.first_contact): a hardware=auto training job measures
this machine once, caches it, plans with it, and reuses it; a damaged cache file is named and measured
again."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from anyrec.backends.hardware_file import STEP_FIELDS
from anyrec.choices import Precision, Switch
from anyrec.config import AnyrecConfig, Calibrate
from anyrec.history import cache as calcache

from .conftest import compose_config, last_json_line, torchrun, trust_entry


def _lines(proc, text: str) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if text in line]


def _train(tmp_path, run: str, bind: str = "true", steps: int = 30, nproc: int = 2):
    env = {"ANYREC_CACHE_DIR": str(tmp_path / "cache"), "ANYREC_CALIBRATE": "auto"}
    args = ["-m", "anyrec.train", "model=dlrm_tiny", f"backend.bind_cores={bind}", f"trainer.steps={steps}",
            "trainer.eval_steps=0",
            # what is cached and reused, not the time limit (test_calibrate_signals): every phase measured
            # even on a loaded host
            "calibrate.time_limit_s=600",
            "trainer.progress=false", "trainer.tensorboard=false", f"hydra.run.dir={tmp_path / run}"]
    proc = torchrun(args, nproc=nproc, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _entry(tmp_path):
    (path,) = (tmp_path / "cache").glob("*.yaml")
    key = calcache.CacheKey.from_dict(yaml.safe_load(path.read_text())["cache"]["key"])
    return path, calcache.read_entry(path, key).hardware


@pytest.mark.integration
def test_first_contact_measures_caches_and_then_reuses(cold_default_job, tmp_path):
    # First contact: the run's one cold calibration, the default 2-rank job on an empty cache.
    (line,) = [ln for ln in cold_default_job.console.splitlines() if "calibration: cache" in ln]
    assert "cache miss, measured in" in line
    assert len([ln for ln in cold_default_job.console.splitlines() if "trusted" in ln]) == 1  # said once
    (measured,) = cold_default_job.cache.glob("calibration-*.yaml")
    assert str(measured) in line and key_world(measured) == 2
    assert last_json_line(cold_default_job.console)["predicted_step_ms"] > 0
    # Cut short: named in one warning line, measured again (threads bound), replaced by a whole file.
    cache = cold_default_job.calibrated_cache(tmp_path / "cache")
    path = cache / measured.name
    path.write_text(path.read_text()[:2000])
    first = _train(tmp_path, "a")
    (warning,) = _lines(first, "measuring again")
    assert str(path) in warning
    (line,) = _lines(first, "calibration: cache miss")
    assert "measured in" in line and "with threads bound" in line and str(path) in line
    assert len(_lines(first, "trusted")) == 1  # trusted or not, said in one line
    assert _step_costs(_entry(tmp_path)[1], path) > 0 and key_world(path) == 2
    trust_entry(path)  # a busy host's entry is measured again once the host is quiet (test_autocal_trust)
    stamp = path.stat().st_mtime_ns
    # Free threads (as backend.bind_cores=auto leaves them on a loaded host): the same entry, and the
    # line says the binding differs from the calibration's.
    second = _train(tmp_path, "b", bind="false")
    (line,) = _lines(second, "calibration: cache")
    assert f"cache hit, planning with {path}" in line and path.stat().st_mtime_ns == stamp
    assert "measured with threads bound, this run's are free" in line


@pytest.mark.integration
def test_two_jobs_started_together_on_an_empty_cache(tmp_path):
    """Two real jobs (one rank each) calibrate at once on a cold cache: both finish and plan, and the
    cache holds exactly one whole, valid entry (each write is a rename; the last one stays)."""
    with ThreadPoolExecutor(2) as pool:  # each torchrun in its own session, killed whole on a timeout
        procs = list(pool.map(lambda run: _train(tmp_path, run, steps=5, nproc=1), ("a", "b")))
    for proc in procs:
        (line,) = _lines(proc, "calibration: cache")
        assert "cache " in line and last_json_line(proc.stdout)["predicted_step_ms"] > 0
    path, hardware = _entry(tmp_path)
    # no temporary left (beside the entry: the two runs' measured steps, anyrec.history.steplearn,
    # and the per-user signing key)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [path.name, "observed-steps.json", "observed-steps.lock", "signing.key"])
    assert key_world(path) == 1 and _step_costs(hardware, path) > 0


def _step_costs(hardware, path) -> float:
    """The trainer's framework costs the calibration fitted (which terms it picks varies; a poor fit on a
    busy host too: the job that measured it uses it)."""
    m = yaml.safe_load(path.read_text())["measurements"]
    assert "step" in m, "the step figures were not measured"
    return sum(getattr(hardware.spec, f) for f in STEP_FIELDS)


def key_world(path) -> int:
    return yaml.safe_load(path.read_text())["cache"]["key"]["local_world_size"]


def test_which_jobs_calibrate():
    from anyrec.calibration.first_contact import wants_calibration

    def cfg(*overrides: str) -> AnyrecConfig:
        return compose_config(["trainer.calibrate=auto", *overrides])[1]

    assert wants_calibration(cfg())
    assert cfg().trainer.calibrate == Calibrate.auto
    assert not wants_calibration(cfg("hardware=h200"))
    assert not wants_calibration(cfg("hardware.sku=/some/cal.yaml"))
    assert not wants_calibration(cfg("planner=simple"))
    assert not wants_calibration(cfg("trainer.calibrate=never"))
    assert wants_calibration(cfg("trainer.calibrate=always"))


class _Measured(Exception):
    """Raised by a stand-in measurement once it has seen what it needed."""


def test_the_quick_calibration_logs_its_points_to_the_file_only(tmp_path, monkeypatch):
    """The first-contact calibration measures inside the training job: its points' INFO goes to the log
    file only (console.log_file_only), the job's own INFO to the console as ever."""
    from anyrec import console
    from anyrec.calibration import first_contact
    from anyrec.runtime.distributed import destroy_distributed, start_runtime

    monkeypatch.setenv(calcache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    point = logging.LogRecord("anyrec.calibration.measure", logging.INFO, __file__, 1, "point 1", None, None)
    shown = []

    def measure(runtime, size, budget_s, run):
        shown.append(console.ConsoleFilter().filter(point))
        raise _Measured

    monkeypatch.setattr(first_contact, "calibrate", measure)
    cfg = compose_config(["trainer.calibrate=always", "trainer.progress=false"])[1]
    runtime = start_runtime("cpu", bind_cores=Switch.false)
    try:
        with pytest.raises(_Measured):
            first_contact.calibrated_hardware(cfg, runtime, Precision.fp32)
    finally:
        destroy_distributed(barrier=False)
    assert shown == [False] and console.ConsoleFilter().filter(point)
