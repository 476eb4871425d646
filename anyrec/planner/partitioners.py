"""Choose one option per table and ranks for its shards: minimise the slowest rank's predicted time subject
to every rank's HBM and DDR caps. `GreedyPerfPartitioner` searches under budgets of moves (not of time, so
the plan depends only on the inputs); `ExhaustivePartitioner` is exact, for small cases and the tests.

Both rank plans lexicographically: the slowest rank's time first; then, among plans within
`makespan_tolerance` of the best makespan found, the least total work summed over ranks, then the least
comms time. The second key is physical: less work is less energy and more headroom on every rank, and a
plan that does less is less exposed to errors in the cost model.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np

from anyrec.planner.types import Partitioner, RankCost, ShardingOption, Storage, Topology

_REL_EPS = 1e-9
MAKESPAN_TOLERANCE = 0.005  # plans within 0.5% of the best makespan compete on total work and comms
# Search budgets, in moves per table (see GreedyPerfPartitioner), each at least MIN_SEARCH_MOVES. Sized so
# 1,000 tables on 8 ranks plan in about half a second on a loaded 2-core host; small cases converge first.
LOCAL_SEARCH_MOVES_PER_TABLE = 1
WORK_SEARCH_MOVES_PER_TABLE = 1
REBALANCE_MOVES_PER_TABLE = 5
MIN_SEARCH_MOVES = 2000


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
    comms: float  # total comms seconds over all ranks


def _flatten(opt: ShardingOption, w: int) -> _Cand:
    shards = opt.shards
    comms = sum(s.perf.comms_s for s in shards)
    if opt.ranks_fixed:
        ranks = [s.rank for s in shards]
        tv, hv, dv = np.zeros(w), np.zeros(w), np.zeros(w)
        # One shard per rank (data-parallel, row-wise) assigns; several on a rank accumulate.
        put = np.put if len(set(ranks)) == len(ranks) else np.add.at
        put(tv, ranks, [s.perf.total_s for s in shards])
        put(hv, ranks, [s.storage.hbm_bytes for s in shards])
        put(dv, ranks, [s.storage.ddr_bytes for s in shards])
        return _Cand(opt, True, tv, hv, dv, 0, 0.0, 0.0, 0.0, float(tv.sum()), comms)
    s = shards[0]
    k = len(shards)
    t = s.perf.total_s
    return _Cand(opt, False, None, None, None, k, t, s.storage.hbm_bytes, s.storage.ddr_bytes, k * t, comms)


class _Table:
    """A table's candidates as arrays, so one step of the search scores all of them at once."""

    def __init__(self, cands: list[_Cand], w: int) -> None:
        self.cands = cands
        self.work = np.array([c.work for c in cands])
        self.comms = np.array([c.comms for c in cands])
        self.min_work = float(self.work.min())
        ideal = int(np.lexsort((self.comms, self.work))[0])
        self.ideal = (float(self.work[ideal]), float(self.comms[ideal]))  # least (work, comms) anywhere
        self.min_hbm = min(float(c.h_vec.sum()) if c.fixed else c.k * c.h for c in cands)
        placed = [i for i, c in enumerate(cands) if not c.fixed]
        fixed = [i for i, c in enumerate(cands) if c.fixed]
        self.p_idx = np.array(placed, dtype=np.intp)
        self.p_k = np.array([cands[i].k for i in placed], dtype=np.intp)
        self.p_t = np.array([cands[i].t for i in placed])
        self.p_h = np.array([cands[i].h for i in placed])
        self.p_d = np.array([cands[i].d for i in placed])
        self.p_mask = np.arange(w)[None, :] < self.p_k[:, None]  # first k ranks of each candidate
        self.f_idx = np.array(fixed, dtype=np.intp)
        self.f_t = np.array([cands[i].t_vec for i in fixed]).reshape(len(fixed), w)
        self.f_h = np.array([cands[i].h_vec for i in fixed]).reshape(len(fixed), w)
        self.f_d = np.array([cands[i].d_vec for i in fixed]).reshape(len(fixed), w)


def _materialise(c: _Cand, ranks: list[int] | None) -> ShardingOption:
    """A copy of the option with ranks written into its shards."""
    ranks = [s.rank for s in c.option.shards] if c.fixed else ranks
    shards = [dataclasses.replace(s, rank=r) for s, r in zip(c.option.shards, ranks, strict=True)]
    return dataclasses.replace(c.option, shards=shards)


