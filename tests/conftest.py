"""Shared test helpers: composing configs and launching torchrun jobs."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from anyrec.backends import get_backend

ROOT = Path(__file__).resolve().parent.parent
# what torchrun sets for its workers: unset for a one-process run, which must not take them as its own
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Jobs the tests launch plan with the datasheet figures and never write into the user's cache; the
# tests of calibration on first contact ask for it (trainer.calibrate=auto) with a cache of their own.
os.environ.setdefault("ANYREC_CALIBRATE", "never")
# The run's own cache folder (signing key, step records), removed when the run ends; an xdist worker
# inherits its controller's and leaves it to the controller.
_OWN_CACHE_DIR = None if "ANYREC_CACHE_DIR" in os.environ else (
    Path(os.environ.get("TMPDIR", "/tmp")) / f"anyrec-test-cache-{os.getpid()}")
if _OWN_CACHE_DIR is not None:
    os.environ["ANYREC_CACHE_DIR"] = str(_OWN_CACHE_DIR)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "integration: starts processes or runs long; the fast tier is -m 'not integration'")
    config.addinivalue_line(
        "markers", "cpu_only: expects a host without an accelerator (skipped where anyrec detects one)")
    config.addinivalue_line(
        "markers", "deadline: asserts a wall-clock bound (seconds to stop, a timeout firing on time); the "
                   "integration tier runs these one at a time after the others, which share the cores")


def pytest_unconfigure(config):
    """Remove the cache folder this process made for the run."""
    if _OWN_CACHE_DIR is not None:
        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Skip `cpu_only` tests where the auto-detected backend is an accelerator."""
    marked = [item for item in items if item.get_closest_marker("cpu_only")]
    if not marked:
        return
    backend = get_backend("auto")
    if backend.device_type == "cpu":
        return
    skip = pytest.mark.skip(reason=f"expects a CPU-only host; this one has {backend.describe()}")
    for item in marked:
        item.add_marker(skip)


