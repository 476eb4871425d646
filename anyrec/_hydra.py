"""Hydra plumbing shared by the entry points: schema registration, resolvers, the strict key check,
the typed config, and `launch`, which runs an entry point's job under Hydra's own runner, `hydra.main`.

anyrec adds to the runner only through Hydra's extension points, each small:
- `HYDRA_FULL_ERROR=1` while `hydra.main` runs (not inside the job), so that what Hydra would print as a
  stripped traceback and exit 1 (a refused override, a group option that does not exist, an override's
  syntax) reaches `launch`, which says it in one line, `<prog>: error: ...`, exit status 2. A user who
  sets `HYDRA_FULL_ERROR=1` gets Hydra's full trace instead.
- a callback, `StartChecks` (`hydra.callbacks.start_checks` in configs/config.yaml): after composition and
  before the run folder is made, a mandatory value unset, a value out of range, or an output folder that
  cannot be written or holds links is refused the same way (`StartRefused`, exit status 2).
- `--help` is Hydra's, its template (configs/config.yaml's `hydra.help`) listing each group's real
  options through the `anyrec_config_groups` resolver; the console and log file are a `hydra/job_logging`
  config (configs/hydra/job_logging/anyrec.yaml); only rank 0 writes `.hydra/` (`anyrec_rank0`).
What this costs: `hydra.main` composes a plain run's config twice (once to read `hydra.mode`: about
0.12 s of CPU with these groups); Hydra sets up its own logging (`hydra/hydra_logging`) before the job's,
which `launch` undoes when it refuses a job; a mistake among Hydra's flags (`--bogus`) is argparse's
usage and error, exit 2, as it was before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import (
    InterpolationKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from anyrec import console
from anyrec.backends.hardware import is_hardware_path
from anyrec.config import (
    AnyrecConfig,
    BackendConfig,
    DataConfig,
    HardwareConfig,
    ModelConfig,
    OptimConfig,
    PlannerConfig,
    TrainerConfig,
    check_values,
    config_dir,
)
from anyrec.io_checks import writable_dir
from anyrec.runtime.errors import say_line, write_error_file
from anyrec.sequence_schema import SequenceDataConfig

FULL_ERROR = "HYDRA_FULL_ERROR"  # Hydra's switch: raise instead of printing a stripped trace


def _rank0_only(value: str) -> str | None:
    """`${anyrec_rank0:x}` is x on rank 0 and null elsewhere (e.g. only rank 0 writes .hydra/)."""
    return value if os.environ.get("RANK", "0") == "0" else None


def setup() -> None:
    """Idempotent: register the config schema (which type-checks every YAML group) and the resolvers."""
    cs = ConfigStore.instance()
    # storing builds each schema's structured config again (~60 ms): only where the store lacks one
    if "anyrec_schema.yaml" not in cs.repo:
        cs.store(name="anyrec_schema", node=AnyrecConfig)
    for group, node in _GROUP_SCHEMAS:
        if f"{group}_schema.yaml" not in cs.repo.get(group, {}):
            cs.store(group=group, name=f"{group}_schema", node=node)
    for name, resolver in [("anyrec_rank0", _rank0_only), ("anyrec_config_groups", _config_groups)]:
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


_GROUP_SCHEMAS = [("model", ModelConfig), ("data", DataConfig), ("backend", BackendConfig),
                  ("hardware", HardwareConfig), ("planner", PlannerConfig), ("optim", OptimConfig),
                  ("trainer", TrainerConfig)]


def _config_groups() -> str:
    """`${anyrec_config_groups:}` (the --help template): each config group and its options, as Hydra
    lists them, less the schemas that type the groups' files (`model_schema`, ...)."""
    loader = GlobalHydra.instance().config_loader()
    schemas = {f"{group}_schema" for group, _ in _GROUP_SCHEMAS}
    lines = []
    for group in sorted(g for g in loader.list_groups("") if g != "hydra"):
        options = sorted(o for o in loader.get_group_options(group) if o not in schemas)
        lines.append(f"{group}: {', '.join(options)}")
    return "\n".join(lines)


def _schema_keys(node_type: type, prefix: str = "") -> list[str]:
    """Every dotted key the dataclass schema `node_type` defines (nested dataclasses expanded)."""
    keys = []
    for f in dataclasses.fields(node_type):
        key = f"{prefix}{f.name}"
        keys.append(key)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += _schema_keys(type(default), f"{key}.")
    return keys


