"""The synthetic Yambda-shaped stream (anyrec/data/yambda_synthetic.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anyrec.data.sequences import LIKE, LISTEN_PLUS, SKIP
from anyrec.data.yambda_synthetic import DAY_S, EPOCH_S, SyntheticYambda, auc
from anyrec.sequence_schema import SequenceDataConfig, reference_schema

SCHEMA = reference_schema().scaled(0.0005)  # 500 users, 4,696 items
DATA = SequenceDataConfig(max_seq_len=40, history_per_pool=8, batch_size=32, num_windows=4, history_days=2,
                          events_per_user_day=12.0)


@pytest.fixture(scope="module")
def stream() -> SyntheticYambda:
    return SyntheticYambda(SCHEMA, DATA, seed=3)


def _same(a, b) -> bool:
    return (a.window == b.window and a.sparse_features.keys() == b.sparse_features.keys()
            and torch.equal(a.sparse_features.values(), b.sparse_features.values())
            and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
            and all(torch.equal(x, y) for x, y in zip((a.actions, a.timestamps, a.num_targets, a.labels),
                                                      (b.actions, b.timestamps, b.num_targets, b.labels),
                                                      strict=True)))


def test_pool_shares_are_the_references(stream):
    ev = stream.simulate(5)
    share = [float(np.mean(ev.pool == p)) for p in (LISTEN_PLUS, LIKE, SKIP)]
    assert abs(share[0] - 0.61) < 0.025 and abs(share[1] - 0.02) < 0.006 and abs(share[2] - 0.36) < 0.025
    assert (np.diff(ev.ts)[np.diff(ev.user) == 0] > 0).all()  # distinct, increasing seconds per user
    assert ev.ts.min() >= EPOCH_S + 5 * DAY_S and ev.ts.max() < EPOCH_S + 6 * DAY_S
    counts = np.bincount(ev.item, minlength=SCHEMA.rows["item_id"])
    assert np.sort(counts)[-10:].sum() > 20 * counts.mean() * 10  # a power law: a few items dominate


def test_catalogue_is_consistent(stream):
    cat = stream.catalogue
    album_artist = {}
    for album, artist in zip(cat.item_album, cat.item_artist, strict=True):
        assert album_artist.setdefault(album, artist) == artist  # album -> artist
    assert cat.item_artist.max() < SCHEMA.rows["artist_id"] and cat.item_album.max() < SCHEMA.rows["album_id"]


def test_batches_are_consistent_jagged_tensors(stream):
    for batch in [stream.train_batch(1, 0), stream.eval_batch(1, stream.num_eval_batches(1) - 1)]:
        kjt = batch.sparse_features.to_dict()
        L = kjt["item_id"].lengths()
        assert torch.equal(L, kjt["artist_id"].lengths()) and torch.equal(L, kjt["album_id"].lengths())
        for key in list(kjt)[3:]:
            assert kjt[key].lengths().tolist() == [1] * batch.batch_size
        T = int(L.sum())
        assert batch.actions.numel() == T and batch.timestamps.numel() == T
        assert int(L.max()) <= DATA.max_seq_len - 8 and batch.batch_size == DATA.batch_size
        assert batch.labels.numel() == int(batch.num_targets.sum())
        real = batch.num_targets > 0
        ends = torch.cumsum(L, 0)[real] - 1
        assert (batch.actions[ends] == 0).all()  # the candidate has no action
        hist = torch.ones(T, dtype=torch.bool)
        hist[ends] = False
        assert set(batch.actions[hist].tolist()) <= {1, 2, 4}
        assert torch.equal(kjt["uid"].values() == 0, ~real)  # padding samples, and only they, have uid 0


def test_history_is_causal_and_the_most_recent_per_pool(stream):
    window = 2
    batch = stream.eval_batch(window, 3)
    day = stream._get_day(stream.day_of(window))
    every = [stream.simulate(d) for d in range(day.day + 1)]  # the whole past, to check against
    L = batch.sequence_lengths().tolist()
    starts = np.cumsum([0, *L])
    assert min(L) < max(L) and max(L) > 1
    for b in range(batch.batch_size):
        ts = batch.timestamps[starts[b]:starts[b + 1]].numpy()
        anchor_ts, hist_ts = ts[-1], ts[:-1]
        assert (hist_ts < anchor_ts).all() and (np.diff(hist_ts) > 0).all()
        uid = int(batch.sparse_features["uid"].values()[b])
        # Expected: the user's events strictly before the anchor, last 8 per pool, in time order.
        user_ts = np.concatenate([e.ts[e.user == uid - 1] for e in every])
        user_pool = np.concatenate([e.pool[e.user == uid - 1] for e in every])
        before = user_ts < anchor_ts
        want = np.sort(np.concatenate([user_ts[before & (user_pool == p)][-8:] for p in range(3)]))[-31:]
        assert hist_ts.tolist() == want.tolist()
    assert any(len(x) and x[0] < EPOCH_S + day.day * DAY_S
               for x in np.split(batch.timestamps.numpy(), starts[1:-1]))  # histories reach earlier days


def test_labels_are_the_candidates_pool(stream):
    day = stream._get_day(stream.day_of(1))
    batch = stream.eval_batch(1, 0)  # eval order is user-major: anchors 0 .. B - 1 on one rank
    rows = day.anchors[:DATA.batch_size]
    assert batch.labels.tolist() == (day.events.pool[rows] == LISTEN_PLUS).astype(float).tolist()
    L = batch.sequence_lengths()
    cand = batch.sparse_features["item_id"].values()[torch.cumsum(L, 0) - 1]
    assert cand.tolist() == day.events.item[rows].tolist()
    assert 0.55 < float(np.mean(day.events.pool[day.anchors] == LISTEN_PLUS)) < 0.70


def test_same_seed_same_batches_and_resume(stream):
    again = SyntheticYambda(SCHEMA, DATA, seed=3)
    assert _same(stream.train_batch(2, 1), again.train_batch(2, 1))
    assert _same(next(iter(stream.train_batches(2, start=1))), again.train_batch(2, 1))
    other = SyntheticYambda(SCHEMA, DATA, seed=4)
    assert not torch.equal(other.train_batch(2, 1).sparse_features.values(),
                           stream.train_batch(2, 1).sparse_features.values())
    # Going back to an earlier window replays from day 0: the same batch again.
    assert _same(again.train_batch(0, 0), stream.train_batch(0, 0))


def test_world_size_leaves_samples_and_eval_window_unchanged():
    one = SyntheticYambda(SCHEMA, SequenceDataConfig(**{**DATA.__dict__, "batch_size": 64}), seed=3)
    two = [SyntheticYambda(SCHEMA, DATA, seed=3, rank=r, world_size=2) for r in range(2)]
    assert one.num_train_batches(1) == two[0].num_train_batches(1) == two[1].num_train_batches(1) > 0
    whole, halves = one.train_batch(1, 2), [s.train_batch(1, 2) for s in two]
    assert whole.labels.tolist() == halves[0].labels.tolist() + halves[1].labels.tolist()
    assert whole.timestamps.tolist() == halves[0].timestamps.tolist() + halves[1].timestamps.tolist()
    n = [list(s.eval_batches(2)) for s in two]
    assert len(n[0]) == len(n[1]) == one.num_eval_batches(2)
    labels_two = [x for i in range(len(n[0])) for r in range(2) for x in n[r][i].labels.tolist()]
    labels_one = [x for b in one.eval_batches(2) for x in b.labels.tolist()]
    assert labels_two == labels_one and len(labels_one) == one.num_anchors(2)
    assert one.hidden_auc(2) == two[1].hidden_auc(2)


def test_hidden_model_auc_is_reported_and_in_range(stream):
    a = stream.hidden_auc(1)
    assert 0.74 < a < 0.82
    day = stream._get_day(stream.day_of(1))
    assert a == auc(day.events.prob[day.anchors], day.events.pool[day.anchors] == LISTEN_PLUS)
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75


def test_memory_holds_one_day_and_capped_histories(stream):
    stream.train_batch(3, 0)
    day = stream._day
    assert day.day == stream.day_of(3)
    assert day.events.ts.min() >= EPOCH_S + day.day * DAY_S  # only this day's events are held
    hist = day.history
    per_user_pool = np.bincount(hist.user * 3 + hist.pool, minlength=3 * stream.num_users)
    assert per_user_pool.max() == DATA.history_per_pool  # capped, and the cap is reached
    assert hist.ts.max() < EPOCH_S + day.day * DAY_S


def test_bad_arguments():
    with pytest.raises(ValueError, match="outside the world"):
        SyntheticYambda(SCHEMA, DATA, seed=0, rank=2, world_size=2)
    s = SyntheticYambda(SCHEMA, DATA, seed=0)
    with pytest.raises(ValueError, match="outside the stream"):
        s.train_batch(DATA.num_windows, 0)
    with pytest.raises(ValueError, match="no training batch"):
        s.train_batch(0, s.num_train_batches(0))
