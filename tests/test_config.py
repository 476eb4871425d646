"""Every config group composes and validates against the schema; bad keys fail clearly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError

from anyrec._hydra import cli_problem
from anyrec.config import AnyrecConfig, check_values, config_dir

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


@pytest.mark.parametrize(("override", "message"), [
    ("topology.local_world_size=0", "topology.local_world_size must be >= 1, got 0"),
    ("plan.batch_size=0", "plan.batch_size must be >= 1, got 0"),
    ("trainer.checkpoint.keep=0", "trainer.checkpoint.keep must be >= 1"),
    ("trainer.collective_timeout_s=0", "trainer.collective_timeout_s must be a positive"),
    ("trainer.collective_timeout_s=nan", "trainer.collective_timeout_s must be a positive"),
])
def test_counts_must_be_positive(override, message):
    _, cfg = compose_config([override])
    with pytest.raises(ValueError, match=message):
        check_values(cfg)


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