def _unknown_keys(cfg: DictConfig, prefix: str = "") -> list[tuple[str, list[str]]]:
    """Keys of `cfg` its schema does not define, each with the keys known at its level (Hydra's
    `+key=value` adds a key even to a structured config, which OmegaConf then drops silently)."""
    schema = OmegaConf.get_type(cfg)
    if not dataclasses.is_dataclass(schema):
        return []  # a free-form mapping (e.g. hardware.spec): checked where it is used
    known = {f.name for f in dataclasses.fields(schema)}
    found = []
    for key in cfg.keys():
        if key not in known:
            found.append((f"{prefix}{key}", sorted(known)))
            continue
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            found += _unknown_keys(child, f"{prefix}{key}.")
    return found


def check_known_keys(cfg: DictConfig) -> None:
    """Reject keys the schema does not know (e.g. `+trainer.checkpoint.dirr=D`), naming the closest."""
    unknown = _unknown_keys(cfg)
    if not unknown:
        return
    everything = _schema_keys(OmegaConf.get_type(cfg))
    parts = []
    for key, siblings in unknown:
        parent, _, name = key.rpartition(".")
        near = difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)
        guess = f"{parent}.{near[0]}" if near and parent else (near[0] if near else None)
        if guess is None:
            candidates = [k for k in everything if not key.startswith(f"{k}.")]
            near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
            guess = near[0] if near else None
        parts.append(f"{key} (did you mean {guess}?)" if guess else
                     f"{key} (known under {parent or 'the top level'}: {', '.join(siblings)})")
    raise ValueError(f"unknown config key{'s' if len(parts) > 1 else ''}: {'; '.join(parts)}")


_ENV = re.compile(r"oc\.env:\s*([A-Za-z_][A-Za-z0-9_]*)")


def _raw_value(cfg: DictConfig, key: str) -> Any:
    """The value at dotted `key` as written, interpolations unresolved (None where there is none)."""
    node: Any = OmegaConf.to_container(cfg, resolve=False)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _resolution_problem(cfg: DictConfig, e: OmegaConfBaseException) -> str | None:
    """One line for a value refused only when the config is resolved (an environment variable's value
    through `${oc.env:NAME,...}`, or the variable unset), naming the option and the variable, or an
    interpolation of a key that does not exist; None for one that only a running Hydra app resolves."""
    raw = _raw_value(cfg, e.full_key)
    env = _ENV.search(raw) if isinstance(raw, str) else None
    if env is None and not isinstance(e, ValidationError | InterpolationKeyError):
        return None
    reason = str(e.msg).splitlines()[0]
    reason = re.sub(r"^While dereferencing interpolation '.*?': ", "", reason)
    via = f" (the environment variable {env.group(1)}, through {raw})" if env else ""
    return f"{e.full_key}: {reason}{via}"


def to_object(cfg: DictConfig) -> AnyrecConfig:
    """A typed `AnyrecConfig` from a composed DictConfig, validated by the schema and every numeric
    option's range (`anyrec.config.check_values`): the one place every entry point's values are checked.
    A value refused is a ValueError in one line."""
    check_known_keys(cfg)
    try:
        typed = OmegaConf.to_object(cfg)  # an AnyrecConfig: config.yaml's defaults name the schema
    except MissingMandatoryValue as e:
        raise ValueError(f"{e.full_key}: a value is required; set it on the command line, e.g. "
                         f"{e.full_key}=...") from None
    except (ValidationError, InterpolationResolutionError) as e:
        problem = _resolution_problem(cfg, e) if e.full_key else None
        if problem is None:
            raise
        raise ValueError(problem) from None
    check_values(typed)
    SequenceDataConfig.of(typed.data.sequence, typed.data.batch_size)  # a sequence source's options
    return typed


def _values(cfg: DictConfig) -> str | None:
    """One line for an option whose value the typed config refuses (out of its range, or refused once
    an environment variable is read), else None: checked before the run folder is made."""
    job = cfg.copy()
    with open_dict(job):
        job.pop("hydra", None)
    try:
        to_object(job)
    except OmegaConfBaseException:  # an interpolation only the running app resolves: the app says it
        return None
    except ValueError as e:
        return str(e)
    return None


def run_folder() -> str | None:
    """The folder Hydra's runner made for this job (`hydra.run.dir`), or None outside a run (a config
    composed by hand leaves Hydra's state with the folder unset)."""
    if not HydraConfig.initialized():
        return None
    runtime = HydraConfig.get().runtime
    return None if OmegaConf.is_missing(runtime, "output_dir") else runtime.output_dir


def per_job_dir(path: str | None) -> str | None:
    """Under a Hydra multirun, `path/<job number>`: jobs of one sweep never share a checkpoint dir."""
    if path is None or not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return path
    return os.path.join(path, str(HydraConfig.get().job.num))


