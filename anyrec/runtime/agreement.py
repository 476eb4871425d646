"""Decisions the ranks take together: one value per decision, the same on every rank, or a one-line error.

A decision that changes which collectives a rank makes next (measure a point or skip it, go on while time
is left, which file to read, stop) must never be recomputed per rank from local clocks or load samples:
two ranks that decide differently wait in different collectives until the process group's timeout (ten
minutes). `Agreement.decide` takes each rank's local view of one decision (a JSON value), exchanges the
views through the job's store (host-side, no collective on the device) and returns the agreed value on
every rank: rank 0's, the minimum, the maximum, or whether any rank said yes.

Each decision is numbered in call order; a rank posts what it is deciding (`#n name`) before it waits. So a
mismatch that still happens is named, not waited out: ranks at the same number with different names fail
at once, and a rank that waits `timeout_s` (a minute) for a peer names the peer and the decision it was
last seen at. `ANYREC_DELAY_DECISIONS=RANK:SECONDS[:NAME]` makes that rank sleep before it forms its view
of every decision (or of those named NAME...): a slow rank, for tests of exactly this.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist

from anyrec.runtime.errors import PeerLostError

logger = logging.getLogger(__name__)

AGREE_TIMEOUT_S = 60.0  # a rank that waits this long at a decision for a peer fails the job, naming it
DELAY_ENV = "ANYREC_DELAY_DECISIONS"
How = Literal["main", "min", "max", "any"]


def parse_delay(text: str | None, rank: int) -> tuple[tuple[str, float], ...]:
    """This `rank`'s delays under `ANYREC_DELAY_DECISIONS`: `;`-separated `RANK:SECONDS[:NAME]` entries, each
    a sleep before every decision (or only those whose name starts with NAME), as (NAME or '', seconds)."""
    out = []
    for entry in filter(None, (text or "").split(";")):
        parts = entry.split(":", 2)
        try:
            target, delay = int(parts[0]), float(parts[1])
        except (ValueError, IndexError):
            raise ValueError(f"{DELAY_ENV}={text!r}: expected RANK:SECONDS[:NAME] entries separated by ';', "
                             "e.g. 1:2.5") from None
        if not (0 <= delay <= 3600):
            raise ValueError(f"{DELAY_ENV}={text!r}: seconds must be in [0, 3600]")
        if target == rank:
            out.append((parts[2] if len(parts) > 2 else "", delay))
    return tuple(out)


def _reduce(how: How, values: list[Any]) -> Any:
    if how == "main":
        return values[0]
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    return any(values)


class Agreement:
    """One job's numbered decisions over `world_size` ranks, exchanged through `store` under `scope`
    (unique per agreement: two agreements in one job never share keys)."""

    def __init__(self, rank: int, world_size: int, store: Any | None, scope: str,
                 timeout_s: float = AGREE_TIMEOUT_S, delays: tuple[tuple[str, float], ...] = ()) -> None:
        self.rank, self.world_size, self.scope = rank, world_size, scope
        self.store, self.timeout_s, self.delays = store, timeout_s, delays
        self.count = 0  # decisions taken so far
        self.extra = 0  # the largest `extra` of the last decision over the ranks

    @classmethod
    def begin(cls, rank: int, world_size: int, what: str, timeout_s: float = AGREE_TIMEOUT_S) -> Agreement:
        """The next agreement for `what` (a calibration, a training run) over the default process group.
        Ranks begin their agreements for one `what` in one order, so each rank's n-th is everyone's n-th:
        its keys are numbered by a per-rank counter in the store (no collective; a rank that began one
        more is named at its first decision)."""
        delays = parse_delay(os.environ.get(DELAY_ENV), rank)
        if world_size == 1 or not dist.is_initialized():
            return cls(rank, 1, None, what, timeout_s, delays)
        root = dist.PrefixStore("anyrec/agree/", dist.distributed_c10d._get_default_store())
        n = root.add(f"{what}/begun/{rank}", 1)
        return cls(rank, world_size, dist.PrefixStore(f"{what}/{n}/", root), what, timeout_s, delays)

    def decide(self, name: str, local: Callable[[], Any], how: How = "main",
               extra: Callable[[], int] | None = None) -> Any:
        """The agreed value of decision `name` (`how` reduces the ranks' `local()` views, JSON values);
        `extra()`, where given, is an int each rank adds (a stop signal): its largest value over the ranks
        is `self.extra` afterwards. PeerLostError (one line; the entry point exits 4) on a mismatch or a
        peer that never comes."""
        for prefix, seconds in self.delays:
            if name.startswith(prefix):
                time.sleep(seconds)
        n = self.count
        self.count += 1
        value = local()
        mine = {"name": name, "value": value, "extra": extra() if extra is not None else 0}
        if self.store is None:
            self.extra = mine["extra"]
            return value
        store = self.store
        store.set(f"at/{self.rank}", f"#{n} {name}")
        keys = [f"{n}/{r}" for r in range(self.world_size)]
        store.set(keys[self.rank], json.dumps(mine))
        try:
            store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - the store's timeout error has no public type
            raise PeerLostError(self._late(n, name, keys)) from None
        views = [json.loads(v) for v in store.multi_get(keys)]
        names = [v["name"] for v in views]
        if any(x != name for x in names):
            groups: dict[str, list[int]] = {}
            for r, x in enumerate(names):
                groups.setdefault(x, []).append(r)
            said = "; ".join(f"rank(s) {', '.join(map(str, rs))} at '{x}'" for x, rs in groups.items())
            raise PeerLostError(f"rank {self.rank}: the ranks disagree at decision #{n} of {self.scope}: "
                                     f"{said} (a bug: please report it)")
        if n >= 1:  # every rank posted #n, so every rank has read #n-1: this rank's post of it can go
            store.delete_key(f"{n - 1}/{self.rank}")
        self.extra = max(v["extra"] for v in views)
        return _reduce(how, [v["value"] for v in views])

    def _late(self, n: int, name: str, keys: list[str]) -> str:
        """The line for a wait that timed out: which ranks never posted decision `n`, and where each was
        last seen."""
        store = self.store
        try:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            seen = []
            for r in missing:
                at = store.get(f"at/{r}").decode() if store.check([f"at/{r}"]) else "no decision yet"
                seen.append(f"rank {r} last at {at}")
        except Exception:  # noqa: BLE001 - the store itself is gone (the launcher died)
            missing, seen = [], ["the job's store stopped answering"]
        who = ", ".join(map(str, missing)) or "?"
        return (f"rank {self.rank}: rank(s) {who} did not reach decision #{n} '{name}' of {self.scope} "
                f"within {self.timeout_s:.0f} s ({'; '.join(seen)}): the ranks went different ways")
