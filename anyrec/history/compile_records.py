"""The compile records: what compiling the dense model cost and saved on this machine, per dense-model
shape, so `trainer.compile=auto` decides without compiling again.

A record lives in the cache folder (`$ANYREC_CACHE_DIR/compile/<key>.json`), named by `record_key`: the
device and software, how the host is shared, the dense model's shape and the batch. A record cut short,
made for another key or of another version is ignored, in one line; records are written whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from anyrec.config import ModelConfig
from anyrec.io_checks import atomic_write
from anyrec.safe_load import UnsafeFileError, load_json
from anyrec.signing import cache_dir

if TYPE_CHECKING:
    from anyrec.backends import Backend

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
MAX_RECORD_BYTES = 4096


@dataclass(frozen=True)
class CompileRecord:
    """One machine's measurement for one dense-model shape: seconds to compile (first calls included),
    and seconds per dense forward + backward, eager and compiled."""

    key: str
    compile_s: float
    eager_step_s: float
    compiled_step_s: float
    version: int = RECORD_VERSION

    @property
    def saving_per_step_s(self) -> float:
        """Seconds one dense step saves compiled (negative: compiled is slower)."""
        return self.eager_step_s - self.compiled_step_s


def record_key(backend: Backend, model: ModelConfig, batch_size: int, autocast: bool, local_world_size: int
               ) -> str:
    """The digest naming a record: the device and software, how the host is shared, the dense model's
    shape and the batch (what changes compile time or the dense step)."""
    parts = {"backend": backend.name, "device": backend.facts.device_name, "arch": backend.facts.arch,
             "torch": torch.__version__, "threads": torch.get_num_threads(), "local_ranks": local_world_size,
             "bottom_mlp": list(model.bottom_mlp), "top_mlp": list(model.top_mlp),
             "interaction": model.interaction, "dcn": [model.dcn_num_layers, model.dcn_low_rank],
             "dense": model.num_dense_features, "sparse": len(model.table_rows), "dim": model.embedding_dim,
             "batch": batch_size, "bf16": autocast}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def record_path(key: str, directory: Path | None = None) -> Path:
    """Where the record named `key` lives: `directory` (default: the cache folder) / compile / key.json."""
    return (directory or cache_dir()) / "compile" / f"{key}.json"


def read_record(path: Path, key: str) -> CompileRecord | None:
    """The record at `path` if it is whole, for `key` and of this version; None (said in one line) else."""
    if not path.exists():
        return None
    try:
        data = load_json(path, f"compile record {path}", max_bytes=MAX_RECORD_BYTES)
        record = CompileRecord(**data)
    except (UnsafeFileError, TypeError) as e:
        logger.warning("compile record ignored: %s", str(e).splitlines()[0])
        return None
    values = (record.compile_s, record.eager_step_s, record.compiled_step_s)
    if record.key != key or record.version != RECORD_VERSION or not all(
            isinstance(v, float | int) and v >= 0 for v in values):
        logger.warning("compile record ignored: %s is not a valid record for this job", path)
        return None
    return record


def write_record(path: Path, record: CompileRecord) -> None:
    """Write `record` whole or not at all (a rename; a link at `path` is replaced, never written through)."""
    with atomic_write(path) as f:
        json.dump(dataclasses.asdict(record), f)
