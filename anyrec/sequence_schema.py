"""The sequence schema of DLRMv4 (HSTU over a user's interaction history): its features, their tables
and the hashed crosses, in KeyedJaggedTensor key order.

A sample is one user's time-ordered history plus one candidate. The three sequence features
(`item_id`, `artist_id`, `album_id`) have one id per position, the candidate last; the eight contextual
features (`uid` and seven hashed crosses of the candidate's user, item, artist, album, hour of day and
organic flag) have one id each. The tables' rows are the MLPerf reference's (Yambda-5B); `scaled` makes a
proportionally smaller schema for CPU-sized jobs. Data sources, models and the planner read table names
and rows from here, so none of them imports another for it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from anyrec.schema import table_name

SEQUENCE_FEATURES = ("item_id", "artist_id", "album_id")
CONTEXTUAL_FEATURES = ("uid", "user_x_artist", "user_x_album", "user_x_hour", "item_x_hour",
                       "artist_x_hour", "user_x_is_organic", "user_x_artist_x_hour")
# The reference's tables (rows), dim 512, FP32.
REFERENCE_ROWS: Mapping[str, int] = {
    "item_id": 9_390_624, "artist_id": 1_293_395, "album_id": 3_367_692, "uid": 1_000_001,
    "user_x_artist": 100_000_000, "user_x_album": 40_000_000, "user_x_hour": 24_000_000,
    "item_x_hour": 40_000_000, "artist_x_hour": 32_000_000, "user_x_is_organic": 2_000_000,
    "user_x_artist_x_hour": 40_000_000,
}
# Action bits of a history position: the pool it came from. The candidate's bits are 0.
LISTEN_PLUS_BIT, LIKE_BIT, SKIP_BIT = 1, 2, 4
POOL_BITS = (LISTEN_PLUS_BIT, LIKE_BIT, SKIP_BIT)
NUM_TARGETS = 1  # candidates per sample, at the end of each sequence
NUM_CONTEXTUAL = len(CONTEXTUAL_FEATURES)


@dataclass(frozen=True)
class CrossFeature:
    """A contextual feature hashed from the candidate event's fields: xxh64 (seed `salt`) of the fields'
    values as little-endian int64, modulo the table's rows (the reference's cross hash)."""

    name: str
    fields: tuple[str, ...]  # among uid, item_id, artist_id, album_id, hour_of_day, is_organic
    salt: int = 0


CROSS_FEATURES = (
    CrossFeature("user_x_artist", ("uid", "artist_id")),
    CrossFeature("user_x_album", ("uid", "album_id")),
    CrossFeature("user_x_hour", ("uid", "hour_of_day")),
    CrossFeature("item_x_hour", ("item_id", "hour_of_day")),
    CrossFeature("artist_x_hour", ("artist_id", "hour_of_day")),
    CrossFeature("user_x_is_organic", ("uid", "is_organic")),
    CrossFeature("user_x_artist_x_hour", ("uid", "artist_id", "hour_of_day")),
)


@dataclass(frozen=True)
class SequenceTable:
    """One feature and the table that serves it; `sequence` features have an id per history position."""

    feature: str
    table: str
    num_rows: int
    sequence: bool


@dataclass(frozen=True)
class SequenceSchema:
    """Rows of every table of the sequence model, by feature name (all eleven features)."""

    rows: Mapping[str, int]

    def __post_init__(self) -> None:
        missing = [f for f in self.features if f not in self.rows]
        extra = [f for f in self.rows if f not in self.features]
        if missing or extra:
            raise ValueError(f"sequence schema: missing tables {missing}, unknown tables {extra}")
        small = [f for f, r in self.rows.items() if int(r) < 2]
        if small:
            raise ValueError(f"sequence schema: tables {small} need at least 2 rows")

    @property
    def features(self) -> tuple[str, ...]:
        """Every feature in KeyedJaggedTensor key order: sequence features, then contextual ones."""
        return SEQUENCE_FEATURES + CONTEXTUAL_FEATURES

    @property
    def tables(self) -> list[SequenceTable]:
        """The tables in key order."""
        return [SequenceTable(f, table_name(f), int(self.rows[f]), f in SEQUENCE_FEATURES)
                for f in self.features]

    @property
    def num_users(self) -> int:
        """Users the uid table holds (uid 0 is kept for padding samples)."""
        return int(self.rows["uid"]) - 1

    def scaled(self, scale: float) -> SequenceSchema:
        """Every table `scale` x the reference's rows (rounded up, at least 2): 0.002 gives 18,782
        items, 2,587 artists, 6,736 albums and 2,000 users."""
        if not 0 < scale <= 1:
            raise ValueError(f"sequence schema scale must be in (0, 1], got {scale}")
        return SequenceSchema({f: max(2, math.ceil(r * scale)) for f, r in self.rows.items()})


def reference_schema() -> SequenceSchema:
    """The MLPerf reference's tables (Yambda-5B)."""
    return SequenceSchema(dict(REFERENCE_ROWS))


