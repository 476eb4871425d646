"""The sequence batch, its schema, history gathering and the cross hash (anyrec/data/sequences.py,
anyrec/sequence_schema.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec.backends.cpu import CPUBackend
from anyrec.data.sequences import (
    LIKE,
    LISTEN_PLUS,
    NO_POOL,
    SKIP,
    BatchBuilder,
    contextual_ids,
    history_positions,
    pools_of,
    xxh64_int64s,
)
from anyrec.sequence_schema import (
    CONTEXTUAL_FEATURES,
    SEQUENCE_FEATURES,
    SequenceDataConfig,
    reference_schema,
)

SMALL = reference_schema().scaled(0.002)


def test_reference_and_scaled_schema():
    ref = reference_schema()
    assert [t.feature for t in ref.tables] == list(SEQUENCE_FEATURES + CONTEXTUAL_FEATURES)
    assert ref.rows["item_id"] == 9_390_624 and ref.rows["user_x_artist"] == 100_000_000
    assert sum(t.num_rows for t in ref.tables) == 293_051_712
    assert [t.table for t in ref.tables][:2] == ["t_item_id", "t_artist_id"]
    assert [t.sequence for t in ref.tables] == [True] * 3 + [False] * 8
    assert SMALL.num_users == 2000 and SMALL.rows["item_id"] == 18_782 and SMALL.rows["album_id"] == 6_736
    with pytest.raises(ValueError, match="scale"):
        ref.scaled(0)
    with pytest.raises(ValueError, match="missing tables"):
        type(ref)({"item_id": 10})


def test_xxh64_matches_the_reference_hash():
    # Values of xxhash.xxh64(seed).update(struct.pack('<Nq', *lanes)).intdigest() (xxHash 0.8.4).
    known = [(0, (5, 7), 13005378695035823755), (0, (123456789, 2), 5992797697121371989),
             (0, (-3, 2**62), 17097832319105165110), (7, (1, 2, 3), 1390864660096451405),
             (0, (999, 13, 23), 5126715182410833772), (3, (42,), 15577664625241911667)]
    for seed, lanes, want in known:
        got = xxh64_int64s([np.array([x, x]) for x in lanes], seed)
        assert got.tolist() == [want, want]


def test_contextual_ids_are_uid_then_crosses_in_range():
    B = 64
    rng = np.random.default_rng(0)
    anchor = {"uid": rng.integers(1, 2000, B), "item_id": rng.integers(0, 18_000, B),
              "artist_id": rng.integers(0, 2500, B), "album_id": rng.integers(0, 6000, B),
              "hour_of_day": rng.integers(0, 24, B), "is_organic": rng.integers(0, 2, B)}
    ids = contextual_ids(SMALL, anchor)
    assert ids.shape == (B, 8) and (ids[:, 0] == anchor["uid"]).all()
    for j, name in enumerate(CONTEXTUAL_FEATURES[1:], 1):
        assert 0 <= ids[:, j].min() and ids[:, j].max() < SMALL.rows[name]
    assert len(np.unique(ids[:, 1])) > B // 2  # a hash, not a constant
    h = xxh64_int64s([anchor["uid"][:1], anchor["artist_id"][:1]])[0]
    want = int(h % np.uint64(SMALL.rows["user_x_artist"]))
    assert ids[0, 1] == want


def test_pools_follow_the_reference_event_types():
    etype = np.array([0, 0, 1, 2, 3, 4, 0])
    lp = np.array([True, False, False, True, True, True, True])
    assert pools_of(etype, lp).tolist() == [LISTEN_PLUS, SKIP, LIKE, NO_POOL, NO_POOL, NO_POOL, LISTEN_PLUS]


def test_history_keeps_the_last_events_of_each_pool_in_time_order():
    pool = np.array([0, 2, 0, 1, 0, 2, -1, 0, 2, 1])
    pos = history_positions(pool, 0, 9, per_pool=2, budget=100)
    assert pos.tolist() == [3, 4, 5, 7, 8]  # listen_plus 4, 7; like 3; skip 5, 8; position 9 is not before 9
    assert history_positions(pool, 0, 9, per_pool=2, budget=3).tolist() == [5, 7, 8]
    assert history_positions(pool, 5, 9, per_pool=5, budget=100).tolist() == [5, 7, 8]
    assert history_positions(pool, 0, 0, per_pool=5, budget=100).tolist() == []


def test_batch_layout_and_pipelineable():
    builder = BatchBuilder(SMALL)
    ctx = np.arange(8)
    builder.add(np.array([5, 6]), np.array([1, 1]), np.array([2, 3]), np.array([1, 4]), np.array([10, 20]),
                (7, 2, 4, 30), ctx, 1.0)
    none = np.array([], dtype=np.int64)
    builder.add(none, none, none, none, none, (9, 3, 5, 40), ctx + 10, 0.0)
    builder.add_padding()
    b = builder.build(window=4)
    kjt = b.sparse_features.to_dict()
    assert b.sparse_features.keys() == list(SEQUENCE_FEATURES + CONTEXTUAL_FEATURES)
    assert kjt["item_id"].lengths().tolist() == [3, 1, 0] and kjt["album_id"].lengths().tolist() == [3, 1, 0]
    assert kjt["item_id"].values().tolist() == [5, 6, 7, 9]
    assert kjt["artist_id"].values().tolist() == [1, 1, 2, 3]
    assert kjt["uid"].values().tolist() == [0, 10, 0]
    assert kjt["user_x_artist_x_hour"].values().tolist() == [7, 17, 0]
    assert b.actions.tolist() == [1, 4, 0, 0] and b.timestamps.tolist() == [10, 20, 30, 40]
    assert b.num_targets.tolist() == [1, 1, 0] and b.labels.tolist() == [1.0, 0.0]
    assert b.labels.dtype == torch.float32 and b.actions.dtype == torch.int64 and b.window == 4
    assert b.batch_size == 3 and b.sequence_lengths().tolist() == [3, 1, 0]
    moved = b.to(torch.device("cpu"), non_blocking=True)
    assert moved.window == 4 and torch.equal(moved.sparse_features.values(), b.sparse_features.values())
    # a backend that page-locks host memory does so through map_tensors, every piece once
    seen = []

    class Pinning(CPUBackend):
        def pins_host_memory(self) -> bool:
            return True

        def pin(self, x):
            if isinstance(x, torch.Tensor | KeyedJaggedTensor):
                seen.append(type(x).__name__)
                return x
            return super().pin(x)

    pinned = Pinning().pin(b)
    assert seen == ["KeyedJaggedTensor"] + ["Tensor"] * 4 and pinned.window == 4
    assert torch.equal(pinned.labels, b.labels) and pinned is not b


def test_config_checks_its_ranges():
    assert SequenceDataConfig().history_budget == 256 - 9
    with pytest.raises(ValueError, match="max_seq_len"):
        SequenceDataConfig(max_seq_len=9)
    with pytest.raises(ValueError, match="batch_size"):
        SequenceDataConfig(batch_size=0)


def test_the_jobs_options_are_checked_by_name():
    """`data.sequence` as the job gives it: a key that is no option (a typo, or the tables' scale, which is
    the model's `model.hstu.table_scale`) is one line naming it, not a TypeError."""
    data = SequenceDataConfig.of({"num_windows": 3}, 16)
    assert (data.num_windows, data.batch_size) == (3, 16)
    with pytest.raises(ValueError, match=r"^data.sequence.table_scale is not an option .*: events_per_user"):
        SequenceDataConfig.of({"table_scale": 0.5, "num_windows": 3}, 16)
