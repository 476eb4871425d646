"""The backend, the process group and the core binding are set up once per process (`start_runtime`), and
the calibrated Hardware is a value: a Trainer handed both sets up nothing again and reads no hardware file;
`anyrec.train` with `hardware=auto` calibrates and trains in one runtime and leaves the config as given."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from anyrec.backends import cpu, get_backend, resolve_hardware
from anyrec.backends import hardware as hardware_module
from anyrec.backends.interface import Backend
from anyrec.calibration import first_contact
from anyrec.choices import Switch
from anyrec.history import cache
from anyrec.runtime import distributed
from anyrec.runtime.distributed import ONE_PROCESS, close_runtime, destroy_distributed, start_runtime
from anyrec.trainer import trainer as trainer_module

from .conftest import compose_config

CAL = Path(__file__).parent / "data" / "calibration_cpu_2rank.yaml"
JOB = ["model=dlrm_tiny", "backend.name=cpu", "trainer.steps=2", "trainer.eval_steps=0",
       "trainer.progress=false", "trainer.tensorboard=false", "trainer.run_dir=null",
       "trainer.checkpoint.dir=null"]


class Calls:
    """Counts the calls of the set-up steps a runtime and a Hardware value stand for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.init = self.bind = self.hardware_files = 0

        def counted(name: str, fn):
            def wrapper(*args, **kwargs):
                setattr(self, name, getattr(self, name) + 1)
                return fn(*args, **kwargs)
            return wrapper

        for owner, name, counter in [(distributed, "init_distributed", "init"),
                                     (cpu.CPUBackend, "bind_local_rank", "bind"),
                                     (hardware_module, "load_hardware_file", "hardware_files")]:
            monkeypatch.setattr(owner, name, counted(counter, getattr(owner, name)))

    def __eq__(self, other: object) -> bool:
        return (self.init, self.bind, self.hardware_files) == other

    def __repr__(self) -> str:
        return f"init {self.init}, bind {self.bind}, hardware files {self.hardware_files}"


def test_a_trainer_given_a_runtime_and_hardware_sets_up_nothing_again(monkeypatch):
    calls = Calls(monkeypatch)
    runtime = start_runtime("cpu", bind_cores=Switch.false)
    hardware = resolve_hardware(str(CAL))
    assert calls == (1, 1, 1)
    cfg = compose_config(JOB)[1]
    trainer = trainer_module.Trainer(cfg, runtime=runtime, hardware=hardware)
    try:
        assert calls == (1, 1, 1)  # no second group, binding or read of the hardware file
        assert trainer.backend is runtime.backend and trainer.dist is runtime.dist
        assert trainer.hardware is hardware and trainer.predicted_perf is not None  # planned with it
    finally:
        trainer.close(keep_group=True)
    alone = trainer_module.Trainer(compose_config([*JOB, f"hardware.sku={CAL}"])[1])  # tools and tests
    try:
        assert calls == (2, 2, 2)  # a Trainer built alone sets itself up, from its config
        assert alone.hardware.measured_by == str(CAL)
    finally:
        alone.close()


