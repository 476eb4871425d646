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

import math
from collections.abc import Mapping
from dataclasses import dataclass

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
