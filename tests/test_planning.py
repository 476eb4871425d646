"""The trainer's planning (anyrec/trainer/planning.py), in process: both planners plan the real model's
tables, and a forced sharding that would change the embedding optimizer's update fails in one line."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from anyrec.backends import get_backend, resolve_hardware
from anyrec.backends.dispatch import FBGEMM_EMBEDDING
from anyrec.models.dlrm import DLRMTrain, build_model, workload_facts
from anyrec.planner.planned import plan_job

from .conftest import compose_config

WIDE = ["model=dlrm_tiny", "model.embedding_dim=32", "model.bottom_mlp=[16,32]", "hardware=cpu"]


def _plan(overrides: list[str]):
    _, cfg = compose_config(WIDE + overrides)
    meta = torch.device("meta")
    model = build_model(cfg.model, meta, ebc_device=meta)
    backend = get_backend("cpu")
    hardware = resolve_hardware(cfg.hardware.sku, cfg.hardware.spec, backend, cfg.hardware.measurements)
    planned = plan_job(cfg, DLRMTrain(model), model.sparse_arch, "model.sparse_arch",
                       workload_facts(cfg.model), hardware, FBGEMM_EMBEDDING, 2, 2, cfg.data.batch_size,
                       backend.device_type)
    return model, planned.plan.plan["model.sparse_arch"]


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


class HostReads(TorchDispatchMode):
    """Host reads of tensor values (`.item()`, `bool(t)`, ...) while active, each as the innermost
    Python function that asked (C++ callers, e.g. DDP's reducer, show as `backward`)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(n in str(func) for n in ("_local_scalar_dense", "is_nonzero", "aten.nonzero", "aten.equal")):
            frames = [f.name for f in traceback.extract_stack()
                      if not any(k in f.filename for k in ("torch/utils", "torch/_dynamo", "torch/_compile",
                                                            "torch/_tensor.py", "torch/autograd"))]
            self.reads.append(frames[-3] if frames[-2] == "_get_value" else frames[-2])
        return func(*args, **(kwargs or {}))


def _trained_dense_weights(tmp_path, monkeypatch, wrapper=None) -> tuple[list, dict[str, torch.Tensor], list]:
    """Three steps of a one-rank sharded (fbgemm) trainer; `wrapper` replaces `dense_wrapper` if given.
    Returns the type names of the model's modules and its state_dict keys, the dense weights
    afterwards and the host reads of the third step."""
    from anyrec.trainer import planning
    from anyrec.trainer import trainer as trainer_module

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # set-then-delete: monkeypatch removes what Trainer sets
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    if wrapper is not None:
        monkeypatch.setattr(planning, "dense_wrapper", wrapper)
    _, cfg = compose_config(["model=dlrm_tiny", "trainer.progress=false", "trainer.tensorboard=false",
                             "data.batch_size=64", "trainer.steps=3", "trainer.eval_steps=0",
                             f"trainer.run_dir={tmp_path}"])
    trainer = trainer_module.Trainer(cfg)
    try:
        assert not trainer.unsharded
        batches = [trainer.train_data.batch(i) for i in range(3)]
        trainer.run_steps(2, iter(batches[:2]))
        with HostReads() as reads:
            trainer.run_steps(1, iter(batches[2:]))
        types = [type(m).__name__ for m in trainer.model.modules()] + list(trainer.model.state_dict())
        return types, {n: p.detach().clone() for n, p in trainer.model.named_parameters()
                       if "sparse_arch" not in n}, reads.reads
    finally:
        trainer.close()


def test_world_size_one_trains_without_ddp_and_the_same_weights(tmp_path, monkeypatch):
    """At world size 1 the dense modules are not wrapped in DDP (its all-reduce averages nothing), and
    three steps give bit-identical dense weights to the DDP-wrapped model. The step's only host reads
    are then torch Adagrad's step counters, one per dense parameter (DDP's reducer adds as many)."""
    types, weights, reads = _trained_dense_weights(tmp_path / "a", monkeypatch)
    assert "DistributedDataParallel" not in types, types
    assert reads == ["_single_tensor_adagrad"] * len(weights), reads
    ddp_types, ddp_weights, ddp_reads = _trained_dense_weights(tmp_path / "b", monkeypatch,
                                                               wrapper=lambda *_: None)
    assert "DistributedDataParallel" in ddp_types
    # checkpoints keep their keys: DistributedModelParallel's state_dict drops DDP's wrapper either way
    assert [k for k in types if "." in k] == [k for k in ddp_types if "." in k]
    assert len(ddp_reads) == 2 * len(weights), ddp_reads
    assert len(weights) > 0 and weights.keys() == ddp_weights.keys()
    for name, w in weights.items():
        assert torch.equal(w, ddp_weights[name]), name


def test_the_plan_is_costed_in_the_precision_the_step_runs(tmp_path, monkeypatch):
    """The trainer resolves `trainer.mixed_precision` once (Backend.dense_precision) and plans in it: on the
    CPU auto is fp32, and bf16 autocast (which the CPU has) plans the HSTU part's activations at 2 bytes."""
    from anyrec.config import Precision
    from anyrec.trainer.trainer import Trainer

    from .conftest import free_port

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    backend = get_backend("cpu")
    assert [backend.dense_precision(p) for p in Precision] == [Precision.fp32, Precision.bf16, Precision.fp32]
    planned = {}
    for choice in ("auto", "bf16"):
        _, cfg = compose_config(["model=dlrmv4_small", "hardware=cpu", "trainer.progress=false",
                                 "trainer.tensorboard=false", f"trainer.mixed_precision={choice}",
                                 f"trainer.run_dir={tmp_path / choice}"])
        trainer = Trainer(cfg)
        try:
            assert trainer.autocast == (choice == "bf16")
            planned[choice] = (trainer.planned.result.workload.options.dense_dtype,
                               trainer.predicted_memory[0].activation_bytes)
        finally:
            trainer.close()
    assert planned["auto"][0] == Precision.fp32 and planned["bf16"][0] == Precision.bf16
    assert planned["bf16"][1] < 0.9 * planned["auto"][1]  # the STU layers' and preprocessor's GEMM tensors


def test_anyrec_plan_costs_the_configured_precision_offline():
    """Planning a GPU offline, auto is bf16 (what the trainer runs there) and fp32 is costed as fp32."""
    from anyrec.plan import run
    from anyrec.planner.memory import predict_memory

    peaks = {}
    for choice in ("auto", "bf16", "fp32"):
        _, cfg = compose_config(["model=dlrmv4_small", "hardware=h100", "topology.world_size=2",
                                 f"trainer.mixed_precision={choice}"])
        result = run(cfg, print_fn=lambda _: None)
        peaks[choice] = max(m.activation_bytes for m in predict_memory(result))
    assert peaks["auto"] == peaks["bf16"] < 0.9 * peaks["fp32"]


def test_offline_auto_is_what_the_devices_spec_says_it_runs(tmp_path):
    """A device without bf16 autocast (its spec's auto_precision: fp32, as simdev's calibrated file says)
    is costed in fp32 under auto when planned offline, as its jobs run; a bad value is one line."""
    from anyrec.plan import run
    from anyrec.planner.memory import predict_memory

    def peak(*overrides: str) -> int:
        _, cfg = compose_config(["model=dlrmv4_small", "topology.world_size=2", *overrides])
        return max(m.activation_bytes for m in predict_memory(run(cfg, print_fn=lambda _: None)))

    fp32 = peak("hardware=h100", "trainer.mixed_precision=fp32")
    assert peak("hardware=h100", "+hardware.spec.auto_precision=fp32") == fp32
    assert peak("hardware=h100") < 0.9 * fp32
    sku = tmp_path / "dev.yaml"  # a hardware file such as a calibration writes
    sku.write_text("base: h100\nspec:\n  auto_precision: fp32\n")
    assert peak(f"hardware.sku={sku}") == fp32
    sku.write_text("base: h100\nspec:\n  auto_precision: fp16\n")
    with pytest.raises(ValueError, match=f"{sku}.*auto_precision must be one of bf16, fp32, got 'fp16'"):
        peak(f"hardware.sku={sku}")  # the file named