@dataclass
class SequenceDataConfig:
    """What a sequence source needs (defaults: the CPU-sized job; the reference's values in comments).
    The job's seed, rank and world size are passed beside it."""

    max_seq_len: int = 256  # tokens per sample: history + 8 contextual + 1 candidate (reference 4096)
    history_per_pool: int = 82  # most recent events kept per pool before the anchor (reference 1362)
    batch_size: int = 128  # samples per rank (reference 1024)
    num_windows: int = 6  # 1-day windows streamed (train T, evaluate T + 1); synthetic: days simulated
    # synthetic stream
    history_days: int = 3  # days simulated before window 0, so that its samples have histories
    events_per_user_day: float = 20.0  # mean events of a user per day (users' activity is log-normal)
    zipf_exponent: float = 1.05  # item popularity ~ 1/rank^s
    num_tastes: int = 8  # latent taste groups of artists; a user's affinity is per group
    # Yambda files: <path>/train_sessions.parquet, <mapping_path>/{artist,album}_item_mapping.parquet
    path: str | None = None
    mapping_path: str | None = None  # default: <path>/../shared_metadata, the reference's layout
    min_history: int = 1  # a listen is an anchor when its user has at least this many earlier events
    scan_window: int = 20_000  # events before the anchor searched for its history (the reference's)
    window_seconds: int = 86_400
    rows_per_read: int = 4096  # parquet rows (sessions) read at a time: bounds the reader's memory

    @classmethod
    def of(cls, options: Mapping[str, Any], batch_size: int) -> SequenceDataConfig:
        """The job's `data.sequence` options at `batch_size` samples per rank; a key that is no option, or a
        value of the wrong kind, is a ValueError (one line) naming it."""
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "batch_size"}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise ValueError(f"data.sequence.{unknown[0]} is not an option of a sequence source; its "
                             f"options: {', '.join(sorted(fields))}")
        for name, value in options.items():
            kind = type(fields[name].default)  # int, float, or None for a path
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if kind is int and not (number and isinstance(value, int)):
                raise ValueError(f"data.sequence.{name} must be an integer, got {value!r}")
            if kind is float and not number:
                raise ValueError(f"data.sequence.{name} must be a number, got {value!r}")
            if kind is type(None) and not (value is None or isinstance(value, str)):
                raise ValueError(f"data.sequence.{name} must be a path, got {value!r}")
        return cls(**{**options, "batch_size": batch_size})

    def __post_init__(self) -> None:
        if self.max_seq_len < NUM_CONTEXTUAL + NUM_TARGETS + 1:
            raise ValueError(f"data.sequence.max_seq_len must be >= {NUM_CONTEXTUAL + NUM_TARGETS + 1} "
                             f"(8 contextual tokens, a candidate and some history), got {self.max_seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {self.batch_size}")
        for name in ("history_per_pool", "num_windows", "num_tastes", "min_history", "scan_window",
                     "window_seconds", "rows_per_read"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.sequence.{name} must be >= 1, got {getattr(self, name)}")
        if self.history_days < 0:
            raise ValueError(f"data.sequence.history_days must be >= 0, got {self.history_days}")
        if not self.events_per_user_day > 0 or not self.zipf_exponent >= 0:
            raise ValueError(f"data.sequence.events_per_user_day must be > 0 and data.sequence.zipf_exponent "
                             f">= 0, got {self.events_per_user_day} and {self.zipf_exponent}")

    @property
    def history_budget(self) -> int:
        """History positions a sample can hold: max_seq_len less the contextual tokens and the candidate."""
        return self.max_seq_len - NUM_CONTEXTUAL - NUM_TARGETS
