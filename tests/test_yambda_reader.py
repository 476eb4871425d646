"""The Yambda reader (anyrec/data/yambda.py) on small files written in the reference's schema."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anyrec.data.yambda import MalformedRowError, YambdaReader
from anyrec.sequence_schema import SequenceDataConfig, reference_schema

SCHEMA = reference_schema().scaled(0.0005)
DAY = 86_400
T0 = 1_000_000  # the first session's second

SESSIONS_SCHEMA = pa.schema([
    ("uid", pa.uint32()), ("session_id", pa.uint32()), ("item_ids", pa.list_(pa.uint32())),
    ("timestamps", pa.list_(pa.uint32())), ("event_types", pa.list_(pa.uint8())),
    ("is_organic", pa.list_(pa.uint8())), ("played_ratio_pct", pa.list_(pa.uint16())),
    ("track_length_seconds", pa.list_(pa.uint32())),
])


def _session(uid, sid, events):
    """events: (item, ts, type, played or None, organic)."""
    item, ts, et, played, org = (list(x) for x in zip(*events, strict=True))
    return {"uid": uid, "session_id": sid, "item_ids": item, "timestamps": ts, "event_types": et,
            "is_organic": org, "played_ratio_pct": played, "track_length_seconds": [180] * len(item)}


def _write(root: Path, rows: list[dict], row_group_size: int = 2) -> Path:
    processed, meta = root / "processed_5b", root / "shared_metadata"
    processed.mkdir(parents=True, exist_ok=True)
    meta.mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=SESSIONS_SCHEMA), processed / "train_sessions.parquet",
                   row_group_size=row_group_size)
    items = np.arange(100)
    for name, per in (("artist_id", 10), ("album_id", 5)):
        table = pa.table({"item_id": pa.array(items, pa.uint32()), name: pa.array(items // per, pa.uint32())})
        pq.write_table(table, meta / f"{name.split('_')[0]}_item_mapping.parquet")
    return processed


def _rows():
    """Two users over three days; user 1's listens alternate listen_plus / skip, with a like and a dislike."""
    rows = []
    for uid in (1, 2):
        for day in range(3):
            ev = []
            for k in range(6):
                t = T0 + day * DAY + 3600 * uid + 60 * k
                item = (uid * 7 + day * 3 + k) % 100
                if k == 2:
                    ev.append((item, t, 1, None, 0))  # like
                elif k == 4 and uid == 2:
                    ev.append((item, t, 2, None, 1))  # dislike: in no pool
                else:
                    ev.append((item, t, 0, 90 if k % 2 == 0 else 20, k % 2))
            rows.append(_session(uid, day, ev))
    return rows


def _samples(batches):
    for b in batches:
        L = b.sequence_lengths().tolist()
        starts = np.cumsum([0, *L])
        label = iter(b.labels.tolist())
        for i, n in enumerate(L):
            if n == 0:
                continue
            sl = slice(starts[i], starts[i + 1])
            yield {"uid": int(b.sparse_features["uid"].values()[i]), "ts": b.timestamps[sl].tolist(),
                   "item": b.sparse_features["item_id"].values()[sl].tolist(),
                   "artist": b.sparse_features["artist_id"].values()[sl].tolist(),
                   "album": b.sparse_features["album_id"].values()[sl].tolist(),
                   "actions": b.actions[sl].tolist(), "label": next(label)}


