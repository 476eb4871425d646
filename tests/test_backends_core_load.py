"""backend.bind_cores=auto: the rule (bound on free cores, free where other processes use them), the
measurement it reads (/proc/stat less this job's own time) and the CPU backend acting on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from anyrec.backends.core_load import (
    OTHER_BUSY_MAX_CORES,
    CoreLoad,
    LoadMeter,
    choose_binding,
    measure_core_load,
)
from anyrec.backends.cpu import core_share
from anyrec.choices import Switch, parse_switch

LINUX_2_CORES = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
    or not os.path.exists("/proc/stat"), reason="needs Linux /proc and two cores")
QUIET = CoreLoad(busy_cores=1.9, own_cores=1.85, sample_s=0.25)  # the job's own ranks, nothing else
LOADED = CoreLoad(busy_cores=2.0, own_cores=0.4, sample_s=0.25)  # another job on the same cores


def _never() -> CoreLoad:
    raise AssertionError("a forced setting must not measure")


def test_rule_binds_on_free_cores_and_not_on_busy_ones():
    quiet = choose_binding(Switch.auto, lambda: QUIET)
    assert quiet.bind and "bound" in quiet.describe() and "0.05 cores" in quiet.describe()
    loaded = choose_binding(Switch.auto, lambda: LOADED)
    assert not loaded.bind and "1.60 cores" in loaded.describe() and "free" in loaded.describe()
    edge = CoreLoad(busy_cores=1.0 + OTHER_BUSY_MAX_CORES, own_cores=1.0, sample_s=0.25)
    assert choose_binding(Switch.auto, lambda: edge).bind
    assert choose_binding(Switch.auto, lambda: None).bind  # unreadable: the quiet-host default
    # Forced either way, nothing is measured (Hydra's 'True' / 'False' are parsed where the config is built)
    assert choose_binding(Switch.true, _never).bind
    assert not choose_binding(Switch.false, _never).bind
    assert choose_binding(Switch.false, _never).describe() == "backend.bind_cores=false"
    with pytest.raises(ValueError, match="backend.bind_cores='sometimes': choose auto, true or false"):
        parse_switch("backend.bind_cores", "sometimes")


@pytest.mark.integration
@LINUX_2_CORES
def test_measurement_counts_other_processes_and_subtracts_the_jobs_own():
    cpus = sorted(os.sched_getaffinity(0))
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        # The spinning child is no rank of this job (it is this process's child, not a sibling).
        other = measure_core_load(cpus, sample_s=0.5)
        assert other is not None and other.other_cores >= 0.3, other
        # Counted as the job's own, its time moves from `other` to `own` (on a loaded host the child
        # gets a small share of a core: any tick of it shows)
        own = measure_core_load(cpus, sample_s=0.5, pids=lambda: [os.getpid(), spin.pid])
        assert own is not None and own.own_cores > 0, own
        assert own.other_cores == pytest.approx(max(0.0, own.busy_cores - own.own_cores))
    finally:
        spin.kill()
        spin.wait(timeout=30)


# A child binds (the test keeps its affinity), with the measurement replaced by a given load.
AUTO_CHILD = """
import json, os, sys, logging
import anyrec.backends.cpu as cpu
from anyrec.backends.core_load import CoreLoad
from anyrec.choices import Switch
logging.basicConfig(level=logging.INFO)
busy, own = float(sys.argv[1]), float(sys.argv[2])
cpu.measure_core_load = lambda cpus: CoreLoad(busy_cores=busy, own_cores=own, sample_s=0.25)
backend = cpu.CPUBackend()
binding = backend.bind_local_rank(1, 2, Switch.auto)
mask = sorted(os.sched_getaffinity(0))
print(json.dumps({"share": binding.cores, "mask": mask, "bind": binding.bind.bind}))
"""


def _auto_child(load: CoreLoad) -> tuple[dict, str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", AUTO_CHILD, str(load.busy_cores), str(load.own_cores)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.integration
@LINUX_2_CORES
def test_cpu_backend_binds_by_the_rule_and_logs_why():
    allowed = sorted(os.sched_getaffinity(0))
    quiet, err = _auto_child(QUIET)
    assert quiet["bind"] and quiet["share"] == quiet["mask"] == core_share(allowed, 1, 2)
    assert "threads bound to cores" in err and "other processes used 0.05 cores" in err
    loaded, err = _auto_child(LOADED)
    assert not loaded["bind"] and loaded["share"] is None and loaded["mask"] == allowed
    assert "threads free on cores" in err and "other processes used 1.60 cores" in err


def test_load_meter_counts_this_process_over_the_whole_stretch():
    cpus = sorted(os.sched_getaffinity(0))
    meter = LoadMeter(cpus, pids=lambda: [os.getpid()])
    start = time.process_time()
    while time.process_time() - start < 0.2:  # CPU time, not wall time: as much work on any host
        pass
    load = meter.read()
    assert load is not None and load.own_cores > 0, load
    assert load.busy_cores >= load.own_cores - 0.15, load  # a tick apart
    assert load.sample_s >= 0.2 and meter.cores == len(cpus)