def _missing(cfg: DictConfig) -> str | None:
    """One line for the first mandatory value (`???`) a composed config leaves unset, else None."""
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])  # Hydra's own leaves some unset
    try:
        missing = sorted(OmegaConf.missing_keys(job))
    except OmegaConfBaseException:  # a value refused once resolved: `_values` says which
        return None
    if not missing:
        return None
    more = f" (and {', '.join(missing[1:4])})" if len(missing) > 1 else ""
    return f"{missing[0]}: a value is required{more}; set it on the command line, e.g. {missing[0]}=..."


def _output_dir(cfg: DictConfig, multirun: bool) -> str | None:
    """One line when Hydra's output folder (hydra.run.dir, or hydra.sweep.dir) cannot be written."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        path = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except Exception:  # noqa: BLE001 - an interpolation only a running app resolves: Hydra checks it
        return None
    try:
        writable_dir(path, f"{key}: Hydra's output folder")
    except ValueError as e:
        return f"{e}; run from a writable folder or set {key}=<a writable folder>"
    return None


def _linked_outputs(cfg: DictConfig, multirun: bool = False) -> str | None:
    """One line when a file Hydra writes in the run folder (`.hydra/` and its YAMLs, the log file) is a
    symbolic link, else None; under a multirun, in each job folder the sweep folder already holds. Hydra
    opens its YAMLs following links; the log file is opened with NoFollowFileHandler (configs/config.yaml)
    and is checked here too so that the error is this line."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        top = Path(OmegaConf.select(cfg, key, throw_on_resolution_failure=True)).absolute()
        subdir = OmegaConf.select(cfg, "hydra.output_subdir", throw_on_resolution_failure=True)
        if multirun:  # the jobs of an earlier sweep into the same folder
            run_dirs = sorted(p for p in top.iterdir() if p.is_dir()) if top.is_dir() else []
        else:
            run_dirs = [top]
        probe = cfg.copy()  # the log file's name needs the job's output folder, which run_job sets
        paths = []
        for run_dir in run_dirs:
            with open_dict(probe.hydra.runtime):
                probe.hydra.runtime.output_dir = str(run_dir)
            log = OmegaConf.select(probe, "hydra.job_logging.handlers.file.filename", default=None)
            paths += [Path(log)] if log else []
            if subdir is not None:
                names = ("config.yaml", "hydra.yaml", "overrides.yaml")
                paths += [run_dir / subdir, *(run_dir / subdir / n for n in names)]
    except Exception:  # noqa: BLE001 - an interpolation only a running app resolves: nothing to check here
        return None
    for p in paths:
        if p.is_symlink():
            return (f"{p} is a symbolic link: anyrec does not write through links; remove it, or set "
                    f"{key}=<another folder>")
    return None


def _command_line_problem(e: Exception) -> str:
    """One line for what Hydra refused before the job started: an override's value (`trainer.steps=many`,
    `trainer.stepz=3`), a file as the `hardware` group's option, a group option that does not exist, an
    override's syntax, else the first line of Hydra's message (e.g. two commands among its flags)."""
    missing = getattr(e, "missing_cfg_file", None) or ""  # `group/option`; an option may be a path
    group, _, option = missing.rpartition("/") if missing.startswith("hydra/") else missing.partition("/")
    if isinstance(e, MissingConfigException) and group == "hardware" and is_hardware_path(option):
        return (f"hardware={option}: a hardware file is named with hardware.sku={option} "
                "(hardware= takes a group option: auto, a SKU name, or a YAML's name on hydra.searchpath)")
    cause = e.__cause__ if isinstance(e, ConfigCompositionException) else e
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        return f"{cause.full_key}: {str(cause.msg).splitlines()[0]}"
    if isinstance(e, MissingConfigException) and group and e.options:
        options = sorted(o for o in e.options if o != f"{group}_schema")
        return f"{group}={option}: no such option; {group} takes one of: {', '.join(options)}"
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    first = lines[0] if lines else type(e).__name__
    return f"{e.override}: {first}" if isinstance(e, OverrideParseException) else first


def start_problem(cfg: DictConfig, multirun: bool = False) -> str | None:
    """One line naming what stops a composed job before its run folder is made (a mandatory value
    unset, a value the typed config refuses, an output folder that cannot be written or whose Hydra files
    are links), else None. A sweep's values are its jobs' to check: only its folder is checked here."""
    if not multirun:
        problem = _missing(cfg) or _values(cfg)
        if problem:
            return problem
    return _output_dir(cfg, multirun) or _linked_outputs(cfg, multirun)


