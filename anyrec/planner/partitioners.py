"""Choose one option per table and ranks for its shards: minimise the slowest rank's predicted time
subject to every rank's HBM and DDR caps.

`GreedyPerfPartitioner` is LPT-style list scheduling with a lower-bound lookahead, then local search
(remove a table and re-insert it at its best option and ranks) under a time budget.
`ExhaustivePartitioner` is branch-and-bound over every option and rank assignment, for small cases
(the planner uses it when the search space is small; tests use it as the oracle).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from anyrec.planner.types import Partitioner, RankCost, Shard, ShardingOption, Storage, Topology

_REL_EPS = 1e-9


@dataclass
class _Cand:
    """An option flattened for the search: either fixed per-rank vectors or k equal placeable shards."""

    option: ShardingOption
    fixed: bool
    t_vec: np.ndarray | None  # fixed: seconds per rank
    h_vec: np.ndarray | None  # fixed: HBM bytes per rank
    d_vec: np.ndarray | None  # fixed: DDR bytes per rank
    k: int  # placed: number of shards, each on a distinct rank
    t: float  # placed: seconds per shard
    h: float  # placed: HBM bytes per shard
    d: float  # placed: DDR bytes per shard
    work: float  # total seconds over all ranks


def _flatten(opt: ShardingOption, w: int) -> _Cand:
    if opt.ranks_fixed:
        tv, hv, dv = np.zeros(w), np.zeros(w), np.zeros(w)
        for s in opt.shards:
            tv[s.rank] += s.perf.total_s
            hv[s.rank] += s.storage.hbm_bytes
            dv[s.rank] += s.storage.ddr_bytes
        return _Cand(opt, True, tv, hv, dv, 0, 0.0, 0.0, 0.0, float(tv.sum()))
    s = opt.shards[0]
    k = len(opt.shards)
    return _Cand(
        opt,
        False,
        None,
        None,
        None,
        k,
        s.perf.total_s,
        s.storage.hbm_bytes,
        s.storage.ddr_bytes,
        k * s.perf.total_s,
    )


def _materialise(c: _Cand, ranks: list[int] | None) -> ShardingOption:
    """A copy of the option with ranks written into its shards."""
    opt = c.option
    if c.fixed:
        shards = [Shard(s.num_rows, s.num_cols, s.storage, s.perf, s.rank) for s in opt.shards]
    else:
        shards = [
            Shard(s.num_rows, s.num_cols, s.storage, s.perf, r)
            for s, r in zip(opt.shards, ranks, strict=True)
        ]
    return ShardingOption(
        opt.table, opt.sharding, opt.placement, opt.compute_kernel, shards, opt.host, opt.cache_ratio
    )


class _State:
    """Per-rank seconds, HBM and DDR bytes of a partial plan."""

    def __init__(self, base: RankCost, w: int, caps: Storage) -> None:
        self.T = np.full(w, base.perf.total_s)
        self.H = np.full(w, float(base.storage.hbm_bytes))
        self.D = np.full(w, float(base.storage.ddr_bytes))
        self.hcap, self.dcap = float(caps.hbm_bytes), float(caps.ddr_bytes)

    def fit(self, c: _Cand, by_memory: bool = False) -> tuple[float, list[int] | None] | None:
        """(makespan after adding c, ranks for placed shards), or None if c does not fit."""
        if c.fixed:
            if np.any(self.H + c.h_vec > self.hcap) or np.any(self.D + c.d_vec > self.dcap):
                return None
            return float((self.T + c.t_vec).max()), None
        ok = self.H <= self.hcap - c.h
        if c.d:
            ok &= self.D <= self.dcap - c.d
        key = np.where(ok, self.H if by_memory else self.T, np.inf)
        if c.k == 1:  # table-wise, the common case: one argmin instead of a sort
            r = int(key.argmin())
            if not ok[r]:
                return None
            return max(float(self.T.max()), float(self.T[r]) + c.t), [r]
        if np.count_nonzero(ok) < c.k:
            return None
        ranks = np.argsort(key, kind="stable")[: c.k]
        return float(max(self.T.max(), (self.T[ranks] + c.t).max())), [int(r) for r in ranks]

    def apply(self, c: _Cand, ranks: list[int] | None, sign: float = 1.0) -> None:
        if c.fixed:
            self.T += sign * c.t_vec
            self.H += sign * c.h_vec
            self.D += sign * c.d_vec
        else:
            for r in ranks:
                self.T[r] += sign * c.t
                self.H[r] += sign * c.h
                self.D[r] += sign * c.d


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Lexicographic (makespan, work) with a relative tolerance."""
    if a[0] < b[0] * (1 - _REL_EPS):
        return True
    return a[0] <= b[0] * (1 + _REL_EPS) and a[1] < b[1] * (1 - _REL_EPS)


