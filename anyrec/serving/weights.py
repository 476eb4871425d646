"""A trained model, unsharded, from a checkpoint written at any world size and plan.

The checkpoint is checked as the trainer checks one before resuming (meta.json's signature against this
model, every file's size and SHA-256, the signing key where one is set) by `CheckpointManager.read_meta`;
torch.distributed.checkpoint then reads it into plain tensors in one process (it reassembles row- and
column-wise shards, of pooled and sequence tables alike), its index unpickled by the restricted reader
(`anyrec.trainer.dcp_reader`). The model is rebuilt with the portable implementations its family's export
signature names (`ExportSignature.load_kernels`)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from anyrec.backends.dispatch import get_impl
from anyrec.config import CheckpointConfig, ModelConfig
from anyrec.models.family import ModelFamily
from anyrec.runtime.distributed import ONE_PROCESS
from anyrec.runtime.errors import CheckpointError
from anyrec.serving.model import TablePrecision, table_bytes
from anyrec.signing import SigningKey
from anyrec.trainer.checkpoint import CheckpointManager
from anyrec.trainer.lineage import META, read_meta_file, scan


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A trained model (its scoring part: `ModelFamily.scoring_module`) and where it came from."""

    model: nn.Module
    path: Path
    step: int
    sha256: dict[str, str]  # file name -> SHA-256, as meta.json records (and the load checked)
    world_size: int | None  # the world size that wrote it
    lineage: str | None


def find_checkpoint(path: Path) -> Path:
    """`path` when it is a checkpoint (`step_<n>/`), else the newest complete one in it."""
    if (path / META).is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"export.checkpoint {path}: no such folder")
    found = scan(path)
    if not found:
        raise ValueError(f"export.checkpoint {path}: no checkpoint there (a step_<n> folder with meta.json, "
                         "or the trainer.checkpoint.dir holding them)")
    return found[-1].path


def host_memory_bytes() -> int:
    """This host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def export_memory_bytes(model: ModelConfig, family: ModelFamily, precision: TablePrecision) -> int:
    """Host memory an export of `model` holds at its peak: the fp32 tables read from the checkpoint plus
    their copy at `precision` (the dense part is small beside them)."""
    return sum(table_bytes(rows, dim, TablePrecision.fp32) + table_bytes(rows, dim, precision)
               for rows, dim in family.table_shapes(model).values())


def check_fits(need_bytes: int, what: str, host_bytes: int) -> None:
    """ValueError naming the size needed when `need_bytes` exceeds this host's `host_bytes`."""
    if need_bytes > host_bytes:
        raise ValueError(f"{what} needs {need_bytes / 2**30:.2f} GiB of host memory, this host has "
                         f"{host_bytes / 2**30:.2f} GiB: the tables do not fit one host")


def _signature(train: nn.Module, model: ModelConfig, family: ModelFamily, optimizer: Any) -> dict[str, Any]:
    """What the trainer's signature of this model is (`Trainer.signature`), with the saved optimizer (the
    optimizer's state is not read)."""
    tables = family.table_shapes(model)
    dense = {n: list(p.shape) for n, p in train.named_parameters() if "sparse_arch" not in n}
    return {"tables": tables, "dense": dense, "optimizer": optimizer}


def load_checkpoint(path: Path, model: ModelConfig, family: ModelFamily,
                    signing_key: SigningKey | None = None) -> LoadedCheckpoint:
    """The unsharded model `model` (of `family`) with the weights of checkpoint `path` (a step folder or the
    folder of them), on the CPU; ValueError (CheckpointError) in one line when it is not this model's or
    damaged, or the family exports nothing."""
    path = find_checkpoint(Path(path))
    cpu = torch.device("cpu")
    export = family.export_signature()  # a family without a scoring artifact fails before reading anything
    kernels = {op: get_impl(op, name) for op, name in export.load_kernels.items()}
    train = family.build_train(model, cpu, cpu, kernels)
    saved = read_meta_file(path)
    optimizer = saved["signature"].get("optimizer") if isinstance(saved["signature"], dict) else None
    manager = CheckpointManager(CheckpointConfig(dir=str(path.parent), verify=True),
                                _signature(train, model, family, optimizer), ONE_PROCESS,
                                signing_key=signing_key)
    try:
        meta = manager.read_meta(path)
    except CheckpointError as e:
        if "here" not in str(e):  # damaged, unsigned, ...: nothing to add
            raise
        raise CheckpointError(f"{e} (model={model.name} here: give the run's model overrides)") from None
    state = {"model": train.state_dict()}
    with warnings.catch_warnings():  # one process on purpose: DCP's warning that it assumes so says nothing
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        manager.load(path, state)
    train.load_state_dict(state["model"])
    run = meta.get("run") if isinstance(meta.get("run"), dict) else {}
    return LoadedCheckpoint(export.part(train).eval(), path, int(meta["step"]),
                            dict(meta["sha256"]), meta.get("world_size"), run.get("lineage"))
