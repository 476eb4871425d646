"""The trainer's planning (anyrec/trainer/planning.py), in process: both planners plan the real model's
tables, and a forced sharding that would change the embedding optimizer's update fails in one line."""

from __future__ import annotations

import pytest
import torch

from anyrec.backends import get_backend, resolve_hardware
from anyrec.backends.dispatch import FBGEMM_EMBEDDING
from anyrec.models.dlrm import build_model
from anyrec.trainer.distributed import DistInfo
from anyrec.trainer.planning import plan_sharding

from .conftest import compose_config

INFO = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2)
WIDE = ["model=dlrm_tiny", "model.embedding_dim=32", "model.bottom_mlp=[16,32]", "hardware=cpu"]


def _plan(overrides: list[str]):
    _, cfg = compose_config(WIDE + overrides)
    meta = torch.device("meta")
    model = build_model(cfg.model, meta, ebc_device=meta)
    backend = get_backend("cpu")
    hardware = resolve_hardware(cfg.hardware.sku, cfg.hardware.spec, backend, cfg.hardware.measurements)
    plan = plan_sharding(cfg, backend, INFO, model, "model.sparse_arch", FBGEMM_EMBEDDING, hardware)
    return model, plan.plan["model.sparse_arch"]


@pytest.mark.parametrize("planner", ["codesign", "simple"])
def test_forced_column_wise_with_rowwise_adagrad_is_refused(planner):
    _, per_table = _plan([f"planner={planner}", "planner.sharding=column_wise", "optim=adagrad"])
    assert {ps.sharding_type for ps in per_table.values()} == {"column_wise"}  # allowed for adagrad
    with pytest.raises(ValueError, match="^planner.sharding=column_wise: column_wise sharding cannot train "
                                         "optim=rowwise_adagrad exactly") as e:
        _plan([f"planner={planner}", "planner.sharding=column_wise", "optim=rowwise_adagrad"])
    assert "\n" not in str(e.value)


def test_codesign_plans_the_models_own_tables():
    model, per_table = _plan(["planner=codesign", "optim=rowwise_adagrad"])
    assert set(per_table) == {c.name for c in model.sparse_arch.embedding_bag_configs()}
