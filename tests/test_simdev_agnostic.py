"""The device-agnostic pieces anyrec needed to train on a device that is neither cpu nor cuda (found by
the simdev bring-up, tests/test_simdev.py), checked in process without the plugin."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

from anyrec.backends import get_backend, resolve_hardware
from anyrec.backends.cpu import CPUBackend
from anyrec.backends.dispatch import TORCH_EMBEDDING
from anyrec.backends.specs import SKUS
from anyrec.kernels.torchrec_kernel import TorchDenseTBE
from anyrec.models.dlrm import DLRMTrain, build_model, workload_facts
from anyrec.planner.planned import plan_job
from anyrec.planner.types import Topology
from anyrec.trainer.planning import place_shards

from .conftest import compose_config


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
    plan = plan_job(cfg, DLRMTrain(model), model.sparse_arch, "model.sparse_arch", workload_facts(cfg.model),
                    resolve_hardware("cpu", {}, cpu), TORCH_EMBEDDING, 2, 2, cfg.data.batch_size,
                    cpu.device_type).plan
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


@pytest.mark.parametrize("planner", ["simple", "codesign"])
def test_forcing_data_parallel_on_an_implementation_without_it_is_refused_at_planning(planner):
    _, cfg = compose_config(["model=dlrm_tiny", f"planner={planner}", "planner.sharding=data_parallel"])
    meta, cpu = torch.device("meta"), get_backend("cpu")
    no_dp = dataclasses.replace(TORCH_EMBEDDING, data_parallel=False)
    with pytest.raises(ValueError) as e:
        plan_job(cfg, DLRMTrain(model := build_model(cfg.model, meta, ebc_device=meta)), model.sparse_arch,
                 "model.sparse_arch", workload_facts(cfg.model),
                 resolve_hardware("cpu", {}, cpu), no_dp, 2, 2, cfg.data.batch_size, cpu.device_type)
    assert str(e.value) == "planner.sharding=data_parallel cannot run with backend.embedding_kernel=torch"


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_data_parallel_tables_get_fbgemms_dense_outputs_and_gradients_from_the_torch_tbe(pooling):
    """The `dense` kernel without FBGEMM (TorchDenseTBE) against FBGEMM's dense TBE: bit for bit with
    sum pooling (DLRM's); mean scales each row before summing, as the torch TBE's sharded tables do."""
    specs, ftm, batch = [(50, 8), (7, 4), (30, 8)], [0, 1, 2, 0], 5
    mode = PoolingMode.SUM if pooling == "sum" else PoolingMode.MEAN
    ref = DenseTableBatchedEmbeddingBagsCodegen(specs, feature_table_map=ftm, pooling_mode=mode, use_cpu=True)
    ours = TorchDenseTBE(specs, ftm, pooling, torch.float32, torch.float32, "error", torch.device("cpu"))
    with torch.no_grad():
        ours.weights.copy_(ref.weights)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 5, (len(ftm) * batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    rows = torch.tensor([specs[ftm[i // batch]][0] for i in range(len(ftm) * batch)])
    rows = rows.repeat_interleave(lengths)
    indices = (torch.rand(len(rows), generator=g) * rows).long()
    out_ref, out = ref(indices, offsets), ours(indices, offsets)
    same = torch.equal if pooling == "sum" else lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    assert int(lengths.min()) == 0 and same(out, out_ref)  # empty bags included
    grad = torch.randn(out.shape, generator=g)
    out_ref.backward(grad)
    out.backward(grad)
    assert ours.weights.grad.count_nonzero() > 0 and same(ours.weights.grad, ref.weights.grad)
