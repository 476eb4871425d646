"""The device-agnostic pieces anyrec needed to train on a device that is neither cpu nor cuda (found by
the simdev bring-up, tests/test_simdev.py), checked in process without the plugin."""

from __future__ import annotations

import pytest
import torch

from anyrec.backends import get_backend, resolve_hardware
from anyrec.backends.cpu import CPUBackend
from anyrec.backends.dispatch import TORCH_EMBEDDING
from anyrec.backends.specs import SKUS
from anyrec.models.dlrm import build_model
from anyrec.planner.types import Topology
from anyrec.trainer.distributed import DistInfo
from anyrec.trainer.planning import place_shards, plan_and_predict

from .conftest import compose_config

INFO = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2)


class IndexedDevice(CPUBackend):
    """A backend whose ranks train on `cuda:<local rank>` (only the names matter here)."""

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank)


def _placements(plan) -> dict[str, list[str]]:
    return {name: [str(s.placement) for s in ps.sharding_spec.shards]
            for name, ps in plan.plan["model.sparse_arch"].items() if ps.sharding_spec is not None}


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise"])
def test_shard_placements_name_the_device_each_rank_trains_on(sharding):
    _, cfg = compose_config(["model=dlrm_tiny", "planner=simple", f"planner.sharding={sharding}"])
    meta = torch.device("meta")
    cpu = get_backend("cpu")
    model = build_model(cfg.model, meta, ebc_device=meta)
    plan, _ = plan_and_predict(cfg, cpu, INFO, model, "model.sparse_arch", TORCH_EMBEDDING,
                               resolve_hardware("cpu", {}, cpu))
    before = _placements(plan)
    assert before and all(p.endswith("/cpu") for ps in before.values() for p in ps)  # unchanged on cpu
    after = _placements(place_shards(plan, IndexedDevice(), local_world_size=2))
    assert after.keys() == before.keys()
    for name, shards in after.items():
        for p, old in zip(shards, before[name], strict=True):
            rank = int(old.split("/")[0].removeprefix("rank:"))
            assert p == f"rank:{rank}/cuda:{rank}"


def test_topology_takes_any_device_type_as_compute_device():
    assert Topology(SKUS["h200"], 2, 2, "simdev").compute_device == "simdev"
    assert Topology(SKUS["cpu"], 2, 2, "cpu").compute_device == "cpu"
    with pytest.raises(ValueError, match="compute_device must be a torch device type"):
        Topology(SKUS["h200"], 2, 2, "CUDA:0")


def test_the_host_pins_no_memory_for_itself():
    assert CPUBackend().pins_host_memory() is False


def test_a_skus_offline_plan_assumes_its_own_device_type():
    """Without a backend to name it, a plan's compute device comes from the spec: host or accelerator."""
    assert Topology(SKUS["cpu"], 2).compute_device == "cpu"
    assert Topology(SKUS["h200"], 2).compute_device == Topology(SKUS["mi350x"], 2).compute_device == "cuda"