class _State:
    """Per-rank seconds, HBM and DDR bytes of a partial plan."""

    def __init__(self, base: RankCost, w: int, caps: Storage) -> None:
        self.T = np.full(w, base.perf.total_s)
        self.H = np.full(w, float(base.storage.hbm_bytes))
        self.D = np.full(w, float(base.storage.ddr_bytes))
        self.hcap, self.dcap = float(caps.hbm_bytes), float(caps.ddr_bytes)

    def ranks(self, c: _Cand, by_memory: bool = False) -> list[int] | None:
        """Ranks for the placed shards of a candidate `fit_all` found to fit, as it places them: the least
        loaded (`by_memory`: least filled) ranks with room; None for an option with fixed ranks."""
        if c.fixed:
            return None
        ok = self.H <= self.hcap - c.h
        if c.d:
            ok &= self.D <= self.dcap - c.d
        key = np.where(ok, self.H if by_memory else self.T, np.inf)
        if c.k == 1:  # table-wise, the common case: one argmin instead of a sort
            return [int(key.argmin())]
        return [int(r) for r in np.argsort(key, kind="stable")[: c.k]]

    def fits(self, c: _Cand, ranks: list[int] | None) -> bool:
        """Whether c (its placed shards on `ranks`) stays within every rank's HBM and DDR caps."""
        if c.fixed:
            return not (np.any(self.H + c.h_vec > self.hcap) or np.any(self.D + c.d_vec > self.dcap))
        return not any(self.H[r] + c.h > self.hcap or self.D[r] + c.d > self.dcap for r in ranks)

    def fit_all(self, tab: _Table, by_memory: bool = False) -> np.ndarray:
        """Makespan after adding each candidate of `tab` (inf where it does not fit), all at once, with
        placed shards where `ranks` puts them."""
        out = np.full(len(tab.cands), np.inf)
        tmax = float(self.T.max())
        if len(tab.p_idx):
            ok = self.H[None, :] <= self.hcap - tab.p_h[:, None]
            ok &= self.D[None, :] <= self.dcap - tab.p_d[:, None]
            key = np.where(ok, (self.H if by_memory else self.T)[None, :], np.inf)
            order = np.argsort(key, axis=1, kind="stable")
            loads = np.where(tab.p_mask, self.T[order], -np.inf).max(axis=1) + tab.p_t
            ms = np.maximum(loads, tmax)
            ms[ok.sum(axis=1) < tab.p_k] = np.inf
            out[tab.p_idx] = ms
        if len(tab.f_idx):
            ok = np.all(self.H + tab.f_h <= self.hcap, axis=1) & np.all(self.D + tab.f_d <= self.dcap, axis=1)
            out[tab.f_idx] = np.where(ok, (self.T + tab.f_t).max(axis=1), np.inf)
        return out

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
    """Lexicographic order of (makespan, work) (or (work, comms)) with a relative tolerance."""
    return a[0] < b[0] * (1 - _REL_EPS) or (a[0] <= b[0] * (1 + _REL_EPS) and a[1] < b[1] * (1 - _REL_EPS))


class _Budget:
    """A count of moves left (deterministic, unlike a deadline)."""

    def __init__(self, moves: int) -> None:
        self.left = int(moves)
        self.used = 0

    def spend(self, n: int = 1) -> bool:
        """Charge n moves; False (and the budget marked spent) once it cannot cover them."""
        if n > self.left:
            self.left = 0
            return False
        self.left -= n
        self.used += n
        return True

    @property
    def spent(self) -> bool:
        return self.left <= 0


