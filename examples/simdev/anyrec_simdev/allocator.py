"""simdev's simulated caching allocator: CUDA's accounting, made simple and exact, over a fixed capacity.

The rules (what `torch.simdev.memory_*` report):

- every request is rounded up to a multiple of 512 bytes (512 at least); `allocated` counts rounded sizes;
- a rounded request of at most 1 MiB comes from the small pool: 2 MiB segments split into blocks (best fit:
  the smallest free block that fits, ties to the oldest segment and lowest offset); a freed block merges
  with free neighbours and is reused;
- a larger one comes from the large pool: the smallest free large block that fits (ties to the oldest), split
  where more than 1 MiB would be left over, else a new segment: 20 MiB for a request under 10 MiB, the
  request rounded up to a multiple of 2 MiB otherwise; a freed block merges with free neighbours (CUDA's
  caching allocator without expandable segments: kLargeBuffer, kMinLargeAlloc, kSmallSize);
- segments stay reserved until `empty_cache()` releases those with nothing allocated in them;
- the capacity bounds `reserved`: when a new segment would pass it, every empty segment is released first
  (as CUDA does), and if it still does not fit, `torch.OutOfMemoryError` is raised.

With expandable segments (`set_allocator_settings("expandable_segments:True")` or SIMDEV_ALLOC_CONF, as
PYTORCH_CUDA_ALLOC_CONF sets CUDA's), each pool grows segments of address space (9/8 of the capacity,
as CUDA's; another when one is full) whose pages are mapped on demand: 2 MiB pages for the small pool,
20 MiB for the large one (kSmallBuffer, kLargeBuffer). A request takes the best-fitting free mapped block
(split wherever 512 bytes or more are left); failing that, the lowest unmapped range (with the free block
just before it) is mapped, page by page, until the request fits. Freed blocks merge with free neighbours.
`reserved` counts mapped pages; when mapping would pass the capacity, every whole free page is unmapped
first, then the request is tried again. Fragmentation then costs at most the partly used pages at the
edges of free ranges (`pages_in_use_bytes`: the pages holding an allocated byte).

Nothing here touches host memory: the device asks for the accounting before (or, for an op whose output
size it cannot know ahead, right after) the host bytes are allocated.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import operator
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

ROUND_BYTES = 512
SMALL_REQUEST_BYTES = 1 << 20  # requests up to this size come from the small pool
SMALL_SEGMENT_BYTES = 2 << 20
LARGE_SEGMENT_ROUND_BYTES = 2 << 20
MIN_LARGE_ALLOC_BYTES = 10 << 20  # requests below this share a LARGE_BUFFER_BYTES segment
LARGE_BUFFER_BYTES = 20 << 20
DEFAULT_CAPACITY_BYTES = 32 << 30
CAPACITY_ENV = "SIMDEV_MEMORY_BYTES"
ALLOC_CONF_ENV = "SIMDEV_ALLOC_CONF"
SMALL_PAGE_BYTES = 2 << 20  # expandable segments' mapping unit, small pool (CUDA's kSmallBuffer)
LARGE_PAGE_BYTES = 20 << 20  # and large pool (kLargeBuffer)
UNMAPPED = -1  # a block's request field: address space with no memory behind it
_OFFSET = operator.itemgetter(0)  # a block's offset: blocks are sorted by it

POOLS = ("small_pool", "large_pool")
# memory_stats' statistics, as CUDA names them (bytes or counts, each with current/peak/allocated/freed).
STATS = ("allocated_bytes", "reserved_bytes", "active_bytes", "allocation", "segment", "active",
         # simdev's own: expandable segments' pages holding an allocated byte, which an out-of-memory retry
         # cannot unmap (its peak is the least capacity the run fits in)
         "pages_in_use_bytes")


class CapacityError(ValueError):
    """SIMDEV_MEMORY_BYTES is not a positive whole number of bytes."""


def capacity_from_env(environ: Mapping[str, str] = os.environ) -> int:
    """The simulated device's capacity in bytes: `SIMDEV_MEMORY_BYTES` where set, else 32 GiB."""
    text = environ.get(CAPACITY_ENV, "").strip()
    if not text:
        return DEFAULT_CAPACITY_BYTES
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise CapacityError(f"{CAPACITY_ENV} must be a positive whole number of bytes, got {text!r}")
    return value


