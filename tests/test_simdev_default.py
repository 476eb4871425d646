"""The default path on a device that is neither cpu nor cuda, and the CPU's with that device installed:
docs/porting.md's checklist and simdev default-path block run as written (simdev for `xpu`), the simdev
jobs each with an empty calibration cache, so they calibrate on first contact and plan with the co-design
planner; the CPU jobs with the cache the run's one cold calibration filled."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from .conftest import ROOT, last_json_line
from .test_simdev import _sh

pytestmark = pytest.mark.integration

DOC = ROOT / "docs" / "porting.md"
CHECKLIST_UNIT = """
from anyrec.backends import DeviceFacts
from anyrec_simdev.backend import SimdevBackend
facts = DeviceFacts(device_count=1, device_name="simdev (simulated)", arch="sim1", memory_bytes=1 << 30)
assert SimdevBackend.matches(facts) and not SimdevBackend.auto_detect
assert not SimdevBackend.matches(DeviceFacts(device_count=8, device_name="NVIDIA H200", arch="sm_90"))
spec = SimdevBackend(facts).device_spec()
assert spec.name == "SimDev-1" and spec.memory_bytes == 32 << 30 and spec.simd_width == 32
print("unit ok")
"""


def doc_block(marker: str) -> list[str]:
    """The commands of the bash block after `<!-- marker -->` in docs/porting.md, one a line."""
    block = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)```", DOC.read_text(), re.S)
    assert block, f"docs/porting.md lost its {marker} block"
    return [ln.strip() for ln in block.group(1).splitlines() if ln.strip() and not ln.startswith("#")]


def _measurements(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["measurements"]


def _run(cmd: str, cwd: Path, path: Path, cache: Path, timeout: float = 900):
    """`cmd` in a user's environment: calibration on first contact left at its default (the tests' own
    jobs turn it off), into the cache directory `cache`."""
    proc = _sh(f"env -u ANYREC_CALIBRATE ANYREC_CACHE_DIR={cache} {cmd}", cwd, path, timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_the_porting_checklist_runs_as_written_on_simdev(simdev_site, tmp_path):
    cmds = doc_block("porting-checklist")
    assert cmds[0] == "pip install -e anyrec-xpu"  # done by the fixture, into a target directory
    registry, train, calibrate, planned = (_run(c.replace("xpu", "simdev"), tmp_path, simdev_site,
                                                tmp_path / "cache") for c in cmds[1:])
    assert registry.stdout.strip().splitlines()[-1].startswith("['simdev', ")
    summary = last_json_line(train.stdout)
    assert summary["backend"] == "simdev" and summary["steps"] == 2
    # the log file names each op's implementation (the console has the trainer's one `kernels:` line)
    logs = [p.read_text() for p in sorted((tmp_path / "outputs").glob("*/train_rank0.log"))]
    assert logs and "op embedding -> torch" in logs[0], logs[:1]
    assert "calibration: cache miss" in train.stderr + train.stdout
    measured = _measurements(tmp_path / "simdev.yaml")  # simdev cannot pin: the pageable copy alone
    assert measured["h2d_pageable_bw_bytes_per_s"] > 0 and "h2d_bw_bytes_per_s" not in measured
    # no bf16 autocast on simdev: planned offline with this file, auto is costed in fp32, as it runs
    assert yaml.safe_load((tmp_path / "simdev.yaml").read_text())["spec"]["auto_precision"] == "fp32"
    assert last_json_line(planned.stdout)["backend"] == "simdev"
    unit = _run(f"python -c '{CHECKLIST_UNIT}'", tmp_path, simdev_site, tmp_path / "cache")
    assert "unit ok" in unit.stdout


def test_the_default_two_rank_job_calibrates_and_trains_on_simdev(simdev_site, tmp_path):
    cache = tmp_path / "cache"
    train, calibrate = (_run(c, tmp_path, simdev_site, cache) for c in doc_block("simdev-default-path"))
    summary = last_json_line(train.stdout)
    assert summary["backend"] == "simdev" and summary["world_size"] == 2 and summary["steps"] > 0
    assert summary["predicted_step_ms"] is not None and summary["peak_memory_bytes"] > 0
    assert "calibration: cache miss" in train.stderr + train.stdout
    assert len(list(cache.glob("calibration-simdev-*-2r-*.yaml"))) == 1
    assert "bus_bw_bytes_per_s" in _measurements(tmp_path / "simdev.yaml")["collectives"]["all_to_all"]


def test_with_simdev_installed_the_cpu_jobs_stay_on_the_cpu(simdev_site, cold_default_job, tmp_path):
    """`scripts/dev.sh train` (the 2-rank default job, on the cache the run's one cold calibration filled),
    the loss baseline job (50 steps) and `anyrec.calibrate`, with the plugin importable: on the CPU, planned
    with the CPU's cache entry, the baseline's loss and weights as without it."""
    cache = cold_default_job.calibrated_cache(tmp_path / "cache")
    dev_sh = (ROOT / "scripts" / "dev.sh").read_text()
    assert 'torchrun" --standalone --nproc_per_node="${ANYREC_NPROC:-2}" -m anyrec.train "$@"' in dev_sh
    job = "torchrun --standalone --nproc_per_node=2 -m anyrec.train"  # what dev.sh train runs
    proc = _run(job, tmp_path, simdev_site, cache)
    default = last_json_line(proc.stdout)
    assert default["backend"] == "cpu" and default["world_size"] == 2
    assert default["predicted_step_ms"] is not None
    (entry,) = cache.glob("calibration-cpu-*-2r-*.yaml")  # the CPU's key: a hit, nothing measured
    assert f"calibration: cache hit, planning with {entry}" in proc.stdout + proc.stderr
    baseline = f"{job} trainer.fingerprint_weights=true trainer.calibrate=never trainer.steps=50"
    with_plugin, without = (last_json_line(_run(baseline, tmp_path, path, cache).stdout)
                            for path in (simdev_site, tmp_path / "no-plugin"))
    assert with_plugin["backend"] == without["backend"] == "cpu"
    assert with_plugin["final_loss"] == without["final_loss"]  # the loss does not move
    assert with_plugin["steps"] == 50 and with_plugin["weights_sha256"] == without["weights_sha256"]
    _run("python -m anyrec.calibrate calibrate.size=quick calibrate.budget_s=0.01 calibrate.output=cpu.yaml",
         tmp_path, simdev_site, cache)
    assert _measurements(tmp_path / "cpu.yaml")["copy_bw_bytes_per_s"] > 0
