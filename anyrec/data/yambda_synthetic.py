"""A synthetic Yambda-shaped stream of music-listening events, the default source of the sequence model.

The world (a pure function of the seed and the schema's table rows):
  - a catalogue: items grouped into albums, albums into artists (item -> album -> artist, consistent), each
    artist in one of `num_tastes` taste groups and with a quality; item popularity follows a power law
    (Zipf, `zipf_exponent`) over a seeded permutation of the ids;
  - users (uid 1 .. rows - 1; 0 is padding) with a log-normal activity, a bias, and a taste vector over
    the groups that turns slowly with the days (period TASTE_PERIOD_DAYS), so recent history tells more.
Day d (a pure function of the seed and d, whatever the rank): every user has Poisson(activity x
`events_per_user_day`) events in a few sessions; an event is a like (2/99 of events, items drawn with a
strong taste tilt) or a listen of an item drawn by popularity x exp(tilt x taste of its group). The
hidden model: a listen is a listen_plus with probability sigmoid(b0 + quality of the artist + user bias +
taste of the user for the item's group), b0 set so that listens are listen_plus 61/97 of the time; so the
pools hold about 61 % listen_plus, 2 % likes, 37 % skips of events, as in Yambda. A model learns it from
the ids and the history: popular artists' quality from many samples, the user's taste from the pools of
the artists they heard. `hidden_auc(window)` is the hidden model's own AUC on a window: the ceiling a
trained model approaches.

Streaming: window w is day `history_days + w` (the days before fill the histories). Its anchors are the
day's listens; a history comes from the user's events strictly before the anchor (sequences.py). The
stream keeps, per user, the last `history_per_pool` events of each pool at the start of the current day
and that one day's events: memory does not grow with the days. A window further back than the one held
is rebuilt by replaying days from the start (the cost grows with the window, not the memory).

Sharding: the events are simulated whole on every rank (cheap, vectorised); ranks assemble only their
own samples. Training visits the day's anchors in a seeded permutation: global batch i is anchors
[i*G, (i+1)*G) of it (G = batch x world size), rank r takes the r-th B of them; the remainder is dropped.
So 1 rank x 2B and 2 ranks x B train on the same samples. Evaluation visits every anchor once, in
user-major order, the last global batch padded: the eval window is identical whatever the world size.
Legend: U users, I items, K taste groups, E events of a day, N anchors of a day.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from anyrec.data.sequences import (
    LIKE,
    LISTEN_PLUS,
    NO_POOL,
    SKIP,
    BatchBuilder,
    SequenceBatch,
    action_bits,
    contextual_ids,
    history_positions,
)
from anyrec.sequence_schema import SequenceDataConfig, SequenceSchema

DAY_S = 86_400
EPOCH_S = 1_700_006_400  # day 0 starts at a midnight (UTC)
LIKE_SHARE = 2 / 99  # of events; listens are the other 97/99
LISTEN_PLUS_RATE = 61 / 97  # of listens, on average
# The hidden model (logit scales) and the exposure: chosen so that its AUC is about 0.78 and a small
# model reaches most of it from ids and histories (tests/test_yambda_synthetic.py checks the range).
# The artist's quality and the user's bias carry most of it (an id model learns them from a few hundred
# samples per id); the user x taste-group term the rest (learnt from the history and the uid's crosses).
TASTE_SCALE = 0.4  # std of the user x taste-group term
QUALITY_SCALE = 1.0  # std of the artist quality term
USER_BIAS_SCALE = 0.7  # std of the user's own bias
EXPOSURE_TILT = 0.8  # listens: P(group) ~ mass x exp(tilt x taste)
LIKE_TILT = 2.5  # likes go to the groups a user loves
TASTE_PERIOD_DAYS = 120.0  # the taste vector turns a full circle in this many days
ACTIVITY_SIGMA = 0.6  # log-normal spread of users' activity (mean 1)
SESSIONS_MEAN = 2.0  # sessions per active user-day: 1 + Poisson(1)
EVENT_GAP_S = 200  # mean seconds between events of a session
MAX_EVENTS_PER_DAY = 2_000  # per user


@dataclass
class Catalogue:
    """Items, albums, artists and the draws by popularity within each taste group."""

    item_album: np.ndarray  # [I] int64
    item_artist: np.ndarray  # [I] int64
    item_group: np.ndarray  # [I] int64
    artist_quality: np.ndarray  # [artists] float64
    group_mass: np.ndarray  # [K] popularity mass of each group
    by_group: np.ndarray  # [I] item ids sorted by group
    group_cdf: np.ndarray  # [I] group + cumulative popularity within the group, in (g, g + 1]


@dataclass
class Events:
    """Events sorted by (user, time); `start` [U + 1] is each user's first row (CSR)."""

    user: np.ndarray  # [E] int64, 0-based (uid = user + 1)
    ts: np.ndarray  # [E] int64 seconds
    item: np.ndarray  # [E] int64
    pool: np.ndarray  # [E] int8: LISTEN_PLUS, LIKE or SKIP
    organic: np.ndarray  # [E] int64 0/1
    prob: np.ndarray  # [E] float64: the hidden P(listen_plus) of listens (NaN for likes)
    start: np.ndarray  # [U + 1] int64

    def __len__(self) -> int:
        return len(self.user)