class AllocConfError(ValueError):
    """An allocator setting simdev does not know, or a bad value."""


def parse_alloc_conf(text: str) -> dict[str, bool]:
    """Settings written as PYTORCH_CUDA_ALLOC_CONF writes them (`key:value,...`); simdev knows
    `expandable_segments` (True/False) only."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = item.partition(":")
        if key.strip() != "expandable_segments" or value.strip() not in ("True", "False"):
            raise AllocConfError(f"allocator setting {item!r} unknown to simdev (it knows "
                                 f"expandable_segments:True|False)")
        out["expandable_segments"] = value.strip() == "True"
    return out


def round_size(nbytes: int) -> int:
    """A request's size as allocated: rounded up to a multiple of 512 bytes."""
    return max(ROUND_BYTES, -(-nbytes // ROUND_BYTES) * ROUND_BYTES)


def segment_size(rounded: int) -> int:
    """The size of a new segment for a rounded request."""
    if rounded <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if rounded < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-rounded // LARGE_SEGMENT_ROUND_BYTES) * LARGE_SEGMENT_ROUND_BYTES


def format_bytes(n: int) -> str:
    """`n` bytes as CUDA's messages write sizes (two decimals of GiB, MiB or KiB), exact bytes after."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


@dataclass(slots=True)
class Stat:
    """One statistic: its current value, peak since reset, and totals added and removed."""

    current: int = 0
    peak: int = 0
    allocated: int = 0
    freed: int = 0

    def add(self, n: int) -> None:
        self.current += n
        self.allocated += n
        self.peak = max(self.peak, self.current)

    def sub(self, n: int) -> None:
        self.current -= n
        self.freed += n


@dataclass
class Segment:
    """A reserved piece of device memory; `blocks` are [offset, size, request] sorted by offset, request
    the rounded size allocated there (0: free)."""

    size_bytes: int
    small: bool
    number: int  # creation order: ties go to the oldest
    blocks: list[list[int]] = field(default_factory=list)
    page_bytes: int = 0  # an expandable segment's mapping unit (0: a plain segment, mapped whole)
    users: dict[int, int] = field(default_factory=dict)  # page index -> allocated blocks on it

    def __post_init__(self) -> None:
        self.blocks = [[0, self.size_bytes, UNMAPPED if self.page_bytes else 0]]

    @property
    def empty(self) -> bool:
        return all(b[2] <= 0 for b in self.blocks)


@dataclass(frozen=True, eq=False)
class Block:
    """A live allocation: where it is and its rounded size."""

    segment: Segment
    offset: int
    rounded_bytes: int


class CachingAllocator:
    """One simulated device's memory: segments, blocks, CUDA's statistics and the capacity."""

    def __init__(self, capacity_bytes: int, device: str = "simdev:0", expandable: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self.device = device
        self.expandable = expandable
        self.segments: list[Segment] = []
        self.stats = {(s, p): Stat() for s in STATS for p in ("all", *POOLS)}
        # What every allocation and free moves, per pool: (byte statistics, count statistics), each for
        # "all" and the pool (malloc and free run once per op on the device: no lookups by name there).
        self._use_stats = {pool: (self._stats_of(("allocated_bytes", "active_bytes"), pool),
                                  self._stats_of(("allocation", "active"), pool)) for pool in POOLS}
        self._page_stats = {pool: self._stats_of(("pages_in_use_bytes",), pool) for pool in POOLS}
        # The free blocks of each pool (by `small`), sorted as best fit picks them: (size, segment number,
        # offset); and the block each of those names. Kept with every change of a block, so that a best
        # fit is a search, not a walk over every block of the pool.
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._free_block: dict[tuple[int, int], tuple[Segment, list[int]]] = {}
        self.num_ooms = 0
        self.num_alloc_retries = 0
        self._made = 0
        self._lock = threading.Lock()
        # Frees arriving while the lock is held (a finalizer run by the garbage collector inside malloc,
        # or another thread) wait here; every operation applies them first.
        self._pending: collections.deque[Block] = collections.deque()

    # ---- statistics ---------------------------------------------------------------------------------

    def _stats_of(self, names: tuple[str, ...], pool: str) -> tuple[Stat, ...]:
        return tuple(self.stats[name, p] for name in names for p in ("all", pool))

    def _count(self, stat: str, pool: str, n: int) -> None:
        for s in (self.stats[stat, "all"], self.stats[stat, pool]):
            if n >= 0:
                s.add(n)
            else:
                s.sub(-n)

    def _count_use(self, pool: str, rounded: int) -> None:
        """An allocation of `rounded` bytes in `pool`: allocated and active bytes and counts (Stat.add)."""
        nbytes, count = self._use_stats[pool]
        for s in nbytes:
            s.current += rounded
            s.allocated += rounded
            if s.current > s.peak:
                s.peak = s.current
        for s in count:
            s.current += 1
            s.allocated += 1
            if s.current > s.peak:
                s.peak = s.current

    def _count_release(self, pool: str, rounded: int) -> None:
        """A free of `rounded` bytes in `pool`: the inverse of _count_use (Stat.sub)."""
        nbytes, count = self._use_stats[pool]
        for s in nbytes:
            s.current -= rounded
            s.freed += rounded
        for s in count:
            s.current -= 1
            s.freed += 1

    def stat(self, name: str, pool: str = "all") -> Stat:
        """A copy of statistic `name` (see STATS) for `pool` ("all", "small_pool", "large_pool")."""
        with self._locked():
            s = self.stats[name, pool]
            return Stat(s.current, s.peak, s.allocated, s.freed)

    def memory_stats(self) -> dict[str, int]:
        """CUDA's `memory_stats()` keys (`allocated_bytes.all.current`, ...), sorted."""
        with self._locked():
            out = {f"{s}.{p}.{k}": getattr(self.stats[s, p], k)
                   for s, p in self.stats for k in ("current", "peak", "allocated", "freed")}
            out.update(num_ooms=self.num_ooms, num_alloc_retries=self.num_alloc_retries)
        return dict(sorted(out.items()))

    def reset_peak(self) -> None:
        """Every peak back to its current value."""
        with self._locked():
            for s in self.stats.values():
                s.peak = s.current

    def reset_accumulated(self) -> None:
        """Every total (allocated, freed) and the OOM and retry counts back to zero."""
        with self._locked():
            for s in self.stats.values():
                s.allocated = s.freed = 0
            self.num_ooms = self.num_alloc_retries = 0

    # ---- allocation ---------------------------------------------------------------------------------

    def set_expandable(self, expandable: bool) -> None:
        """Switch expandable segments on or off: before the first allocation only (nothing reserved)."""
        with self._locked():
            if expandable != self.expandable and self.segments:
                raise AllocConfError(f"{self.device}: expandable_segments set after memory was reserved; "
                                     "set it before the first allocation")
            self.expandable = expandable

    def malloc(self, nbytes: int) -> Block:
        """A block for `nbytes` (rounded); raises torch.OutOfMemoryError past the capacity."""
        rounded = round_size(nbytes)
        small = rounded <= SMALL_REQUEST_BYTES
        if self.expandable:
            return self._malloc_expandable(rounded, small)
        with self._lock:
            self._apply_frees()
            found = self._best_fit(rounded, small)
            if found is None:
                size = segment_size(rounded)
                if self._reserved() + size > self.capacity_bytes:
                    self.num_alloc_retries += 1
                    self._release_empty()
                    if self._reserved() + size > self.capacity_bytes:
                        self.num_ooms += 1
                        raise torch.OutOfMemoryError(self._oom_message(rounded, size))
                seg = Segment(size, small, self._made)
                self._made += 1
                self.segments.append(seg)
                pool = POOLS[not small]
                self._count("reserved_bytes", pool, size)
                self._count("segment", pool, 1)
                self._index_add(seg, seg.blocks[0])
                found = (seg, seg.blocks[0])
            seg, free = found
            self._index_remove(seg, free)
            # split: the rest stays free (a large block only where more than a small request is left)
            if free[1] - rounded > (0 if small else SMALL_REQUEST_BYTES):
                self._split(seg, free, rounded)
            free[2] = rounded
            self._count_use(POOLS[not small], rounded)
            return Block(seg, free[0], rounded)

    def _malloc_expandable(self, rounded: int, small: bool) -> Block:
        with self._lock:
            self._apply_frees()
            found = self._best_fit(rounded, small) or self._map_for(rounded, small)
            if found is None:
                self.num_alloc_retries += 1
                self._release_empty()
                found = self._best_fit(rounded, small) or self._map_for(rounded, small)
                if found is None:
                    self.num_ooms += 1
                    page = SMALL_PAGE_BYTES if small else LARGE_PAGE_BYTES
                    raise torch.OutOfMemoryError(self._oom_message(rounded, -(-rounded // page) * page))
            seg, free = found
            self._index_remove(seg, free)
            if free[1] - rounded >= ROUND_BYTES:  # CUDA splits expandable blocks down to its minimum block
                self._split(seg, free, rounded)
            free[2] = rounded
            pool = POOLS[not small]
            self._count_use(pool, rounded)
            used = self._use_pages(seg, free[0], rounded, 1)
            if used:
                for stat in self._page_stats[pool]:
                    stat.add(used)
            return Block(seg, free[0], rounded)

    @staticmethod
    def _use_pages(seg: Segment, offset: int, size: int, delta: int) -> int:
        """Add `delta` users to the pages of [offset, offset + size); the bytes of pages that gained their
        first user (or lost their last: negative)."""
        changed = 0
        for page in range(offset // seg.page_bytes, (offset + size - 1) // seg.page_bytes + 1):
            before = seg.users.get(page, 0)
            seg.users[page] = before + delta
            if (before == 0) != (before + delta == 0):
                changed += seg.page_bytes if delta > 0 else -seg.page_bytes
            if before + delta == 0:
                del seg.users[page]
        return changed

    def _map_for(self, rounded: int, small: bool) -> tuple[Segment, list[int]] | None:
        """Map pages so that a free block of at least `rounded` bytes exists, as CUDA's
        find_expandable_block: the lowest unmapped range (joined with the free block just before it) with
        room enough in the pool's expandable segments, else in a new one (address space of 9/8 of the
        capacity, nothing mapped); None where mapping would pass the capacity."""
        segs = [s for s in self.segments if s.small == small and s.page_bytes]
        for seg in segs:
            found = self._room_in(seg, rounded)
            if found is not None:
                return self._map_run(seg, *found, rounded)
        page = SMALL_PAGE_BYTES if small else LARGE_PAGE_BYTES
        space = -(-max(self.capacity_bytes + self.capacity_bytes // 8, rounded) // page) * page
        if self._reserved() + -(-rounded // page) * page > self.capacity_bytes:
            return None  # no memory for it whatever the address space
        seg = Segment(space, small, self._made, page_bytes=page)
        self._made += 1
        self.segments.append(seg)
        return self._map_run(seg, 0, 0, rounded)

    @staticmethod
    def _room_in(seg: Segment, rounded: int) -> tuple[int, int] | None:
        """(first block of the run, first unmapped block): the lowest unmapped block of `seg` that, with
        the free block before it and the free or unmapped blocks after, spans `rounded` bytes."""
        blocks = seg.blocks
        for i, b in enumerate(blocks):
            if b[2] != UNMAPPED:
                continue
            start = i - 1 if i > 0 and blocks[i - 1][2] == 0 else i
            room, j = 0, start
            while j < len(blocks) and blocks[j][2] <= 0 and room < rounded:
                room, j = room + blocks[j][1], j + 1
            if room >= rounded:
                return start, i
        return None

    def _map_run(self, seg: Segment, start: int, i: int, rounded: int) -> tuple[Segment, list[int]] | None:
        """Map the unmapped blocks from `i` on, whole pages, until the free run from `start` covers
        `rounded` bytes; None (nothing mapped) where that would pass the capacity."""
        blocks = seg.blocks
        need = rounded - (blocks[start][1] if start < i else 0)
        pages, k = 0, i
        while need > 0:
            take = blocks[k][1] if blocks[k][2] == 0 else min(
                blocks[k][1], -(-need // seg.page_bytes) * seg.page_bytes)
            pages += take if blocks[k][2] == UNMAPPED else 0
            need, k = need - take, k + 1
        if self._reserved() + pages > self.capacity_bytes:
            return None
        target = blocks[start]  # the run merges into its first block
        self._map(seg, i, pages)
        return seg, target

    def _map(self, seg: Segment, i: int, nbytes: int) -> None:
        """Map `nbytes` (whole pages) of the address space from unmapped block `i` on; the mapped range
        merges with the free blocks around it."""
        pool, left, blocks = POOLS[not seg.small], nbytes, seg.blocks
        while left > 0:
            b = blocks[i]
            if b[2] == UNMAPPED:
                take = min(b[1], left)
                if take < b[1]:
                    blocks.insert(i + 1, [b[0] + take, b[1] - take, UNMAPPED])
                    b[1] = take
                b[2] = 0
                self._count("reserved_bytes", pool, take)
                left -= take
            i += 1
        self._merge_free(seg)
        self._index_segment(seg)

    @staticmethod
    def _merge_free(seg: Segment) -> None:
        merged: list[list[int]] = []
        for b in seg.blocks:
            if merged and b[2] <= 0 and merged[-1][2] == b[2]:
                merged[-1][1] += b[1]
            else:
                merged.append(b)
        seg.blocks[:] = merged

    def _unmap_free(self, seg: Segment) -> None:
        """Unmap every whole page inside a free block of expandable segment `seg` (CUDA's unmap_block)."""
        page, pool, out = seg.page_bytes, POOLS[not seg.small], []
        for b in seg.blocks:
            lo, hi = -(-b[0] // page) * page, (b[0] + b[1]) // page * page
            if b[2] != 0 or hi <= lo:
                out.append(b)
                continue
            out.extend(x for x in ([b[0], lo - b[0], 0], [lo, hi - lo, UNMAPPED],
                                   [hi, b[0] + b[1] - hi, 0]) if x[1] > 0)
            self._count("reserved_bytes", pool, -(hi - lo))
        seg.blocks[:] = out
        self._merge_free(seg)
        self._index_segment(seg)

    def free(self, block: Block) -> None:
        """Give `block` back (safe from a finalizer: applied now, or by the next operation)."""
        self._pending.append(block)
        if self._lock.acquire(blocking=False):
            try:
                self._apply_frees()
            finally:
                self._lock.release()

    def empty_cache(self) -> None:
        """Release every segment with nothing allocated in it."""
        with self._locked():
            self._release_empty()

    def memory_allocated(self) -> int:
        return self.stat("allocated_bytes").current

    def memory_reserved(self) -> int:
        return self.stat("reserved_bytes").current

    def free_bytes(self) -> int:
        """Capacity not reserved."""
        return self.capacity_bytes - self.memory_reserved()

    # ---- internals ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._apply_frees()
            yield

    def _apply_frees(self) -> None:
        while self._pending:
            block = self._pending.popleft()
            seg, pool = block.segment, POOLS[not block.segment.small]
            blocks = seg.blocks
            i = bisect.bisect_left(blocks, block.offset, key=_OFFSET)
            blocks[i][2] = 0
            self._count_release(pool, block.rounded_bytes)
            if seg.page_bytes:
                unused = self._use_pages(seg, block.offset, block.rounded_bytes, -1)
                if unused:
                    for stat in self._page_stats[pool]:
                        stat.sub(-unused)
            if i + 1 < len(blocks) and blocks[i + 1][2] == 0:  # merge with free neighbours
                self._index_remove(seg, blocks[i + 1])
                blocks[i][1] += blocks.pop(i + 1)[1]
            if i > 0 and blocks[i - 1][2] == 0:
                self._index_remove(seg, blocks[i - 1])
                blocks[i - 1][1] += blocks.pop(i)[1]
                i -= 1
            self._index_add(seg, blocks[i])

    def _best_fit(self, rounded: int, small: bool) -> tuple[Segment, list[int]] | None:
        """The smallest free block of the pool that fits, ties to the oldest segment and lowest offset."""
        free = self._free[small]
        i = bisect.bisect_left(free, (rounded,))
        return self._free_block[free[i][1:]] if i < len(free) else None

    # ---- the free-block index: updated before a block's size or offset changes ---------------------

    def _index_add(self, seg: Segment, b: list[int]) -> None:
        bisect.insort(self._free[seg.small], (b[1], seg.number, b[0]))
        self._free_block[seg.number, b[0]] = (seg, b)

    def _index_remove(self, seg: Segment, b: list[int]) -> None:
        free = self._free[seg.small]
        del free[bisect.bisect_left(free, (b[1], seg.number, b[0]))]
        del self._free_block[seg.number, b[0]]

    def _index_segment(self, seg: Segment) -> None:
        """Index `seg`'s free blocks afresh (after its blocks were rebuilt; none when it is gone)."""
        free = self._free[seg.small]
        free[:] = [key for key in free if key[1] != seg.number]
        for key in [key for key in self._free_block if key[0] == seg.number]:
            del self._free_block[key]
        if any(s is seg for s in self.segments):
            for b in seg.blocks:
                if b[2] == 0:
                    self._index_add(seg, b)

    def _split(self, seg: Segment, free: list[int], rounded: int) -> None:
        """Cut free block `free` (out of the index) to `rounded` bytes; the rest a free block after it."""
        rest = [free[0] + rounded, free[1] - rounded, 0]
        seg.blocks.insert(bisect.bisect_right(seg.blocks, free[0], key=_OFFSET), rest)
        free[1] = rounded
        self._index_add(seg, rest)

    def _reserved(self) -> int:
        return self.stats["reserved_bytes", "all"].current

    def _release_empty(self) -> None:
        for seg in self.segments:
            if seg.page_bytes:
                self._unmap_free(seg)
        for seg in [s for s in self.segments if s.empty and not s.page_bytes]:
            self.segments.remove(seg)
            self._index_segment(seg)
            pool = POOLS[not seg.small]
            self._count("reserved_bytes", pool, -seg.size_bytes)
            self._count("segment", pool, -1)

    def _oom_message(self, rounded: int, segment: int) -> str:
        free = self.capacity_bytes - self._reserved()
        allocated = self.stats["allocated_bytes", "all"].current
        return (f"simdev out of memory: tried to allocate {format_bytes(rounded)} on {self.device} (a new "
                f"segment of {format_bytes(segment)}); {format_bytes(free)} free of "
                f"{format_bytes(self.capacity_bytes)} capacity, {format_bytes(allocated)} allocated and "
                f"{format_bytes(self._reserved())} reserved by simdev; set {CAPACITY_ENV} for a larger "
                f"simulated device")