def test_reads_windows_causally_as_the_reference(tmp_path):
    processed = _write(tmp_path, _rows())
    data = SequenceDataConfig(max_seq_len=20, history_per_pool=2, batch_size=4, rows_per_read=2,
                              path=str(processed))
    reader = YambdaReader(SCHEMA, data)
    first = T0 + 3600 + 60  # user 1's second event: the first listen with an earlier event
    assert reader.anchor_span()[0] == first and reader.num_windows() == 3
    samples = list(_samples(reader.eval_batches(1)))
    lo, hi = reader.window_bounds(1)
    # The window [first + 1 day, first + 2 days) holds user 1's listens of day 1 from its 2nd event and
    # of day 2 its first (5), and user 2's listens of day 1 (4: one of its events is a dislike).
    assert all(lo <= s["ts"][-1] < hi for s in samples) and len(samples) == 9
    for s in samples:
        hist_ts, hist_actions = s["ts"][:-1], s["actions"][:-1]
        assert all(t < s["ts"][-1] for t in hist_ts) and hist_ts == sorted(hist_ts)
        assert s["actions"][-1] == 0 and set(hist_actions) <= {1, 2, 4}
        for bit in (1, 2, 4):
            assert hist_actions.count(bit) <= 2  # history_per_pool
        assert s["artist"] == [i // 10 for i in s["item"]] and s["album"] == [i // 5 for i in s["item"]]
    # user 1, day 1, event 1 (a skip): history = last 2 listen_plus, last like, last 2 skips before it.
    s = next(x for x in samples if x["uid"] == 1 and x["ts"][-1] == T0 + DAY + 3600 + 60)
    assert s["label"] == 0.0
    day0 = T0 + 3600
    assert s["ts"][:-1] == [day0 + 120, day0 + 180, day0 + 240, day0 + 300, T0 + DAY + 3600]
    assert s["actions"][:-1] == [2, 4, 1, 4, 1]
    labels = [x["label"] for x in samples if x["uid"] == 1]
    played = {0: 1.0, 1: 0.0, 3: 0.0, 4: 1.0, 5: 0.0}
    assert labels == [played[k] for k in (1, 3, 4, 5)] + [1.0]


def test_ranks_split_global_batches_and_training_drops_the_remainder(tmp_path):
    processed = _write(tmp_path, _rows())
    base = dict(max_seq_len=20, history_per_pool=2, batch_size=2, rows_per_read=3, path=str(processed))
    ranks = [YambdaReader(SCHEMA, SequenceDataConfig(**base), rank=r, world_size=2) for r in range(2)]
    one = YambdaReader(SCHEMA, SequenceDataConfig(**{**base, "batch_size": 4}))
    train = [list(r.train_batches(1)) for r in ranks]
    assert len(train[0]) == len(train[1]) == 2  # 9 anchors: 2 global batches of 4, 1 dropped
    whole = list(one.train_batches(1))
    assert [b.labels.tolist() for b in whole] == [train[0][i].labels.tolist() + train[1][i].labels.tolist()
                                                  for i in range(2)]
    resumed = list(ranks[1].train_batches(1, start=1))
    assert len(resumed) == 1 and resumed[0].timestamps.tolist() == train[1][1].timestamps.tolist()
    three = [YambdaReader(SCHEMA, SequenceDataConfig(**base), rank=r, world_size=3) for r in range(3)]
    assert [len(list(r.train_batches(1))) for r in three] == [1, 1, 1]  # 9 anchors: one full batch of 6
    evals = [list(r.eval_batches(1)) for r in three]
    assert [len(e) for e in evals] == [2, 2, 2]  # the second global batch padded on every rank
    assert sum(int(b.num_targets.sum()) for e in evals for b in e) == 9


def _malformed(tmp_path, change) -> str:
    rows = _rows()
    change(rows)
    processed = _write(tmp_path, rows)
    reader = YambdaReader(SCHEMA, SequenceDataConfig(max_seq_len=20, history_per_pool=2, batch_size=4,
                                                     rows_per_read=2, path=str(processed)))
    with pytest.raises(MalformedRowError) as e:
        reader.anchor_span()
        list(reader.eval_batches(0))
    return str(e.value)


def test_malformed_rows_name_the_file_and_row(tmp_path):
    def short_list(rows):
        rows[3]["event_types"] = rows[3]["event_types"][:-1]

    def back_in_time(rows):
        rows[4]["timestamps"][2] = rows[4]["timestamps"][1] - 5

    def unsorted(rows):
        rows[2]["uid"], rows[3]["uid"] = 2, 1

    def bad_type(rows):
        rows[5]["event_types"][0] = 9

    def bad_item(rows):
        rows[1]["item_ids"][0] = SCHEMA.rows["item_id"]

    for change, row, cause in [(short_list, 3, "different length"), (back_in_time, 4, "back in time"),
                               (unsorted, 3, "not sorted by uid"), (bad_type, 5, "event type"),
                               (bad_item, 1, "item id outside")]:
        msg = _malformed(tmp_path / change.__name__, change)
        assert "train_sessions.parquet" in msg and f"row {row}:" in msg and cause in msg and "\n" not in msg


def test_bad_files(tmp_path):
    processed = _write(tmp_path, _rows())
    data = SequenceDataConfig(path=str(processed))
    (tmp_path / "shared_metadata" / "album_item_mapping.parquet").unlink()
    with pytest.raises(ValueError, match="missing .*album_item_mapping"):
        YambdaReader(SCHEMA, data)
    pq.write_table(pa.table({"uid": pa.array([1], pa.uint32())}), processed / "train_sessions.parquet")
    with pytest.raises(ValueError, match="no column 'item_ids'"):
        YambdaReader(SCHEMA, data)
    (processed / "train_sessions.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="not a readable parquet"):
        YambdaReader(SCHEMA, data)
