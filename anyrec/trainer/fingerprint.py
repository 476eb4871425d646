"""A SHA-256 of a model's full weights, the same whatever the sharding plan and world size."""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from anyrec.models.init import dtensor_shards
from anyrec.runtime.distributed import DistInfo, gather_objects

# name -> [(offsets of a piece in the full tensor, the piece)]
Pieces = dict[str, list[tuple[list[int], torch.Tensor]]]


def _local_pieces(model: nn.Module, is_main: bool) -> tuple[Pieces, dict[str, list[int]]]:
    """This rank's pieces of every state_dict entry (unsharded ones from rank 0 only) and full sizes."""
    local: Pieces = {}
    sizes: dict[str, list[int]] = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):  # 2D parallelism's tables: every replica holds the same pieces
            sizes[name] = list(value.size())
            local[name] = [(list(o), t.detach().cpu()) for t, o in dtensor_shards(value)]
        elif isinstance(value, ShardedTensor):
            sizes[name] = list(value.size())
            local[name] = [(list(s.metadata.shard_offsets), s.tensor.detach().cpu())
                           for s in value.local_shards()]
        else:
            sizes[name] = list(value.shape)
            local[name] = [([0] * value.dim(), value.detach().cpu())] if is_main else []
    return local, sizes


def full_state(model: nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """Every state_dict entry whole, in fp64 (exact for fp32 and bf16), by name, on every rank (all
    shards gathered to every rank: test-sized models only)."""
    local, sizes = _local_pieces(model, info.is_main)
    gathered = gather_objects(local, info)
    out = {}
    for name in sorted(sizes):
        full = torch.zeros(sizes[name], dtype=torch.float64)
        for part in gathered:
            for offsets, t in part.get(name, []):
                full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape, strict=True))] = t.double()
        out[name] = full
    return out


def weights_fingerprint(model: nn.Module, info: DistInfo) -> str:
    """SHA-256 of every full weight tensor (`full_state`; opt-in via trainer.fingerprint_weights)."""
    h = hashlib.sha256()
    for name, full in full_state(model, info).items():
        h.update(name.encode())
        h.update(full.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
