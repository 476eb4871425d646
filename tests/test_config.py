"""Every config group composes and validates against the schema; bad keys fail clearly."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import subprocess
import sys
import typing

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError

from anyrec import _hydra
from anyrec._hydra import cli_problem
from anyrec.config import RANGES, AnyrecConfig, check_values, config_dir

from .conftest import ROOT, compose_config

GROUPS = ["model", "data", "backend", "hardware", "planner", "optim", "trainer"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_of_every_group_composes(group):
    options = _options(group)
    assert options, f"config group {group} is empty"
    for option in options:
        _, cfg = compose_config([f"{group}={option}"])
        assert isinstance(cfg, AnyrecConfig)
        if group in ("model", "optim", "planner", "backend", "data"):
            assert getattr(cfg, group).name == option


def test_defaults():
    _, cfg = compose_config()
    assert cfg.model.name == "dlrm_small"
    assert len(cfg.model.table_rows) == 26 and cfg.model.num_dense_features == 13
    assert cfg.model.interaction == "dot"
    assert cfg.data.name == "synthetic" and cfg.backend.name == "auto"


def test_overrides_are_typed():
    _, cfg = compose_config(["trainer.steps=50", "trainer.seed=7", "trainer.eval_steps=0",
                             "trainer.log_every=10", "model=dlrm_tiny"])
    assert (cfg.trainer.steps, cfg.trainer.seed, cfg.trainer.eval_steps) == (50, 7, 0)
    assert cfg.model.name == "dlrm_tiny"


def test_unknown_key_fails():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as e:
        compose_config(["trainer.no_such_key=1"])
    assert "no_such_key" in str(e.value) or "no_such_key" in str(e.value.__cause__)


def test_wrong_type_fails():
    with pytest.raises(ConfigCompositionException):
        compose_config(["trainer.steps=many"])


def test_unknown_option_fails():
    with pytest.raises(ConfigCompositionException):
        compose_config(["model=no_such_model"])


@pytest.mark.parametrize(("override", "message"), [
    ("+trainer.checkpoint.dirr=D", "trainer.checkpoint.dirr (did you mean trainer.checkpoint.dir?)"),
    ("+trainer.bogus=1", "unknown config key: trainer.bogus ("),
    ("+model.embeding_dim=8", "model.embeding_dim (did you mean model.embedding_dim?)"),
])
def test_unknown_added_key_fails_naming_the_closest(override, message):
    # `+key=value` adds a key past Hydra's struct check; the schema check must still refuse it.
    with pytest.raises(ValueError) as e:
        compose_config(["model=dlrm_tiny", override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_legitimate_additions_compose():
    _, cfg = compose_config(["+experiment=dlrmv2_cpu", "trainer.steps=5"])
    assert cfg.model.name == "dlrmv2_small" and cfg.trainer.steps == 5 and cfg.optim.warmup_steps == 20
    _, cfg = compose_config(["+hardware.spec.simd_width=64"])  # a free-form mapping: checked on use
    assert cfg.hardware.spec == {"simd_width": 64}


def _numeric_options(node_type: type, prefix: str = "") -> dict[str, type]:
    """Every option of the schema holding a number or a list of numbers, by dotted key, with its type."""
    found = {}
    hints = typing.get_type_hints(node_type)
    for f in dataclasses.fields(node_type):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            found.update(_numeric_options(hint, f"{prefix}{f.name}."))
            continue
        args = set(typing.get_args(hint)) - {type(None)}
        kind = typing.get_args(hint)[0] if typing.get_origin(hint) is list else \
            args.pop() if len(args) == 1 else hint
        if kind in (int, float):
            found[f"{prefix}{f.name}"] = kind
    return found


NUMERIC = _numeric_options(AnyrecConfig)


def test_every_numeric_option_has_a_range():
    assert len(NUMERIC) > 40  # the walk found the schema's options
    assert sorted(NUMERIC) == sorted(RANGES)


def _bad_values(key: str) -> list:
    """Values just outside the option's range on each bounded side, and NaN for a float option."""
    r, integer = RANGES[key], NUMERIC[key] is int
    bad = []
    if r.low is not None:
        bad.append(r.low if r.low_open else (r.low - 1 if integer else r.low - 0.5))
    if r.high is not None:
        bad.append(r.high if r.high_open else (r.high + 1 if integer else r.high * 2))
    if not integer:
        bad += [math.nan, math.inf]
    return bad


