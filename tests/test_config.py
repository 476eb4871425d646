"""Every config group composes and validates against the schema; bad keys fail clearly."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError

from anyrec.config import AnyrecConfig, config_dir

from .conftest import compose_config

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
