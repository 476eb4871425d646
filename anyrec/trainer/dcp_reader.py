"""Reading a torch.distributed.checkpoint (DCP) directory without running code from it.

DCP's index of the shard files (`.metadata`) is a pickle, and its default load planner unpickles
non-tensor entries with `torch.load(weights_only=False)`: either runs whatever code a forged file
carries. `SafeReader` unpickles the index admitting only the classes DCP writes there (its metadata
dataclasses, torch sizes, dtypes and layouts, a path); `SafeLoadPlanner` reads non-tensor entries
with `torch.load(weights_only=True)`. Anything else is refused in one line naming the global.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# What DCP pickles into `.metadata` (torch/distributed/checkpoint/metadata.py and filesystem.py).
ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset({"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                              "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                              "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),  # dtypes: checked by value below
    "torch.serialization": frozenset({"_get_layout"}),  # looks a layout up by name, nothing else
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),  # StorageMeta.checkpoint_id
    "collections": frozenset({"OrderedDict"}),
}


class UnsafePickleError(ValueError):
    """A pickle referring to a global outside what DCP writes."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only `ALLOWED_GLOBALS` and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePickleError(f"it refers to {module}.{name}, which a checkpoint index never holds "
                                "(a forged file?)")


def load_metadata(stream: io.BufferedIOBase) -> Metadata:
    """DCP metadata unpickled with `RestrictedUnpickler`; UnsafePickleError in one line otherwise."""
    try:
        metadata = RestrictedUnpickler(stream).load()
    except UnsafePickleError:
        raise
    except Exception as e:  # a damaged pickle raises whatever its bytes happen to trigger
        raise UnsafePickleError(f"not a valid checkpoint index ({type(e).__name__})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafePickleError(f"not a checkpoint index (a {type(metadata).__name__})")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader with `.metadata` read by `load_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, non-tensor entries read with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