CASES = [(key, bad) for key in sorted(RANGES) for bad in _bad_values(key)]


def _with(cfg: AnyrecConfig, key: str, value) -> AnyrecConfig:
    """A copy of `cfg` with the option at `key` set to `value`."""
    out = copy.deepcopy(cfg)
    *parents, name = key.split(".")
    node = out
    for part in parents:
        node = getattr(node, part)
    setattr(node, name, value)
    return out


@pytest.fixture(scope="module")
def default_config() -> AnyrecConfig:
    """The default job's typed config (composed once for the many cases below)."""
    return compose_config()[1]


@pytest.mark.parametrize(("key", "bad"), CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_every_numeric_option_out_of_range_is_one_line_naming_it(key, bad, default_config):
    cfg = default_config
    check_values(cfg)  # the defaults are in range
    is_list = isinstance(functools.reduce(getattr, key.split("."), cfg), list)
    value = [bad] if is_list else bad
    with pytest.raises(ValueError) as e:
        check_values(_with(cfg, key, value))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{key} must be ")
    assert RANGES[key].describe() in message and message.endswith(f"got {value}")


@pytest.mark.parametrize(("override", "message"), [
    ("planner.replica_sync_every=0", "planner.replica_sync_every must be >= 1, got 0"),
    ("planner.replica_sync_every=-1", "planner.replica_sync_every must be >= 1, got -1"),
    ("model.table_rows=[]", "model.table_rows must be a non-empty list, each >= 1, got []"),
    ("model.bottom_mlp=[16,0]", "model.bottom_mlp must be a list, each >= 1, got [16, 0]"),
    ("trainer.collective_timeout_s=nan", "trainer.collective_timeout_s must be a positive number of "
                                         "seconds (at most 1e+06), got nan"),
    ("optim.betas=[0.9,1.0]", "optim.betas must be a list, each in [0, 1), got [0.9, 1.0]"),
])
def test_ranges_are_checked_when_the_typed_config_is_built(override, message):
    # the one place every entry point passes: building the typed config (and before its run folder)
    with pytest.raises(ValueError) as e:
        compose_config(["model=dlrm_tiny", override])
    assert str(e.value) == message
    assert cli_problem(["model=dlrm_tiny", override]) == message


@pytest.mark.parametrize(("override", "message"), [
    ("data.sequence.num_windows=0", "data.sequence.num_windows must be >= 1, got 0"),
    ("data.sequence.num_windows=two", "data.sequence.num_windows must be an integer, got 'two'"),
    ("data.sequence.max_seq_len=9",
     "data.sequence.max_seq_len must be >= 10 (8 contextual tokens, a candidate and some history), got 9"),
    ("+data.sequence.table_scale=0.5", "data.sequence.table_scale is not an option of a sequence source; its "
                                       "options: events_per_user_day, history_days, history_per_pool, "
                                       "mapping_path, max_seq_len, min_history, num_tastes, num_windows, "
                                       "path, rows_per_read, scan_window, window_seconds, zipf_exponent"),
])
def test_a_sequence_sources_options_are_checked_with_the_others(override, message):
    """`data.sequence` is checked where the typed config is built, as every other option: a bad one stops
    the job before its first-contact calibration measures or writes anything."""
    with pytest.raises(ValueError) as e:
        compose_config(["model=dlrmv4_small", override])
    assert str(e.value) == message
    assert cli_problem(["model=dlrmv4_small", override]) == message


@pytest.mark.parametrize("value", ["0", "-1"])
def test_plan_refuses_a_bad_replica_sync_in_one_line_exit_2(value, tmp_path, capfd):
    from anyrec import plan

    run_dir = tmp_path / "run"
    argv = ["planner.sharding_group_size=2", "topology.world_size=4", f"planner.replica_sync_every={value}",
            f"hydra.run.dir={run_dir}"]
    with pytest.raises(SystemExit) as e:
        _hydra.launch("anyrec-plan", plan.main, argv)
    assert e.value.code == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"anyrec-plan: error: planner.replica_sync_every must be >= 1, got {value}"]
    assert not run_dir.exists()  # refused before the run folder is made


