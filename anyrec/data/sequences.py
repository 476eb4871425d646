"""Sequence batches for DLRMv4 (HSTU): the batch type, its data config, and what every sequence source
shares: gathering an anchor's history causally, the candidate's hashed crosses, assembling a batch.

A sample is one anchor event (the candidate) of a user. Its history holds, from the user's events
strictly before the anchor's timestamp, the most recent `history_per_pool` events of each of three pools
(listen_plus, like, skip), merged back in time order and cut to the most recent `max_seq_len - 9`
(8 contextual tokens and 1 candidate share the budget), as the MLPerf reference gathers it.

Sources stream 1-day windows in wall-clock order: train on window T, evaluate on window T + 1. Every source
answers `num_windows()`, `train_batches(window, start)` (this rank's batches, from batch `start`: a resume
mid-window sees the batches an uninterrupted run would) and `eval_batches(window)` (every anchor of the
window once, over all ranks; every rank yields the same number of batches, the last ones padded with
padding samples: uid 0, an empty sequence and no target).
Legend: B samples, T sequence positions of the batch (sum of lengths), C contextual features (8).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from anyrec.sequence_schema import (
    CROSS_FEATURES,
    NUM_CONTEXTUAL,
    NUM_TARGETS,
    POOL_BITS,
    SEQUENCE_FEATURES,
    SequenceSchema,
)

LISTEN_PLUS, LIKE, SKIP, NO_POOL = 0, 1, 2, -1  # pool index of an event (NO_POOL: in no pool)


@dataclass
class SequenceBatch(Pipelineable):
    """One batch of B samples. `sparse_features` (the name torchrec's Batch and pipelines read) holds
    item_id, artist_id, album_id (the same lengths: history + num_targets, candidates last) and the 8
    contextual features (one id each); `actions` (pool bits: 1 listen_plus, 2 like, 4 skip; 0 for
    candidates) and `timestamps` (seconds) are per sequence position, aligned with each sequence
    feature's values; `labels` has one entry per target (1.0: the candidate was a listen_plus).
    A padding sample has uid 0, length 0 and no target."""

    sparse_features: KeyedJaggedTensor
    actions: torch.Tensor  # int64 [T]
    timestamps: torch.Tensor  # int64 [T]
    num_targets: torch.Tensor  # int64 [B]
    labels: torch.Tensor  # float32 [sum(num_targets)]
    window: int

    def to(self, device: torch.device, non_blocking: bool = False) -> SequenceBatch:
        return SequenceBatch(self.sparse_features.to(device=device, non_blocking=non_blocking),
                             self.actions.to(device=device, non_blocking=non_blocking),
                             self.timestamps.to(device=device, non_blocking=non_blocking),
                             self.num_targets.to(device=device, non_blocking=non_blocking),
                             self.labels.to(device=device, non_blocking=non_blocking), self.window)

    def record_stream(self, stream: torch.Stream) -> None:
        self.sparse_features.record_stream(stream)
        for t in (self.actions, self.timestamps, self.num_targets, self.labels):
            t.record_stream(stream)

    def map_tensors(self, fn: Callable[[Any], Any]) -> SequenceBatch:
        """The batch with `fn` applied to its KJT and each tensor: how a backend page-locks it
        (`Backend.pin`), which alone knows whether its device can."""
        return SequenceBatch(fn(self.sparse_features), fn(self.actions), fn(self.timestamps),
                             fn(self.num_targets), fn(self.labels), self.window)

    @property
    def batch_size(self) -> int:
        """Samples in the batch (padding included)."""
        return int(self.num_targets.numel())

    def sequence_lengths(self) -> torch.Tensor:
        """Positions of each sample's sequence (history + targets), [B]."""
        return self.sparse_features.lengths()[: self.batch_size]


class SequenceSource(Protocol):
    """What the trainer needs from a source of sequence batches (see the module doc)."""

    batch_size: int

    def num_windows(self) -> int: ...

    def train_batches(self, window: int, start: int = 0) -> Iterator[SequenceBatch]: ...

    def eval_batches(self, window: int) -> Iterator[SequenceBatch]: ...


def pools_of(event_type: np.ndarray, listen_plus: np.ndarray) -> np.ndarray:
    """Pool index of each event: LISTEN_PLUS, LIKE, SKIP or NO_POOL, from the reference's event types
    (0 listen, 1 like, 2 dislike, 3 unlike, 4 undislike) and whether a listen was played >= 50 %."""
    pool = np.full(event_type.shape, NO_POOL, dtype=np.int8)
    listen = event_type == 0
    pool[listen & listen_plus] = LISTEN_PLUS
    pool[listen & ~listen_plus] = SKIP
    pool[event_type == 1] = LIKE
    return pool


def history_positions(pool: np.ndarray, start: int, end: int, per_pool: int, budget: int) -> np.ndarray:
    """Positions in [start, end) of a user's time-ordered events that form a history: the last
    `per_pool` of each pool, ascending, then the last `budget` of those."""
    seg = pool[start:end]
    kept = [np.flatnonzero(seg == p)[-per_pool:] for p in (LISTEN_PLUS, LIKE, SKIP)]
    pos = np.sort(np.concatenate(kept))[-budget:] if budget > 0 else np.empty(0, dtype=np.int64)
    return pos + start


_P1, _P2, _P3 = np.uint64(0x9E3779B185EBCA87), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9)
_P4, _P5 = np.uint64(0x85EBCA77C2B2AE63), np.uint64(0x27D4EB2F165667C5)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def xxh64_int64s(lanes: list[np.ndarray], seed: int = 0) -> np.ndarray:
    """XXH64 (seed `seed`) of each row's values packed as little-endian int64 (fewer than 4 lanes: the
    short-input path), vectorised over rows; uint64."""
    if not 1 <= len(lanes) < 4:
        raise ValueError(f"xxh64_int64s takes 1 to 3 lanes, got {len(lanes)}")
    with np.errstate(over="ignore"):
        h = np.full(lanes[0].shape, np.uint64(seed) + _P5 + np.uint64(8 * len(lanes)), dtype=np.uint64)
        for lane in lanes:
            k = _rotl(np.asarray(lane, dtype=np.int64).view(np.uint64) * _P2, 31) * _P1
            h = _rotl(h ^ k, 27) * _P1 + _P4
        h ^= h >> np.uint64(33)
        h *= _P2
        h ^= h >> np.uint64(29)
        h *= _P3
        h ^= h >> np.uint64(32)
    return h