class GreedyPerfPartitioner(Partitioner):
    """Greedy list scheduling in descending cost with a lower-bound lookahead, local search for the
    makespan, then moves that lower total work and comms while the makespan stays within tolerance. Each
    search stops when no move improves or its budget (`*_moves_per_table` x tables, at least `min_moves`)
    is spent; a move re-places one table (all its options scored) or tries one swap of two tables."""

    def __init__(self, local_search_moves_per_table: int = LOCAL_SEARCH_MOVES_PER_TABLE,
                 work_search_moves_per_table: int = WORK_SEARCH_MOVES_PER_TABLE,
                 rebalance_moves_per_table: int = REBALANCE_MOVES_PER_TABLE,
                 min_moves: int = MIN_SEARCH_MOVES, makespan_tolerance: float = MAKESPAN_TOLERANCE) -> None:
        # Per table: makespan moves after the greedy starts (shared over the starts), total-work moves on
        # the best start, then makespan moves that add no work (plus whatever the work moves left).
        self.moves_per_table = (local_search_moves_per_table, work_search_moves_per_table,
                                rebalance_moves_per_table)
        self.min_moves = min_moves  # floor for each budget, for small cases
        self.makespan_tolerance = makespan_tolerance
        self.stats: dict[str, int] = {}  # moves used per phase by the last call (for reports)

    def budgets(self, n_tables: int) -> tuple[int, int, int]:
        """(local search, work search, rebalance) budgets in moves for `n_tables` tables."""
        return tuple(max(self.min_moves, per * n_tables) for per in self.moves_per_table)

    def partition(self, options: dict[str, list[ShardingOption]], topology: Topology, base_per_rank: RankCost,
                  caps: Storage) -> dict[str, ShardingOption] | None:
        w = topology.world_size
        cands = {name: [_flatten(o, w) for o in opts] for name, opts in options.items()}
        if any(not cs for cs in cands.values()):
            return None
        tabs = {name: _Table(cs, w) for name, cs in cands.items()}
        local_moves, work_moves, rebalance_moves = self.budgets(len(tabs))
        self.stats = {}
        # Multi-start: three scorings of the greedy step, each polished by local search; keep the best.
        starts = ("lookahead", "makespan", "work")
        best, best_key, best_state = None, None, None
        budget = _Budget(local_moves)
        for i, scoring in enumerate(starts):
            if best is not None and budget.spent:
                break  # large cases: the later starts only run while the budget lasts
            found = self._greedy(tabs, base_per_rank, w, caps, False, scoring)
            if found is None and i == 0:  # placing by free memory may fit where placing by load did not
                found = self._greedy(tabs, base_per_rank, w, caps, True, scoring)
            if found is None:
                continue
            chosen, state = found
            # Each start gets an equal share of what is left; what it does not use passes on.
            share = _Budget(budget.left // (len(starts) - i))
            self._local_search(tabs, chosen, state, share)
            budget.spend(share.used)
            key = (float(state.T.max()), float(state.T.sum()))
            self.stats[f"local_search_{scoring}"] = share.used
            if best_key is None or _better(key, best_key):
                best, best_key, best_state = chosen, key, state
        if best is None:
            return None
        bound = best_key[0] * (1 + self.makespan_tolerance)
        work = _Budget(work_moves)
        self._reduce_work(tabs, best, best_state, bound, work)
        # Win back makespan the work moves spent, with moves that add no work.
        rebalance = _Budget(rebalance_moves + work.left)
        self._local_search(tabs, best, best_state, rebalance, True)
        self.stats.update(work_search=work.used, rebalance=rebalance.used)
        return {name: _materialise(c, ranks) for name, (c, ranks) in best.items()}

    @staticmethod
    def _greedy(tabs: dict[str, _Table], base, w, caps, by_memory, scoring="lookahead"):
        tot_w = sum(t.min_work for t in tabs.values()) or 1.0
        tot_h = sum(t.min_hbm for t in tabs.values()) or 1.0
        order = sorted(tabs, key=lambda n: -max(tabs[n].min_work / tot_w, tabs[n].min_hbm / tot_h))
        state = _State(base, w, caps)
        remaining = sum(t.min_work for t in tabs.values())
        chosen: dict[str, tuple[_Cand, list[int] | None]] = {}
        for name in order:
            tab = tabs[name]
            remaining -= tab.min_work
            ms = state.fit_all(tab, by_memory)
            fits = np.isfinite(ms)
            if not fits.any():
                return None
            if scoring == "lookahead":  # the final makespan is at least the mean rank load
                bound = (float(state.T.sum()) + tab.work + remaining) / w
                keys = (ms, tab.work, np.maximum(ms, bound))
            elif scoring == "makespan":
                keys = (tab.work, ms)
            else:
                keys = (ms, tab.work)
            # lexsort sorts by the last key first and is stable, so ties keep the option order.
            c = tab.cands[int(np.lexsort((*keys, ~fits))[0])]
            chosen[name] = (c, state.ranks(c, by_memory))
            state.apply(*chosen[name])
        return chosen, state

    def _reduce_work(self, tabs, chosen, state: _State, bound: float, budget: _Budget) -> None:
        """Re-place single tables at the option with the least (work, comms) whose makespan stays within
        `bound`, biggest savings first, until no move helps or the budget is spent."""
        improved = True
        while improved and not budget.spent:
            improved = False
            # Tables already at their least (work, comms) option cannot help.
            names = sorted((n for n in chosen if (chosen[n][0].work, chosen[n][0].comms) > tabs[n].ideal),
                           key=lambda n: -(chosen[n][0].work - tabs[n].min_work))
            for name in names:
                tab, old = tabs[name], chosen[name]
                if not budget.spend():
                    break
                state.apply(*old, sign=-1.0)
                ok = state.fit_all(tab) <= bound
                c = tab.cands[int(np.lexsort((tab.comms, tab.work, ~ok))[0])] if ok.any() else None
                if c is not None and _better((c.work, c.comms), (old[0].work, old[0].comms)):
                    chosen[name] = (c, state.ranks(c))
                    state.apply(*chosen[name])
                    improved = True
                else:
                    state.apply(*old)

    def _local_search(self, tabs, chosen, state: _State, budget: _Budget, keep_work: bool = False) -> None:
        """Re-place tables on the slowest rank (or swap them) while (makespan, total work) improves;
        with `keep_work`, only moves that do not add work (rebalancing after `_reduce_work`)."""
        improved = True
        while improved and not budget.spent:
            improved = False
            bottleneck = int(np.argmax(state.T))
            cur = (float(state.T.max()), float(state.T.sum()))
            load = {n: float(c.t_vec[bottleneck]) if c.fixed else c.t if bottleneck in ranks else 0.0
                    for n, (c, ranks) in chosen.items()}
            names = sorted((n for n in chosen if load[n] > 0), key=lambda n: -load[n])
            for name in names:
                if not budget.spend():
                    break
                tab, old = tabs[name], chosen[name]
                state.apply(*old, sign=-1.0)
                # Every candidate's makespan at once, shards placed as `ranks` places them.
                makespans = state.fit_all(tab).tolist()
                rest = float(state.T.sum())
                best, best_key = None, cur
                for j, c in enumerate(tab.cands):
                    if makespans[j] == math.inf:
                        continue  # does not fit
                    key = (makespans[j], rest + c.work)
                    if keep_work and key[1] > cur[1] * (1 + _REL_EPS):
                        continue
                    if _better(key, best_key):
                        best, best_key = c, key
                if best is None:
                    state.apply(*old)
                else:
                    chosen[name] = (best, state.ranks(best))
                    state.apply(*chosen[name])
                    improved = True
                    break
            if not improved and not budget.spent:
                improved = self._swap(chosen, state, bottleneck, cur, names, budget)

    @staticmethod
    def _swap(chosen, state: _State, b: int, cur, names, budget: _Budget) -> bool:
        """Swap a single-shard table on the bottleneck rank with a smaller one elsewhere."""
        singles = [n for n in chosen if not chosen[n][0].fixed and chosen[n][0].k == 1]
        on_b = [n for n in names if n in set(singles)]
        others = sorted((n for n in singles if chosen[n][1][0] != b), key=lambda n: chosen[n][0].t)
        for a in on_b:
            ca = chosen[a][0]
            for o in others:
                co, r = chosen[o][0], chosen[o][1][0]
                if co.t >= ca.t:
                    break
                if not budget.spend():
                    return False
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
        return math.prod(sum(1 if o.ranks_fixed else math.comb(world_size, len(o.shards)) for o in opts)
                         for opts in options.values())

    def __init__(self, makespan_tolerance: float = MAKESPAN_TOLERANCE) -> None:
        self.makespan_tolerance = makespan_tolerance

    def partition(self, options: dict[str, list[ShardingOption]], topology: Topology, base_per_rank: RankCost,
                  caps: Storage) -> dict[str, ShardingOption] | None:
        w = topology.world_size
        cands = {name: [_flatten(o, w) for o in opts] for name, opts in options.items()}
        names = sorted(cands, key=lambda n: -min(c.work for c in cands[n]))
        # Least work of the tables not yet placed, for pruning the second pass.
        rest = [sum(min(c.work for c in cands[n]) for n in names[i:]) for i in range(len(names) + 1)]
        state = _State(base_per_rank, w, caps)
        stack: list[tuple[_Cand, list[int] | None]] = []

        def search(bound: float | None) -> tuple[tuple, list | None]:
            """Pass 1 (bound None): least (makespan, work). Pass 2: least (work, comms) with every
            rank within `bound`."""
            best: list = [(math.inf, math.inf), None]

            def dfs(i: int, work: float, comms: float) -> None:
                if bound is None:
                    if float(state.T.max()) > best[0][0] * (1 + _REL_EPS):
                        return
                elif float(state.T.max()) > bound or work + rest[i] > best[0][0] * (1 + _REL_EPS):
                    return
                if i == len(names):
                    key = (float(state.T.max()), float(state.T.sum())) if bound is None else (work, comms)
                    if _better(key, best[0]):
                        best[0], best[1] = key, list(stack)
                    return
                for c in cands[names[i]]:
                    combos = [None] if c.fixed else [list(r) for r in itertools.combinations(range(w), c.k)]
                    for ranks in combos:
                        if not state.fits(c, ranks):
                            continue
                        state.apply(c, ranks)
                        stack.append((c, ranks))
                        dfs(i + 1, work + c.work, comms + c.comms)
                        stack.pop()
                        state.apply(c, ranks, sign=-1.0)

            dfs(0, 0.0, 0.0)
            return best[0], best[1]

        key, found = search(None)
        if found is None:
            return None
        if self.makespan_tolerance > 0:
            _, relaxed = search(key[0] * (1 + self.makespan_tolerance))
            found = relaxed or found
        return {n: _materialise(c, ranks) for n, (c, ranks) in zip(names, found, strict=False)}