class GreedyPerfPartitioner(Partitioner):
    """Greedy list scheduling in descending cost with a lower-bound lookahead, then local search."""

    def __init__(self, local_search_s: float = 0.2) -> None:
        self.local_search_s = local_search_s  # time budget for the improvement passes, seconds

    def partition(
        self,
        options: dict[str, list[ShardingOption]],
        topology: Topology,
        base_per_rank: RankCost,
        caps: Storage,
    ) -> dict[str, ShardingOption] | None:
        w = topology.world_size
        cands = {name: [_flatten(o, w) for o in opts] for name, opts in options.items()}
        if any(not cs for cs in cands.values()):
            return None
        # Multi-start: three scorings of the greedy step, each polished by local search; keep the best.
        starts = [(False, "lookahead"), (False, "makespan"), (False, "work")]
        best, best_key = None, None
        deadline = time.perf_counter() + self.local_search_s
        for i, (by_memory, scoring) in enumerate(starts):
            if best is not None and time.perf_counter() >= deadline:
                break  # large cases: the later starts only run while the time budget lasts
            chosen = self._greedy(cands, base_per_rank, w, caps, by_memory, scoring)
            if chosen is None and i == 0:
                chosen = self._greedy(cands, base_per_rank, w, caps, True, scoring)
            if chosen is None:
                continue
            state = _State(base_per_rank, w, caps)
            for c, ranks in chosen.values():
                state.apply(c, ranks)
            share = (deadline - time.perf_counter()) / (len(starts) - i)
            self._local_search(cands, chosen, state, time.perf_counter() + max(share, 0.0))
            key = (float(state.T.max()), float(state.T.sum()))
            if best_key is None or _better(key, best_key):
                best, best_key = chosen, key
        if best is None:
            return None
        return {name: _materialise(c, ranks) for name, (c, ranks) in best.items()}

    @staticmethod
    def _greedy(cands, base, w, caps, by_memory, scoring="lookahead"):
        min_work = {n: min(c.work for c in cs) for n, cs in cands.items()}
        min_hbm = {
            n: min(float(c.h_vec.sum()) if c.fixed else c.k * c.h for c in cs) for n, cs in cands.items()
        }
        tot_w = sum(min_work.values()) or 1.0
        tot_h = sum(min_hbm.values()) or 1.0
        order = sorted(cands, key=lambda n: -max(min_work[n] / tot_w, min_hbm[n] / tot_h))
        state = _State(base, w, caps)
        remaining = sum(min_work.values())
        chosen: dict[str, tuple[_Cand, list[int] | None]] = {}
        for name in order:
            remaining -= min_work[name]
            committed = float(state.T.sum())
            best, best_key = None, None
            for c in cands[name]:
                r = state.fit(c, by_memory)
                if r is None:
                    continue
                makespan, ranks = r
                if scoring == "lookahead":  # the final makespan is at least the mean rank load
                    bound = (committed + c.work + remaining) / w
                    key = (max(makespan, bound), c.work, makespan)
                elif scoring == "makespan":
                    key = (makespan, c.work, 0.0)
                else:
                    key = (c.work, makespan, 0.0)
                if best_key is None or key < best_key:
                    best, best_key = (c, ranks), key
            if best is None:
                return None
            state.apply(*best)
            chosen[name] = best
        return chosen

    def _local_search(self, cands, chosen, state: _State, deadline: float) -> None:
        improved = True
        while improved and time.perf_counter() < deadline:
            improved = False
            bottleneck = int(np.argmax(state.T))
            cur = (float(state.T.max()), float(state.T.sum()))

            def load_on_bottleneck(name: str, bottleneck: int = bottleneck) -> float:
                c, ranks = chosen[name]
                if c.fixed:
                    return float(c.t_vec[bottleneck])
                return c.t if bottleneck in ranks else 0.0

            names = [n for n in chosen if load_on_bottleneck(n) > 0]
            names.sort(key=lambda n: -load_on_bottleneck(n))
            for name in names:
                if time.perf_counter() >= deadline:
                    break
                old = chosen[name]
                state.apply(*old, sign=-1.0)
                best, best_key = old, cur
                for c in cands[name]:
                    r = state.fit(c)
                    if r is None:
                        continue
                    makespan, ranks = r
                    key = (makespan, float(state.T.sum()) + c.work)
                    if _better(key, best_key):
                        best, best_key = (c, ranks), key
                state.apply(*best)
                if best is not old:
                    chosen[name] = best
                    improved = True
                    break
            if not improved:
                improved = self._swap(chosen, state, bottleneck, cur, names, deadline)

    @staticmethod
    def _swap(chosen, state: _State, b: int, cur, names, deadline: float) -> bool:
        """Swap a single-shard table on the bottleneck rank with a smaller one elsewhere."""
        singles = [n for n in chosen if not chosen[n][0].fixed and chosen[n][0].k == 1]
        on_b = [n for n in names if n in set(singles)]
        others = sorted((n for n in singles if chosen[n][1][0] != b), key=lambda n: chosen[n][0].t)
        for a in on_b:
            ca = chosen[a][0]
            for o in others:
                if time.perf_counter() >= deadline:
                    return False
                co, r = chosen[o][0], chosen[o][1][0]
                if co.t >= ca.t:
                    break
                delta = ca.t - co.t
                if state.H[r] - co.h + ca.h > state.hcap or state.H[b] - ca.h + co.h > state.hcap:
                    continue
                if state.D[r] - co.d + ca.d > state.dcap or state.D[b] - ca.d + co.d > state.dcap:
                    continue
                T = state.T.copy()
                T[b] -= delta
                T[r] += delta
                if _better((float(T.max()), float(T.sum())), cur):
                    state.apply(ca, [b], -1.0)
                    state.apply(co, [r], -1.0)
                    state.apply(ca, [r])
                    state.apply(co, [b])
                    chosen[a], chosen[o] = (ca, [r]), (co, [b])
                    return True
        return False