def contextual_ids(schema: SequenceSchema, anchor: Mapping[str, np.ndarray]) -> np.ndarray:
    """[B, C] contextual ids of B candidates: uid, then each cross hashed modulo its table's rows.
    `anchor` maps uid, item_id, artist_id, album_id, hour_of_day, is_organic to [B] int64 arrays."""
    cols = [np.asarray(anchor["uid"], dtype=np.int64)]
    for cross in CROSS_FEATURES:
        h = xxh64_int64s([anchor[f] for f in cross.fields], cross.salt)
        cols.append((h % np.uint64(schema.rows[cross.name])).astype(np.int64))
    return np.stack(cols, axis=1)


class BatchBuilder:
    """Collects samples (history and candidate) and assembles them into one SequenceBatch."""

    def __init__(self, schema: SequenceSchema) -> None:
        self.schema = schema
        self._seq: list[list[np.ndarray]] = [[] for _ in range(5)]  # item, artist, album, action, ts
        self._lengths: list[int] = []
        self._context: list[np.ndarray] = []
        self._labels: list[float] = []
        self._targets: list[int] = []

    def __len__(self) -> int:
        return len(self._lengths)

    def add(self, item: np.ndarray, artist: np.ndarray, album: np.ndarray, action: np.ndarray,
            ts: np.ndarray, candidate: tuple[int, int, int, int], context: np.ndarray, label: float) -> None:
        """One sample: history arrays (time order) and the candidate's (item, artist, album, timestamp),
        its C contextual ids and label."""
        ci, ca, cb, ct = candidate
        for buf, hist, cand in zip(self._seq, (item, artist, album, action, ts), (ci, ca, cb, 0, ct),
                                   strict=True):
            buf.append(np.asarray(hist, dtype=np.int64))
            buf.append(np.array([cand], dtype=np.int64))
        self._lengths.append(len(item) + NUM_TARGETS)
        self._context.append(np.asarray(context, dtype=np.int64))
        self._labels.append(label)
        self._targets.append(NUM_TARGETS)

    def add_padding(self) -> None:
        """A padding sample: uid 0, contextual ids 0, no positions, no target."""
        self._lengths.append(0)
        self._context.append(np.zeros(NUM_CONTEXTUAL, dtype=np.int64))
        self._targets.append(0)

    def build(self, window: int) -> SequenceBatch:
        """The batch of every sample added so far."""
        B = len(self._lengths)
        seq = [torch.from_numpy(np.concatenate(b)) if b else torch.empty(0, dtype=torch.int64)
               for b in self._seq]
        ctx = torch.from_numpy(np.stack(self._context, axis=1).reshape(-1))  # [C * B], key-major
        T = int(sum(self._lengths))
        lengths = torch.tensor(self._lengths * len(SEQUENCE_FEATURES) + [1] * (B * NUM_CONTEXTUAL),
                               dtype=torch.int32)
        length_per_key = [T] * len(SEQUENCE_FEATURES) + [B] * NUM_CONTEXTUAL
        offsets = [0]
        for n in length_per_key:
            offsets.append(offsets[-1] + n)
        features = KeyedJaggedTensor(keys=list(self.schema.features), values=torch.cat([*seq[:3], ctx]),
                                     lengths=lengths, stride=B, length_per_key=length_per_key,
                                     offset_per_key=offsets)
        return SequenceBatch(features, seq[3], seq[4], torch.tensor(self._targets, dtype=torch.int64),
                             torch.tensor(self._labels, dtype=torch.float32), window)


def action_bits(pool: np.ndarray) -> np.ndarray:
    """The action bitmask of history events from their pool index."""
    return np.asarray(POOL_BITS, dtype=np.int64)[pool]