@functools.cache
def simdev_allocator():
    """The simulated device's caching allocator module (examples/simdev), loaded from its file once per
    process without installing the plugin: its rules tested alone."""
    path = ROOT / "examples" / "simdev" / "anyrec_simdev" / "allocator.py"
    spec = importlib.util.spec_from_file_location("simdev_allocator_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def compose_config(overrides: list[str] | None = None):
    """The composed config and the typed AnyrecConfig for these overrides, as the entry points would
    compose them. Composed once per process for each list of overrides and value of $ANYREC_CALIBRATE (the
    one variable the composed configs read); each call gets copies of its own to change."""
    cfg, typed = _composed(tuple(overrides or ()), os.environ.get("ANYREC_CALIBRATE"))
    return copy.deepcopy(cfg), copy.deepcopy(typed)


@functools.cache
def _composed(overrides: tuple[str, ...], calibrate: str | None):
    from hydra import compose, initialize_config_dir

    from anyrec import _hydra
    from anyrec._hydra import to_object
    from anyrec.config import config_dir

    _hydra.setup()
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return cfg, to_object(cfg)


def torchrun(args: list[str], nproc: int = 2, timeout: float = 240, cwd: Path | None = None,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun --standalone --nproc_per_node=N ARGS` and return the finished process."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    # Its own session, so a timeout kills torchrun's workers too, not only torchrun.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd or ROOT, env=full_env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # workers left behind by a torchrun that exited
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def last_json_line(stdout: str) -> dict:
    """The summary contract: the last stdout line is one JSON object."""
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    assert lines, "no stdout"
    return json.loads(lines[-1])


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """Each test starts at the process's intra-op thread count: a Trainer run in-process under
    backend.threads=auto keeps the count its timing found fastest, which later tests must not inherit."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _loggers() -> list[logging.Logger]:
    return [logging.root, *(lg for lg in logging.Logger.manager.loggerDict.values()
                            if isinstance(lg, logging.Logger))]


@pytest.fixture(autouse=True)
def logging_as_it_was():
    """Each test starts with logging as the one before found it. Hydra's runner, run in-process by some
    tests, configures handlers onto the streams pytest captured for that test; the next test would log
    into closed files (a `--- Logging error ---` on its stderr). Handlers a test added go (pytest's own
    stay: it removes those itself); every logger's level, propagation and disabled flag come back."""
    before = {id(lg): (set(map(id, lg.handlers)), lg.level, lg.propagate, lg.disabled) for lg in _loggers()}
    yield
    for lg in _loggers():
        handlers, level, propagate, disabled = before.get(id(lg), (set(), logging.NOTSET, True, False))
        for h in [h for h in lg.handlers if id(h) not in handlers
                  and not type(h).__module__.startswith("_pytest")]:
            lg.removeHandler(h)
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled


def _no_group_left(where: str):
    """A process group a test (or a module's fixtures) started must be gone when it ends: left up, it is
    the next test's (xdist hands any test to the worker), which then sees a group its ranks never formed.
    The group is torn down and the one that left it fails."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{where} left the default process group up (close the runtime or trainer it started)")


@pytest.fixture(autouse=True)
def no_group_left_by_a_test():
    yield from _no_group_left("this test")


@pytest.fixture(scope="module", autouse=True)
def no_group_left_by_a_module():
    yield from _no_group_left("this module's fixtures")


@pytest.fixture
def tmp_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


class OpRecorder(TorchDispatchMode):
    """Names of every op dispatched while active (custom FBGEMM ops included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def run_under_triton_interpreter(test_file: str) -> None:
    """Run a test module again in a child pytest with TRITON_INTERPRET=1 (it must be set before
    triton is imported, so it cannot be switched on inside this process) and assert it passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file).resolve())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def run_here(monkeypatch, capfd):
    """`python -m anyrec.NAME ARGS` (train, export, predict: one process without torchrun) run in the
    test's own: the console entry's runner (`_hydra.launch` on the module's `main`) with `env` set (a None
    value unsets it) in `cwd`, as a finished process: its exit status (0 when it returns) and what it
    printed. For a run that is refused, or trains a few steps, no second interpreter's start-up (seconds)
    is paid."""
    from anyrec import _hydra

    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)

    def run(name: str, args: list[str], cwd: Path, env: dict[str, str | None] | None = None,
            flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        entry = importlib.import_module(f"anyrec.{name}")
        with monkeypatch.context() as m:
            m.chdir(cwd)
            for var, value in (env or {}).items():
                if value is None:
                    m.delenv(var, raising=False)
                else:
                    m.setenv(var, value)
            capfd.readouterr()
            code = 0
            try:
                _hydra.launch(f"anyrec-{name}", entry.main, [*flags, *args])
            except SystemExit as e:
                code = e.code
            out = capfd.readouterr()
        return subprocess.CompletedProcess([f"anyrec-{name}", *flags, *args], code, out.out, out.err)

    return run


@pytest.fixture
def train_here(run_here):
    """`python -m anyrec.train ARGS` run in the test's process (run_here)."""
    return functools.partial(run_here, "train")


def single_process_env(*paths: Path) -> dict:
    """The environment of a one-process `python -m anyrec.train` child with anyrec and `paths`
    importable and no torchrun variables inherited from this process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *map(str, paths), os.environ.get("PYTHONPATH", "")])}
    for var in TORCHRUN_VARS:
        env.pop(var, None)
    return env


def pip_install_target(package: Path, tmp: Path) -> Path:
    """Install the package folder `package` with pip into a fresh target directory under `tmp` (not the
    venv) and return that directory, to be put on sys.path / PYTHONPATH."""
    src = shutil.copytree(package, tmp / "src")  # pip's build leaves files beside the sources
    target = tmp / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--no-index", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


# The head of a script run where anyrec, torchrec and fbgemm cannot be imported: an exported artifact must
# need torch alone. The script goes on with its own scoring.
TORCH_ONLY_HEAD = """import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("anyrec", "torchrec", "fbgemm_gpu"):
            raise ImportError(f"{name} is blocked")
sys.meta_path.insert(0, Blocker())
import torch
"""


def trainer_checkpoint(folder: Path, train: torch.nn.Module, tables: dict[str, list[int]], optimizer: str,
                       step: int, model_name: str) -> Path:
    """A checkpoint of `train` at `step` in folder/ckpt as the trainer writes it: its signature (the tables'
    shapes, the dense parameters' shapes, the embedding optimizer), signed with the per-user key."""
    from anyrec.config import CheckpointConfig
    from anyrec.runtime.distributed import ONE_PROCESS
    from anyrec.signing import resolve_key
    from anyrec.trainer.checkpoint import CheckpointManager

    dense = {n: list(p.shape) for n, p in train.named_parameters() if "sparse_arch" not in n}
    manager = CheckpointManager(CheckpointConfig(dir=str(folder / "ckpt")),
                                {"tables": tables, "dense": dense, "optimizer": optimizer}, ONE_PROCESS,
                                signing_key=resolve_key(None))
    manager.start()
    path = manager.save(step, {"model": train.state_dict()}, {"world_size": 1, "model": model_name})
    manager.close()
    return path


def run_shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every process of this pytest run sees: the run's own temporary folder, which pytest-xdist's
    workers share (each has a subfolder of it); a run without workers has it to itself."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, make) -> Path:
    """The folder `name` of run_shared_dir, filled by `make(folder)` once per pytest run: the first of its
    xdist workers to take the folder's lock calls it, the others wait and find it done."""
    shared = run_shared_dir(tmp_path_factory) / name
    shared.mkdir(exist_ok=True)
    done = shared / ".done"
    with open(shared / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            make(shared)
            done.touch()
    return shared


@pytest.fixture(scope="session")
def simdev_site(tmp_path_factory) -> Path:
    """examples/simdev installed with pip into a target directory (not the venv) once per pytest run,
    shared by its xdist workers."""
    return once_per_run(tmp_path_factory, "simdev-install",
                        lambda folder: pip_install_target(ROOT / "examples" / "simdev", folder)) / "site"


@pytest.fixture
def fresh_impls(monkeypatch):
    """A registry of the built-in Impls only, plugins discovered again on first use (a test may change
    sys.path), probes run again; the process's own registry is back afterwards."""
    from anyrec.backends import dispatch

    monkeypatch.setattr(dispatch, "_impls", {(i.op, i.name): i for i in dispatch.BUILTIN_IMPLS})
    monkeypatch.setattr(dispatch, "_plugins_loaded", False)
    monkeypatch.setattr(dispatch, "_plugin_errors", {})
    reset_probes()
    yield
    reset_probes()


def reset_probes() -> None:
    """Forget the dispatcher's probe results and logged choices (a test flips the environment and
    probes again)."""
    from anyrec.backends import dispatch

    dispatch._probe_cache.clear()
    dispatch._logged.clear()


def default_job(cwd: Path, cache: Path, timeout: float = 480) -> tuple[int, str]:
    """`torchrun --standalone --nproc_per_node=2 -m anyrec.train` as a user types it (calibration on first
    contact at its default, into the cache folder `cache`): exit status and its whole console."""
    # as a user has it: calibration on (the tests' default is off), torchrun's notice about threads too
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANYREC_") and k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["ANYREC_CACHE_DIR"] = str(cache)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "anyrec.train"]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        # bytes: the bar's carriage returns stay what they are. The bound: a cold run's calibration (itself
        # bounded at 2 minutes), the start-up and 300 steps on a host other jobs may share
        out, _ = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing left behind, whatever happened
    return proc.returncode, out.decode(errors="replace")


def trust_entry(path: Path) -> None:
    """Mark the calibration cache entry at `path` trusted, as a quiet host's calibration is (rewritten
    whole, signed again with the per-user key in its cache folder, as a job signs it)."""
    import yaml

    from anyrec.history import cache as calcache
    from anyrec.signing import resolve_key

    data = yaml.safe_load(path.read_text())
    data["measurements"]["trust"] = {**data["measurements"]["trust"], "trusted": True, "reasons": []}
    key = resolve_key(None, {calcache.CACHE_DIR_ENV: str(path.parent)})
    calcache.write_entry(path, calcache.CacheKey.from_dict(data["cache"]["key"]), data, signing_key=key)


@dataclass(frozen=True)
class ColdJob:
    """The default 2-rank job run once on an empty cache: its exit status, its console and the cache it
    filled (read only: `calibrated_cache` copies it)."""

    returncode: int
    console: str
    cache: Path

    def calibrated_cache(self, dest: Path) -> Path:
        """A copy of the filled cache at `dest` (entries, per-user key, step records), every entry trusted:
        a later job there finds it and measures nothing, however busy the host was when it was measured."""
        shutil.copytree(self.cache, dest)
        for entry in dest.glob("calibration-*.yaml"):
            trust_entry(entry)
        return dest


@pytest.fixture(scope="session")
def cold_default_job(tmp_path_factory) -> ColdJob:
    """The run's one cold calibration on first contact: the default 2-rank job as a user types it, on an
    empty cache, once per pytest run and shared by its xdist workers. Tests that watch the cold path read
    its console; tests that need a calibrated cache copy its cache."""
    def run(folder: Path) -> None:
        code, out = default_job(folder, folder / "cache")
        (folder / "console.txt").write_bytes(out.encode())  # its carriage returns kept
        (folder / "returncode").write_text(str(code))

    shared = once_per_run(tmp_path_factory, "cold-default-job", run)
    job = ColdJob(int((shared / "returncode").read_text()), (shared / "console.txt").read_bytes().decode(),
                  shared / "cache")
    assert job.returncode == 0, job.console[-3000:]
    return job


@dataclass(frozen=True)
class Calibration:
    """`torchrun --nproc_per_node=2 -m anyrec.calibrate` run once: its process, the hardware file it wrote
    and the cache folder its entry went to (both read only)."""

    proc: subprocess.CompletedProcess
    output: Path
    cache: Path


@pytest.fixture(scope="session")
def two_rank_calibration(tmp_path_factory) -> Calibration:
    """The run's one thorough 2-rank calibration (every figure measured, collectives included, a small
    budget), its entry cached too: once per pytest run, shared by its xdist workers."""
    def run(folder: Path) -> None:
        proc = torchrun(["-m", "anyrec.calibrate", f"calibrate.output={folder / 'cal2.yaml'}",
                         "calibrate.budget_s=0.02", "calibrate.cache=true", "calibrate.time_limit_s=900"],
                        nproc=2, cwd=folder, env={"ANYREC_CACHE_DIR": str(folder / "cache")}, timeout=900)
        (folder / "proc.json").write_text(json.dumps([proc.returncode, proc.stdout, proc.stderr]))

    shared = once_per_run(tmp_path_factory, "two-rank-calibration", run)
    code, out, err = json.loads((shared / "proc.json").read_text())
    assert code == 0, err[-3000:]
    proc = subprocess.CompletedProcess([], code, out, err)
    return Calibration(proc, shared / "cal2.yaml", shared / "cache")