class ExhaustivePartitioner(Partitioner):
    """Exact branch-and-bound over every option and rank assignment (small cases only)."""

    @staticmethod
    def search_space(options: dict[str, list[ShardingOption]], world_size: int) -> int:
        """Number of complete assignments the exhaustive search would visit without pruning."""
        size = 1
        for opts in options.values():
            size *= sum(1 if o.ranks_fixed else math.comb(world_size, len(o.shards)) for o in opts)
        return size

    def partition(
        self,
        options: dict[str, list[ShardingOption]],
        topology: Topology,
        base_per_rank: RankCost,
        caps: Storage,
    ) -> dict[str, ShardingOption] | None:
        w = topology.world_size
        cands = {name: [_flatten(o, w) for o in opts] for name, opts in options.items()}
        names = sorted(cands, key=lambda n: -min(c.work for c in cands[n]))
        state = _State(base_per_rank, w, caps)
        best: list = [(math.inf, math.inf), None]
        stack: list[tuple[_Cand, list[int] | None]] = []

        def dfs(i: int) -> None:
            if float(state.T.max()) > best[0][0] * (1 + _REL_EPS):
                return
            if i == len(names):
                key = (float(state.T.max()), float(state.T.sum()))
                if _better(key, best[0]):
                    best[0], best[1] = key, list(stack)
                return
            for c in cands[names[i]]:
                combos = [None] if c.fixed else [list(r) for r in itertools.combinations(range(w), c.k)]
                for ranks in combos:
                    if c.fixed:
                        if np.any(state.H + c.h_vec > state.hcap) or np.any(state.D + c.d_vec > state.dcap):
                            continue
                    elif any(state.H[r] + c.h > state.hcap or state.D[r] + c.d > state.dcap for r in ranks):
                        continue
                    state.apply(c, ranks)
                    stack.append((c, ranks))
                    dfs(i + 1)
                    stack.pop()
                    state.apply(c, ranks, sign=-1.0)

        dfs(0)
        if best[1] is None:
            return None
        return {n: _materialise(c, ranks) for n, (c, ranks) in zip(names, best[1], strict=False)}
