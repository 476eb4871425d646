"""Yambda as the MLPerf DLRMv4 reference prepares it, read in bounded memory.

The reference's preprocessing (generative-recommenders `preprocess_public_data.py --dataset yambda-5b`)
writes `<root>/processed_<size>/train_sessions.parquet`: one row per (uid, session_id), sorted by both,
with per-event lists `item_ids`, `timestamps` (seconds), `event_types` (0 listen, 1 like, 2 dislike, 3
unlike, 4 undislike), `is_organic`, `played_ratio_pct` (null where not a listen) and
`track_length_seconds`; and `<root>/shared_metadata/{artist,album}_item_mapping.parquet` (item_id ->
artist_id / album_id; an item missing from a mapping gets 0, as there).

Samples, as the reference's dataset makes them: an anchor is a listen whose user has at least
`min_history` earlier events; its label is listen_plus (played >= 50 %); its history comes from the
user's events before it (at most `scan_window` back): the last `history_per_pool` of each pool (listen
with played >= 50 % / like / listen with played < 50 %), in time order. One difference: events in the
anchor's own second are left out (the reference keeps those earlier in file order), so no event at or
after the anchor reaches its history. Windows are `window_seconds` from the first anchor's time, in
wall-clock order.

Streaming: a window is one pass over the file, `rows_per_read` sessions at a time (pyarrow record
batches), holding one user's events (up to the window's end) and one batch, never the whole file. Its
anchors come user-major (file order, the reference's default); global batch g is anchors [g*G, (g+1)*G)
(G = batch x world size) and rank r takes the r-th B of each, so every rank yields the same number of
batches: training drops the last incomplete global batch, evaluation pads it. Every value is checked
where it is read; a malformed row is a MalformedRowError naming the file and the row (from 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from anyrec.data.sequences import (
    LISTEN_PLUS,
    BatchBuilder,
    SequenceBatch,
    action_bits,
    contextual_ids,
    history_positions,
    pools_of,
)
from anyrec.sequence_schema import SequenceDataConfig, SequenceSchema

SESSIONS_FILE = "train_sessions.parquet"
ARTIST_MAPPING_FILE, ALBUM_MAPPING_FILE = "artist_item_mapping.parquet", "album_item_mapping.parquet"
LIST_COLUMNS = ("item_ids", "timestamps", "event_types", "is_organic", "played_ratio_pct")
LISTEN_PLUS_PCT = 50  # a listen played at least this much is a listen_plus
NUM_EVENT_TYPES = 5


class MalformedRowError(ValueError):
    """A malformed row of a Yambda file (the file and the row named)."""


@dataclass
class UserEvents:
    """One user's events in time order (the sessions' lists concatenated)."""

    uid: int
    ts: np.ndarray
    item: np.ndarray
    event_type: np.ndarray
    listen_plus: np.ndarray  # bool: played >= 50 % (meaningful for listens)
    organic: np.ndarray


def _open(path: Path) -> pq.ParquetFile:
    if not path.is_file():
        raise ValueError(f"yambda: missing {path}")
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"yambda: {path} is not a readable parquet file ({e})") from None


def _check_columns(path: Path, f: pq.ParquetFile, columns: dict[str, bool]) -> None:
    """Each column present; integer (or, where True, any number) ids, lists where the name says so."""
    schema = f.schema_arrow
    for name, numeric in columns.items():
        if name not in schema.names:
            raise ValueError(f"yambda: {path} has no column {name!r} (columns: {', '.join(schema.names)})")
        t = schema.field(name).type
        is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
        if is_list != (name in LIST_COLUMNS):
            raise ValueError(f"yambda: {path} column {name!r} has type {t}")
        leaf = t.value_type if is_list else t
        if not (pa.types.is_integer(leaf) or numeric and pa.types.is_floating(leaf)):
            raise ValueError(f"yambda: {path} column {name!r} has type {t}, expected integers")


def _ints(path: Path, name: str, arr: pa.Array, first_row: int, row_of=None) -> np.ndarray:
    """`arr` as int64, a null being a malformed row (`row_of` maps a value's index to its row)."""
    if arr.null_count:
        i = int(np.argmax(pc.is_null(arr).to_numpy(zero_copy_only=False)))
        row = first_row + (row_of(i) if row_of else i)
        raise MalformedRowError(f"yambda: {path} row {row}: null in {name}")
    return arr.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _bad(path: Path, first_row: int, mask: np.ndarray, row_of, cause: str) -> None:
    if mask.any():
        i = int(np.argmax(mask))
        raise MalformedRowError(f"yambda: {path} row {first_row + (row_of(i) if row_of else i)}: {cause}")


def read_item_mapping(path: Path, column: str, num_items: int, num_values: int,
                      rows_per_read: int) -> np.ndarray:
    """[num_items] the `column` of each item in a mapping file (0 for items it does not list)."""
    f = _open(path)
    _check_columns(path, f, {"item_id": False, column: False})
    out = np.zeros(num_items, dtype=np.int64)
    row = 0
    for batch in f.iter_batches(batch_size=rows_per_read, columns=["item_id", column]):
        item = _ints(path, "item_id", batch.column(0), row)
        value = _ints(path, column, batch.column(1), row)
        _bad(path, row, (item < 0) | (item >= num_items), None, f"item_id outside [0, {num_items})")
        _bad(path, row, (value < 0) | (value >= num_values), None, f"{column} outside [0, {num_values})")
        out[item] = value
        row += batch.num_rows
    return out


class YambdaReader:
    """The sessions file and item mappings of `data.path` for one rank (see the module doc)."""

    def __init__(self, schema: SequenceSchema, data: SequenceDataConfig, rank: int = 0,
                 world_size: int = 1) -> None:
        if data.path is None:
            raise ValueError("data.path must name the directory holding train_sessions.parquet")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
        self.schema, self.data, self.rank, self.world_size = schema, data, rank, world_size
        self.batch_size = data.batch_size
        self.global_batch_size = data.batch_size * world_size
        self.path = Path(data.path) / SESSIONS_FILE
        self._file = _open(self.path)
        _check_columns(self.path, self._file,
                       {"uid": False, **{c: c == "played_ratio_pct" for c in LIST_COLUMNS}})
        maps = Path(data.mapping_path) if data.mapping_path else Path(data.path).parent / "shared_metadata"
        rows = schema.rows
        self.item_artist = read_item_mapping(maps / ARTIST_MAPPING_FILE, "artist_id", rows["item_id"],
                                             rows["artist_id"], data.rows_per_read)
        self.item_album = read_item_mapping(maps / ALBUM_MAPPING_FILE, "album_id", rows["item_id"],
                                            rows["album_id"], data.rows_per_read)
        self._anchor_span: tuple[int, int] | None = None

    # ---- rows to users ----------------------------------------------------------------------------

    def _read_batch(self, batch: pa.RecordBatch, row: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """Checked (uids [R], offsets [R + 1], flat list columns) of one record batch starting at `row`."""
        path, rows = self.path, self.schema.rows
        uid = _ints(path, "uid", batch.column("uid"), row)
        _bad(path, row, (uid < 0) | (uid >= rows["uid"]), None, f"uid outside [0, {rows['uid']})")
        lengths = []
        for name in LIST_COLUMNS:
            n = batch.column(name)
            if n.null_count:
                _bad(path, row, pc.is_null(n).to_numpy(zero_copy_only=False), None, f"{name} is null")
            lengths.append(pc.list_value_length(n).to_numpy(zero_copy_only=False).astype(np.int64))
        for name, n in zip(LIST_COLUMNS[1:], lengths[1:], strict=True):
            _bad(path, row, n != lengths[0], None, f"{name} has a different length from item_ids")
        offsets = np.concatenate([[0], np.cumsum(lengths[0])])

        def row_of(i: int) -> int:
            return int(np.searchsorted(offsets, i, side="right") - 1)

        flat = {name: pc.list_flatten(batch.column(name)) for name in LIST_COLUMNS}
        item = _ints(path, "item_ids", flat["item_ids"], row, row_of)
        ts = _ints(path, "timestamps", flat["timestamps"], row, row_of)
        etype = _ints(path, "event_types", flat["event_types"], row, row_of)
        organic = _ints(path, "is_organic", flat["is_organic"], row, row_of)
        played = pc.fill_null(flat["played_ratio_pct"], 0).to_numpy(zero_copy_only=False)
        played = np.nan_to_num(played.astype(np.float64), nan=0.0)  # as the reference: missing = 0
        _bad(path, row, (item < 0) | (item >= rows["item_id"]), row_of,
             f"item id outside [0, {rows['item_id']})")
        _bad(path, row, ts < 0, row_of, "negative timestamp")
        _bad(path, row, (etype < 0) | (etype >= NUM_EVENT_TYPES), row_of, "event type outside 0..4")
        _bad(path, row, (organic < 0) | (organic > 1), row_of, "is_organic outside {0, 1}")
        # Time order inside each session, and from each row to the next of the same user.
        same = np.ones(len(ts), dtype=bool)
        same[offsets[:-1][lengths[0] > 0]] = False  # the first event of a row follows another row
        _bad(path, row, same & (np.diff(ts, prepend=0) < 0), row_of, "timestamps go back in time")
        _bad(path, row, np.diff(uid) < 0, lambda i: i + 1,
             "uid smaller than the row before (not sorted by uid)")
        return uid, offsets, [ts, item, etype, played >= LISTEN_PLUS_PCT, organic]

    def users(self, columns_end: int | None = None) -> Iterator[UserEvents]:
        """Every user's events, user after user, in file order; events from `columns_end` (seconds) on are
        left out (they cannot be in a window's samples)."""
        pending: list[list[np.ndarray]] = []
        pending_uid, last_ts, row = None, None, 0
        columns = ["uid", *LIST_COLUMNS]
        for batch in self._file.iter_batches(batch_size=self.data.rows_per_read, columns=columns):
            uid, offsets, cols = self._read_batch(batch, row)
            bounds = np.flatnonzero(np.diff(uid)) + 1
            for r0, r1 in zip(np.r_[0, bounds], np.r_[bounds, len(uid)], strict=True):
                u, e0, e1 = int(uid[r0]), offsets[r0], offsets[r1]
                if e1 > e0 and pending_uid == u and last_ts is not None and cols[0][e0] < last_ts:
                    raise MalformedRowError(f"yambda: {self.path} row {row + r0}: timestamps go back in time")
                if pending_uid is not None and u != pending_uid:
                    if u < pending_uid:
                        raise MalformedRowError(f"yambda: {self.path} row {row + r0}: uid smaller than the "
                                                "row before (not sorted by uid)")
                    yield self._user(pending_uid, pending, columns_end)
                    pending, last_ts = [], None
                pending_uid = u
                pending.append([c[e0:e1] for c in cols])
                if e1 > e0:
                    last_ts = cols[0][e1 - 1]
            row += batch.num_rows
        if pending_uid is not None:
            yield self._user(pending_uid, pending, columns_end)

    @staticmethod
    def _user(uid: int, chunks: list[list[np.ndarray]], end: int | None) -> UserEvents:
        ts, item, etype, lp, organic = (np.concatenate(c) for c in zip(*chunks, strict=True))
        if end is not None:
            n = int(np.searchsorted(ts, end, side="left"))
            ts, item, etype, lp, organic = ts[:n], item[:n], etype[:n], lp[:n], organic[:n]
        return UserEvents(uid, ts, item, etype, lp, organic)

    def _anchors(self, user: UserEvents) -> np.ndarray:
        """Positions of the user's anchors: listens with at least min_history earlier events."""
        pos = np.flatnonzero(user.event_type == 0)
        return pos[pos >= self.data.min_history]

    # ---- windows ----------------------------------------------------------------------------------

    def anchor_span(self) -> tuple[int, int]:
        """(first, last) anchor timestamps of the file: one pass, made once."""
        if self._anchor_span is None:
            lo, hi = None, None
            for user in self.users():
                a = self._anchors(user)
                if len(a):
                    lo = int(user.ts[a[0]]) if lo is None else min(lo, int(user.ts[a[0]]))
                    hi = int(user.ts[a[-1]]) if hi is None else max(hi, int(user.ts[a[-1]]))
            if lo is None:
                raise ValueError(f"yambda: {self.path} has no anchor (a listen after {self.data.min_history} "
                                 "earlier events of its user)")
            self._anchor_span = (lo, hi)
        return self._anchor_span

    def num_windows(self) -> int:
        """Windows of `window_seconds` from the first anchor to the last."""
        lo, hi = self.anchor_span()
        return (hi - lo) // self.data.window_seconds + 1

    def window_bounds(self, window: int) -> tuple[int, int]:
        """[start, end) seconds of a window."""
        if not 0 <= window < self.num_windows():
            raise ValueError(f"window {window} is outside the file's {self.num_windows()} windows")
        lo = self.anchor_span()[0] + window * self.data.window_seconds
        return lo, lo + self.data.window_seconds

    def train_batches(self, window: int, start: int = 0) -> Iterator[SequenceBatch]:
        """This rank's training batches of `window`, from batch `start` (the last incomplete global batch
        dropped)."""
        return self._batches(window, start, pad=False)

    def eval_batches(self, window: int) -> Iterator[SequenceBatch]:
        """This rank's evaluation batches of `window`: every anchor once over the ranks, the last global
        batch padded."""
        return self._batches(window, 0, pad=True)

    def _batches(self, window: int, start: int, pad: bool) -> Iterator[SequenceBatch]:
        lo, hi = self.window_bounds(window)
        B, G = self.batch_size, self.global_batch_size
        mine = range(self.rank * B, self.rank * B + B)  # this rank's slots of every global batch
        count = 0  # anchors of the window so far, over all ranks
        held: tuple[int, SequenceBatch] | None = None  # training: a batch whose global batch is incomplete
        builder = BatchBuilder(self.schema)
        for user in self.users(columns_end=hi):
            anchors = self._anchors(user)
            anchors = anchors[user.ts[anchors] >= lo]
            pool = pools_of(user.event_type, user.listen_plus) if len(anchors) else None
            for k in anchors:
                g, slot = divmod(count, G)
                count += 1
                if g >= start and slot in mine:
                    self._add(builder, user, pool, int(k))
                    if len(builder) == B:
                        batch, builder = builder.build(window), BatchBuilder(self.schema)
                        if pad:
                            yield batch
                        else:
                            held = (g, batch)
                if held is not None and count >= (held[0] + 1) * G:
                    yield held[1]
                    held = None
        # Evaluation: the last global batch, when incomplete, padded on every rank (the builder holds this
        # rank's part of it, maybe nothing).
        if pad and count % G and count % G < mine.stop and count // G >= start:
            while len(builder) < B:
                builder.add_padding()
            yield builder.build(window)

    def _add(self, builder: BatchBuilder, user: UserEvents, pool: np.ndarray, k: int) -> None:
        """The sample of the user's anchor at position k."""
        t = int(user.ts[k])
        end = int(np.searchsorted(user.ts, t, side="left"))  # strictly before the anchor's second
        pos = history_positions(pool, max(0, k - self.data.scan_window), end, self.data.history_per_pool,
                                self.data.history_budget)
        item = user.item[pos]
        ci = int(user.item[k])
        context = contextual_ids(self.schema, {
            "uid": np.array([user.uid]), "item_id": np.array([ci]), "artist_id": self.item_artist[[ci]],
            "album_id": self.item_album[[ci]], "hour_of_day": np.array([(t // 3600) % 24]),
            "is_organic": user.organic[[k]]})[0]
        builder.add(item, self.item_artist[item], self.item_album[item], action_bits(pool[pos]), user.ts[pos],
                    (ci, int(self.item_artist[ci]), int(self.item_album[ci]), t), context,
                    float(pool[k] == LISTEN_PLUS))