@dataclass
class Day:
    """One simulated day: the histories held at its start, its events and its anchors (listens)."""

    day: int
    history: Events  # last history_per_pool events per pool and user, before the day
    events: Events
    anchors: np.ndarray  # [N] rows of `events` that are listens, user-major


def _csr_start(user: np.ndarray, num_users: int) -> np.ndarray:
    return np.searchsorted(user, np.arange(num_users + 1)).astype(np.int64)


def _empty_events(num_users: int) -> Events:
    z = np.empty(0, dtype=np.int64)
    return Events(z, z, z, np.empty(0, dtype=np.int8), z, np.empty(0), np.zeros(num_users + 1, np.int64))


def _take(ev: Events, rows: np.ndarray, num_users: int) -> Events:
    user = ev.user[rows]
    return Events(user, ev.ts[rows], ev.item[rows], ev.pool[rows], ev.organic[rows], ev.prob[rows],
                  _csr_start(user, num_users))


def keep_recent(history: Events, day: Events, per_pool: int, num_users: int) -> Events:
    """The last `per_pool` events of each pool and user among `history` then `day` (both per user in time
    order, `history` earlier), sorted by (user, time)."""
    both = Events(*(np.concatenate([a, b]) for a, b in zip(
        (history.user, history.ts, history.item, history.pool, history.organic, history.prob),
        (day.user, day.ts, day.item, day.pool, day.organic, day.prob), strict=True)), start=history.start)
    keep = both.pool != NO_POOL
    rows = np.flatnonzero(keep)
    order = rows[np.lexsort((both.ts[rows], both.pool[rows], both.user[rows]))]
    group = both.user[order] * 3 + both.pool[order]
    ends = np.r_[np.flatnonzero(group[1:] != group[:-1]), len(group) - 1]
    i = np.arange(len(order))
    from_end = ends[np.searchsorted(ends, i)] - i
    kept = order[from_end < per_pool]
    kept = kept[np.lexsort((both.ts[kept], both.user[kept]))]
    return _take(both, kept, num_users)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (ties count one half); NaN without both classes."""
    labels = np.asarray(labels) > 0.5
    pos, n = int(labels.sum()), len(labels)
    if pos in (0, n):
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    rank_of_value = np.cumsum(counts) - (counts - 1) / 2.0  # average 1-based rank of each distinct score
    rank_sum = float(rank_of_value[inverse][labels].sum())
    return (rank_sum - pos * (pos + 1) / 2.0) / (pos * (n - pos))


class SyntheticYambda:
    """The synthetic stream for one rank (see the module doc): `train_batches(window, start)`,
    `eval_batches(window)`, `hidden_auc(window)`; `train_batch` / `eval_batch` are the pure functions
    behind them, for a prefetcher."""

    def __init__(self, schema: SequenceSchema, data: SequenceDataConfig, seed: int, rank: int = 0,
                 world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
        self.schema, self.data, self.seed = schema, data, seed
        self.rank, self.world_size = rank, world_size
        self.batch_size = data.batch_size
        self.global_batch_size = data.batch_size * world_size
        self.num_users = schema.num_users
        self.catalogue = self._make_catalogue()
        self._make_users()
        self.base_logit = self._calibrate()
        self._lock = threading.Lock()
        self._day: Day | None = None

    # ---- the world --------------------------------------------------------------------------------

    def _make_catalogue(self) -> Catalogue:
        rows, K = self.schema.rows, self.data.num_tastes
        rng = np.random.default_rng([self.seed, 1])
        album_artist = rng.integers(0, rows["artist_id"], size=rows["album_id"])
        item_album = rng.integers(0, rows["album_id"], size=rows["item_id"])
        item_artist = album_artist[item_album]
        artist_group = rng.integers(0, K, size=rows["artist_id"])
        artist_quality = rng.standard_normal(rows["artist_id"])
        popularity_rank = rng.permutation(rows["item_id"])
        weight = 1.0 / np.power(popularity_rank + 1.0, self.data.zipf_exponent)
        item_group = artist_group[item_artist]
        by_group = np.argsort(item_group, kind="stable")
        w, g = weight[by_group], item_group[by_group]
        mass = np.bincount(g, weights=w, minlength=K)
        cum = np.cumsum(w) - np.concatenate([[0.0], np.cumsum(mass)])[g]  # cumulative within the group
        group_cdf = g + np.where(mass[g] > 0, cum / np.maximum(mass[g], 1e-300), 1.0)
        return Catalogue(item_album, item_artist, item_group, artist_quality, mass / mass.sum(), by_group,
                         group_cdf)

    def _make_users(self) -> None:
        U, K = self.num_users, self.data.num_tastes
        rng = np.random.default_rng([self.seed, 2])
        self._taste_a, self._taste_b = rng.standard_normal((U, K)), rng.standard_normal((U, K))
        self._taste_phase = rng.uniform(0, 2 * math.pi, size=U)
        self._user_bias = rng.standard_normal(U) * USER_BIAS_SCALE
        activity = rng.lognormal(0.0, ACTIVITY_SIGMA, size=U)
        self._activity = activity / activity.mean()

    def taste(self, day: int) -> np.ndarray:
        """[U, K] every user's taste on `day` (each entry standard normal)."""
        angle = 2 * math.pi * day / TASTE_PERIOD_DAYS + self._taste_phase
        return self._taste_a * np.cos(angle)[:, None] + self._taste_b * np.sin(angle)[:, None]

    def _draw_items(self, rng: np.random.Generator, user: np.ndarray, taste: np.ndarray,
                    tilt: float) -> np.ndarray:
        """Items for events of `user`: a group by mass x exp(tilt x taste), then an item by popularity."""
        cat = self.catalogue
        weight = cat.group_mass[None, :] * np.exp(tilt * taste)  # [U, K]
        cdf = np.cumsum(weight, axis=1)
        cdf /= cdf[:, -1:]
        u = rng.random(len(user))
        group = np.minimum((u[:, None] > cdf[user]).sum(axis=1), cdf.shape[1] - 1)
        pos = np.searchsorted(cat.group_cdf, group + rng.random(len(user)), side="left")
        return cat.by_group[np.minimum(pos, len(cat.by_group) - 1)]

    def _logit(self, user: np.ndarray, item: np.ndarray, taste: np.ndarray) -> np.ndarray:
        """The hidden logit without its offset."""
        cat = self.catalogue
        return (QUALITY_SCALE * cat.artist_quality[cat.item_artist[item]] + self._user_bias[user]
                + TASTE_SCALE * taste[user, cat.item_group[item]])

    def _calibrate(self) -> float:
        """b0 such that listens (drawn as on day 0) are listen_plus LISTEN_PLUS_RATE of the time."""
        rng = np.random.default_rng([self.seed, 5])
        taste = self.taste(0)
        user = rng.choice(self.num_users, size=20_000, p=self._activity / self._activity.sum())
        z = self._logit(user, self._draw_items(rng, user, taste, EXPOSURE_TILT), taste)
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if np.mean(1 / (1 + np.exp(-(mid + z)))) < LISTEN_PLUS_RATE else (lo, mid)
        return (lo + hi) / 2

    def simulate(self, day: int) -> Events:
        """Every user's events of `day`, sorted by (user, time): a pure function of the seed and the day."""
        U = self.num_users
        rng = np.random.default_rng([self.seed, 3, day])
        n = np.minimum(rng.poisson(self.data.events_per_user_day * self._activity), MAX_EVENTS_PER_DAY)
        user = np.repeat(np.arange(U), n)
        E, taste = len(user), self.taste(day)
        is_like = rng.random(E) < LIKE_SHARE
        item = self._draw_items(rng, user, taste, EXPOSURE_TILT)
        item[is_like] = self._draw_items(rng, user[is_like], taste, LIKE_TILT)
        prob = 1 / (1 + np.exp(-(self.base_logit + self._logit(user, item, taste))))
        listen_plus = rng.random(E) < prob
        pool = np.where(is_like, LIKE, np.where(listen_plus, LISTEN_PLUS, SKIP)).astype(np.int8)
        prob[is_like] = np.nan
        # Sessions: a few per user-day at uniform starts; events spread after their session's start.
        sessions = 1 + rng.poisson(SESSIONS_MEAN - 1, size=U)
        session = (rng.random(E) * sessions[user]).astype(np.int64)
        session_start = rng.uniform(0, DAY_S, size=(U, int(sessions.max(initial=1))))
        span = EVENT_GAP_S * n[user] / sessions[user]
        offset = (session_start[user, session] + rng.random(E) * span).astype(np.int64)
        order = np.lexsort((offset, user))
        user, item, pool, prob, offset = user[order], item[order], pool[order], prob[order], offset[order]
        start = _csr_start(user, U)
        k = np.arange(E) - start[user]
        # Distinct seconds inside the day: at most DAY_S - (events after it), then strictly increasing.
        offset = np.minimum(offset, DAY_S - n[user] + k)
        offset = np.maximum.accumulate(offset - k + user * 4 * DAY_S) - user * 4 * DAY_S + k
        organic = (rng.random(E) < 0.5).astype(np.int64)
        return Events(user, EPOCH_S + day * DAY_S + offset, item, pool, organic, prob, start)

    # ---- days and windows -------------------------------------------------------------------------

    def day_of(self, window: int) -> int:
        """The simulated day of a window."""
        if not 0 <= window < self.data.num_windows:
            raise ValueError(f"window {window} is outside the stream's {self.data.num_windows} windows")
        return self.data.history_days + window

    def _get_day(self, day: int) -> Day:
        """The state at `day` (held, advanced from the one held, or replayed from day 0)."""
        with self._lock:
            held = self._day
            if held is not None and held.day == day:
                return held
            if held is None or held.day > day:
                history, events, d = _empty_events(self.num_users), self.simulate(0), 0
            else:
                history, events, d = held.history, held.events, held.day
            self._day = None  # one day's events at a time
            while d < day:
                history = keep_recent(history, events, self.data.history_per_pool, self.num_users)
                d += 1
                events = self.simulate(d)
            self._day = Day(day, history, events, np.flatnonzero(events.pool != LIKE))
            return self._day

    def num_anchors(self, window: int) -> int:
        """Samples (listens) of a window, over all ranks."""
        return len(self._get_day(self.day_of(window)).anchors)

    def num_train_batches(self, window: int) -> int:
        """Training batches of a window: the same on every rank."""
        return self.num_anchors(window) // self.global_batch_size

    def num_eval_batches(self, window: int) -> int:
        """Evaluation batches of a window: the same on every rank (the last ones padded)."""
        return -(-self.num_anchors(window) // self.global_batch_size)

    def num_windows(self) -> int:
        """Windows of the stream."""
        return self.data.num_windows

    def _train_order(self, day: Day) -> np.ndarray:
        return np.random.default_rng([self.seed, 4, day.day]).permutation(len(day.anchors))

    def train_batch(self, window: int, index: int) -> SequenceBatch:
        """Training batch `index` of `window` for this rank."""
        day = self._get_day(self.day_of(window))
        if not 0 <= index < len(day.anchors) // self.global_batch_size:
            raise ValueError(f"window {window} has no training batch {index}")
        first = index * self.global_batch_size + self.rank * self.batch_size
        return self._assemble(day, window, self._train_order(day)[first:first + self.batch_size])

    def eval_batch(self, window: int, index: int) -> SequenceBatch:
        """Evaluation batch `index` of `window` for this rank (padding samples past the last anchor)."""
        day = self._get_day(self.day_of(window))
        first = index * self.global_batch_size + self.rank * self.batch_size
        if not 0 <= index < -(-len(day.anchors) // self.global_batch_size):
            raise ValueError(f"window {window} has no evaluation batch {index}")
        return self._assemble(day, window, np.arange(first, min(first + self.batch_size, len(day.anchors))))

    def train_batches(self, window: int, start: int = 0) -> Iterator[SequenceBatch]:
        """This rank's training batches of `window`, from batch `start`."""
        return (self.train_batch(window, i) for i in range(start, self.num_train_batches(window)))

    def eval_batches(self, window: int) -> Iterator[SequenceBatch]:
        """This rank's evaluation batches of `window`."""
        return (self.eval_batch(window, i) for i in range(self.num_eval_batches(window)))

    def hidden_auc(self, window: int) -> float:
        """The hidden model's AUC on every anchor of `window`: its true probabilities against the labels
        drawn from them."""
        day = self._get_day(self.day_of(window))
        ev = day.events
        return auc(ev.prob[day.anchors], (ev.pool[day.anchors] == LISTEN_PLUS).astype(np.float64))

    # ---- samples ----------------------------------------------------------------------------------

    def _assemble(self, day: Day, window: int, anchor_ids: np.ndarray) -> SequenceBatch:
        """The batch of anchors `anchor_ids` (indices into the day's anchors), padded to batch_size."""
        cat, ev, hist, data = self.catalogue, day.events, day.history, self.data
        rows = day.anchors[anchor_ids]
        user, item, ts = ev.user[rows], ev.item[rows], ev.ts[rows]
        context = contextual_ids(self.schema, {
            "uid": user + 1, "item_id": item, "artist_id": cat.item_artist[item],
            "album_id": cat.item_album[item], "hour_of_day": (ts // 3600) % 24,
            "is_organic": ev.organic[rows]})
        builder = BatchBuilder(self.schema)
        for b, row in enumerate(rows):
            u = user[b]
            h0, h1, d0 = hist.start[u], hist.start[u + 1], ev.start[u]
            # The user's events before the anchor: its held history, then the day's earlier events
            # (strictly earlier seconds: a user's timestamps are distinct and increasing).
            pool = np.concatenate([hist.pool[h0:h1], ev.pool[d0:row]])
            items = np.concatenate([hist.item[h0:h1], ev.item[d0:row]])
            times = np.concatenate([hist.ts[h0:h1], ev.ts[d0:row]])
            pos = history_positions(pool, 0, len(pool), data.history_per_pool, data.history_budget)
            it = items[pos]
            c = int(item[b])
            builder.add(it, cat.item_artist[it], cat.item_album[it], action_bits(pool[pos]), times[pos],
                        (c, int(cat.item_artist[c]), int(cat.item_album[c]), int(ts[b])), context[b],
                        float(ev.pool[row] == LISTEN_PLUS))
        while len(builder) < self.batch_size:
            builder.add_padding()
        return builder.build(window)
