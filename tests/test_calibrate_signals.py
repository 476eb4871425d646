"""A calibration a scheduler can stop and a user can watch: SIGTERM, SIGINT and SIGHUP end
`anyrec.calibrate` and a training job's first-contact calibration within 5 s, wherever it is, with
nothing written and training's exit status; `calibrate.time_limit_s` bounds the whole run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from anyrec.backends import resolve_hardware

from .conftest import ROOT

STOP_S = 5.0  # the promise: a stopped calibration is gone this long after the signal


def _start(args: list[str], cwd: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "ANYREC_CACHE_DIR": str(cache)}
    return subprocess.Popen([sys.executable, "-m", *args], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)


def _stop_when(proc: subprocess.Popen, marker: str, sig: int) -> tuple[int, float, str]:
    """Send `sig` once `marker` shows on stderr (the progress bar names what it measures: no guessed
    sleep), then wait: (exit status, seconds from the signal to the exit, stderr)."""
    seen = b""
    try:
        while marker.encode() not in seen:
            chunk = os.read(proc.stderr.fileno(), 65536)
            assert chunk, f"ended before {marker!r}: {seen.decode(errors='replace')[-3000:]}"
            seen += chunk
        proc.send_signal(sig)
        sent = time.monotonic()
        rest = proc.stderr.read()
        code = proc.wait(timeout=60)
        return code, time.monotonic() - sent, (seen + rest).decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.integration
@pytest.mark.parametrize(("sig", "marker"), [
    (signal.SIGTERM, "step warm-up"),  # inside a step point's trainer, which catches signals itself
    (signal.SIGINT, "embedding torch"),  # between an embedding measurement's repetitions
    (signal.SIGHUP, "gemm bf16"),
], ids=["SIGTERM", "SIGINT", "SIGHUP"])
@pytest.mark.deadline
def test_a_signal_stops_the_calibration_with_nothing_written(tmp_path, sig, marker):
    out, cache = tmp_path / "cal.yaml", tmp_path / "cache"
    proc = _start(["anyrec.calibrate", f"calibrate.output={out}", "calibrate.cache=true"], tmp_path, cache)
    code, took_s, err = _stop_when(proc, marker, sig)
    assert code == 128 + sig, err[-3000:]  # as training stopped by the same signal exits
    assert took_s < STOP_S, err[-3000:]
    assert f"anyrec.calibrate: stopped by {signal.Signals(sig).name}: nothing written" in err
    assert not out.exists() and not list(tmp_path.glob(".*tmp*"))
    assert not cache.exists() or [p.name for p in cache.iterdir()] in ([], ["signing.key"])  # only the key
    assert "s left" in err  # the progress bar: what is measured, and the time left


@pytest.mark.deadline
@pytest.mark.integration
def test_first_contact_calibration_stops_on_sigterm(tmp_path):
    cache = tmp_path / "cache"
    proc = _start(["anyrec.train", "trainer.calibrate=auto", "trainer.steps=50", "trainer.eval_steps=0",
                   "trainer.checkpoint.dir=null",
                   f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, cache)
    code, took_s, err = _stop_when(proc, "step warm-up", signal.SIGTERM)
    assert code == 128 + signal.SIGTERM and took_s < STOP_S, err[-3000:]
    assert "anyrec-train: stopped by SIGTERM: nothing written" in err
    # no cache entry, whole or half (the per-user signing key, made at the start, aside)
    assert not cache.exists() or [p.name for p in cache.iterdir()] in ([], ["signing.key"])


@pytest.mark.deadline
@pytest.mark.integration
def test_the_time_limit_bounds_the_run_and_says_what_fell_back(tmp_path):
    out = tmp_path / "cal.yaml"
    limit_s = 1.0  # less than the command's start-up (torch alone imports in more): all of it spent there
    proc = subprocess.run([sys.executable, "-m", "anyrec.calibrate", f"calibrate.output={out}",
                           f"calibrate.time_limit_s={limit_s}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = yaml.safe_load(out.read_text())["measurements"]
    # The limit counts from the command's start: past it, a measurement started ends after one timed
    # call, no embedding point and no pass of the step points runs; the built-in figures are kept as they
    # are, and the file says what fell back.
    reasons = " ".join(m["trust"]["reasons"])
    assert "step" not in m and m["step_unused"]["passes"] == 0 and not m["step_unused"]["points"]
    assert "trainer step (time limit)" in reasons
    assert m["embedding"]["fbgemm"]["skipped"].startswith("0 of "), m["embedding"]
    assert not m["trust"]["trusted"]
    assert "figures not cached as trusted" in proc.stdout + proc.stderr  # said in one line
    spec = resolve_hardware(str(out)).spec  # a usable file: the built-in figures where none measured
    assert "step_fixed_s" not in m["measured_fields"]
    assert spec.peak_fp32_flops == m["gemm_flops"]["fp32"]