class StartRefused(SystemExit):
    """A job refused by `StartChecks`, exit status 2; `launch` prints `problem` as the entry point's one
    line. A SystemExit because Hydra turns a callback's Exception into a warning and goes on."""

    def __init__(self, problem: str) -> None:
        super().__init__(2)
        self.problem = problem


class StartChecks(Callback):
    """The `hydra.callbacks.start_checks` of configs/config.yaml: `start_problem` on the composed config,
    after Hydra composes it and before it makes the run (or sweep) folder."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        problem = start_problem(config)
        if problem:
            raise StartRefused(problem)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        problem = start_problem(config, multirun=True)
        if problem:
            raise StartRefused(problem)


def cli_problem(overrides: list[str]) -> str | None:
    """The one line an entry point would exit with on these overrides before its job starts, else None;
    informational flags (--help, --cfg, ...) are None."""
    multirun = any(o in ("-m", "--multirun") for o in overrides)
    if any(o.startswith("-") and o not in ("-m", "--multirun") for o in overrides):
        return None
    overrides = [o for o in overrides if not o.startswith("-")]
    setup()  # the schema must be registered for the values to be checked
    try:
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            cfg = compose("config", overrides, return_hydra_config=True)
    except (ConfigCompositionException, ValidationError) as e:
        return _command_line_problem(e)
    except Exception:  # noqa: BLE001 - anything else (a sweep's syntax, a launcher plugin): Hydra says it
        return None
    return start_problem(cfg, multirun)


def _refuse(prog: str, problem: str) -> NoReturn:
    """Exit 2 with `problem` in one line, printed by rank 0 and in each rank's torchrun error file."""
    line = f"{prog}: error: {problem}"
    if os.environ.get("RANK", "0") == "0":
        say_line(line)
    write_error_file(line)
    sys.exit(2)


def run_typed(prog: str, run: Callable[[AnyrecConfig], Any], cfg: DictConfig) -> None:
    """`run` on the typed config; a ValueError (a user mistake, an infeasible plan): one line, exit 2."""
    try:
        run(to_object(cfg))
    except ValueError as e:  # every rank of a job under torchrun says it: one write each, never spliced
        say_line(f"{prog}: error: {e}")
        sys.exit(2)


@contextlib.contextmanager
def _environ(name: str, value: str | None) -> Iterator[None]:
    """The environment variable `name` set to `value` (unset where None) inside the block only."""
    saved = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if saved is not None:
            os.environ[name] = saved


def launch(prog: str, task: Callable[[DictConfig], Any], argv: list[str] | None = None) -> None:
    """Run `task` under Hydra's runner, `hydra.main`, on the command line (or `argv`): Hydra's flags
    (--help, --cfg, --multirun, ...), its run folder, logging, `.hydra/` and callbacks. What stops the job
    before it starts (Hydra refusing an override, `StartChecks` refusing a value or a folder) is one line
    and exit status 2; an exception of the job itself is raised here with its traceback."""
    setup()
    console.capture_warnings()
    user_full_error = os.environ.get(FULL_ERROR)
    started = False

    @functools.wraps(task)  # Hydra names the job after the unwrapped task's module
    def job(cfg: DictConfig) -> Any:
        nonlocal started
        started = True
        with _environ(FULL_ERROR, user_full_error):  # the job's own children see the user's setting
            return task(cfg)

    saved_argv, root = sys.argv[:], logging.getLogger()
    saved_logging = root.handlers[:], root.level
    if argv is not None:
        sys.argv[1:] = argv  # hydra.main parses sys.argv
    try:
        with _environ(FULL_ERROR, "1"):  # Hydra raises what it would print as a stripped traceback
            hydra.main(str(config_dir()), "config", version_base="1.3")(job)()
    except StartRefused as e:
        problem = e.problem
    except Exception as e:
        if started or user_full_error == "1":  # the job's own failure, or the user asked for Hydra's trace
            raise
        problem = _command_line_problem(e)
    else:
        return
    finally:
        sys.argv[:] = saved_argv
    root.handlers[:], level = saved_logging  # refused: Hydra's own logging set-up undone, as if not run
    root.setLevel(level)
    _refuse(prog, problem)


def compose_job(overrides: list[str]) -> AnyrecConfig:
    """The typed config of `overrides`, composed as `anyrec-train` composes it (outside a Hydra app:
    in-process jobs such as parity workers and calibration points)."""
    setup()
    if GlobalHydra.instance().is_initialized():  # inside an entry point's app (its config dir is ours)
        return to_object(compose("config", overrides=overrides))
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    problem = _missing(cfg)
    if problem:
        raise ValueError(problem)
    return to_object(cfg)