def test_train_calibrates_and_trains_in_one_runtime(tmp_path, monkeypatch, caplog):
    """A hardware=auto job with a cached calibration (a hit: nothing measured) joins the group, binds and
    reads the entry once; the trainer plans with that entry and the config keeps `hardware.sku=auto`."""
    from anyrec.train import run

    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    from anyrec.signing import resolve_key

    # the key's threads are backend.threads=auto's share (all cores for one rank); a bare backend reads the
    # process's count, which a test before may have changed
    torch.set_num_threads(len(cpu.allowed_cores()))
    key = cache.local_key(get_backend("cpu"), ONE_PROCESS, cpu.allowed_cores())
    # signed as a job on this machine signs it: with the per-user key in the cache folder
    entry = cache.write_entry(tmp_path / key.file_name(), key, yaml.safe_load(CAL.read_text()),
                              signing_key=resolve_key(None))
    seen = []
    calibrated = first_contact.calibrated_hardware

    def recording(config, runtime, precision):
        seen.append(config)
        return calibrated(config, runtime, precision)

    resolved = []  # the dense precision: resolved once, for the calibration's measurement and the step
    dense_precision = Backend.dense_precision
    monkeypatch.setattr(Backend, "dense_precision", lambda b, c: resolved.append(dense_precision(b, c))
                        or resolved[-1])

    monkeypatch.setattr(first_contact, "calibrated_hardware", recording)
    calls = Calls(monkeypatch)
    built = []
    close = trainer_module.Trainer.close
    monkeypatch.setattr(trainer_module.Trainer, "close", lambda t, **kw: (built.append(t), close(t, **kw)))
    caplog.set_level("INFO")
    try:
        summary = run(compose_config([*JOB, "trainer.calibrate=auto", "backend.bind_cores=auto",
                                      f"trainer.run_dir={tmp_path / 'run'}"])[0])
    finally:
        destroy_distributed(barrier=False)  # closed by the run; a failed one may leave it
    assert f"calibration: cache hit, planning with {entry}" in caplog.text
    assert calls == (1, 1, 1)
    (config,) = seen
    assert config.hardware.sku == "auto" and config.backend.bind_cores == "auto"  # nothing written back
    (trainer,) = built
    assert resolved == [trainer.precision]
    assert trainer.hardware.measured_by == str(entry) and summary["predicted_step_ms"] > 0
    assert trainer.job.hardware_file == str(entry)  # what a run 10x off its prediction rejects


def test_the_runtime_holds_its_heartbeat_and_closing_it_stops_the_thread(monkeypatch):
    """The heartbeat is the runtime's own value (no module state): closing the runtime stops its thread
    and tells the peer this rank left on purpose."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from anyrec.backends.interface import Binding
    from anyrec.runtime.distributed import Runtime, close_runtime
    from anyrec.runtime.shutdown import DONE, Heartbeat

    from .conftest import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))  # the launcher's
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    heartbeat = Heartbeat(0, 2, timeout_s=60).start()
    backend = get_backend("cpu")
    runtime = Runtime(backend, ONE_PROCESS, torch.device("cpu"), Binding(), (0,), heartbeat)
    assert any(t.name == "anyrec-heartbeat" for t in threading.enumerate())
    close_runtime(runtime, barrier=False)
    assert not any(t.name == "anyrec-heartbeat" for t in threading.enumerate())
    assert dist.PrefixStore("anyrec/heartbeat/", store).get("0") == DONE


def test_a_trainer_that_set_up_its_runtime_stops_its_heartbeat_when_it_leaves_the_group_up(monkeypatch):
    """Trainers built one after another in one process (tools, benchmarks) each set up a runtime; closing
    one with keep_group=True leaves the group for the next, but stops the heartbeat it started (a thread
    left beating when the interpreter exits aborts the process). A runtime given to a Trainer is its
    caller's: the Trainer leaves that heartbeat alone."""
    import dataclasses
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from anyrec.runtime.shutdown import DONE, Heartbeat

    from .conftest import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))  # the launcher's
    beats = dist.PrefixStore("anyrec/heartbeat/", store)

    def with_heartbeat(runtime):
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        return dataclasses.replace(runtime, heartbeat=Heartbeat(0, 2, timeout_s=60).start())

    def beating() -> bool:
        return any(t.name == "anyrec-heartbeat" for t in threading.enumerate())

    alone = trainer_module.start_runtime
    monkeypatch.setattr(trainer_module, "start_runtime", lambda *a, **kw: with_heartbeat(alone(*a, **kw)))
    cfg = compose_config(JOB)[1]
    try:
        trainer = trainer_module.Trainer(cfg)
        assert beating()
        trainer.close(keep_group=True)
        assert not beating() and beats.get("0") == DONE and dist.is_initialized()
        given = with_heartbeat(trainer.runtime)
        trainer = trainer_module.Trainer(cfg, runtime=given)
        trainer.close(keep_group=True)
        assert beating()  # the caller's runtime: its caller closes it
        close_runtime(given, barrier=False)
        assert not beating()
    finally:
        destroy_distributed(barrier=False)