def test_train_refuses_empty_tables_in_one_line_before_any_data(tmp_path, capfd):
    from anyrec import train

    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        _hydra.launch("anyrec-train", train.main, ["model=dlrm_tiny", "model.table_rows=[]",
                                                   f"hydra.run.dir={run_dir}"])
    assert e.value.code == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        "anyrec-train: error: model.table_rows must be a non-empty list, each >= 1, got []"]
    assert not run_dir.exists()


ENV_LINE = ("trainer.calibrate: Invalid value 'bogus', expected one of [auto, always, never] (the "
            "environment variable ANYREC_CALIBRATE, through ${oc.env:ANYREC_CALIBRATE,auto})")


def test_a_bad_value_through_an_environment_variable_is_one_line(monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("ANYREC_CALIBRATE", "bogus")
    with pytest.raises(ValueError) as e:
        compose_config(["model=dlrm_tiny"])
    assert str(e.value) == ENV_LINE
    assert cli_problem(["model=dlrm_tiny"]) == ENV_LINE
    from anyrec import plan

    with pytest.raises(SystemExit) as exit_:
        _hydra.launch("anyrec-plan", plan.main, ["model=dlrm_tiny", f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_.value.code == 2
    assert capfd.readouterr().err.strip().splitlines() == [f"anyrec-plan: error: {ENV_LINE}"]
    monkeypatch.setenv("ANYREC_CALIBRATE", "always")
    assert compose_config(["model=dlrm_tiny"])[1].trainer.calibrate == "always"


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.steps=many", "trainer.steps: Value 'many' of type 'str' could not be converted to Integer"),
    ("optim.dense_lr=fast", "optim.dense_lr: Value 'fast' of type 'str' could not be converted to Float"),
])
def test_bad_override_value_is_one_line(override, message):
    assert cli_problem(["model=dlrm_tiny", override]) == message
    assert cli_problem(["model=dlrm_tiny", "trainer.steps=3"]) is None


@pytest.mark.integration
def test_bad_override_value_exits_2_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "anyrec.train", "trainer.steps=many"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "anyrec-train: error: trainer.steps: Value 'many' of type 'str' could not be converted to Integer"]
    assert not (tmp_path / "outputs").exists()  # refused before any run directory is made


@pytest.mark.parametrize("key", ["model.interaction", "data.on_malformed", "data.dense_transform",
                                 "backend.sparse_ops", "planner.name", "planner.sharding", "optim.name",
                                 "trainer.mixed_precision"])
def test_closed_choices_fail_at_compose_time(key):
    """An enum field refuses a value outside its choices while composing, naming the choices."""
    with pytest.raises(ConfigCompositionException):
        compose_config([f"{key}=bf61"])
    assert cli_problem([f"{key}=bf61"]).startswith(f"{key}: Invalid value 'bf61', expected one of [")


def test_closed_choices_compare_as_their_strings():
    _, cfg = compose_config(["trainer.mixed_precision=bf16", "optim=rowwise_adagrad",
                             "planner.sharding=row_wise"])
    assert cfg.trainer.mixed_precision == "bf16" and f"{cfg.optim.name}" == "rowwise_adagrad"
    assert str(cfg.planner.sharding) == "row_wise"
