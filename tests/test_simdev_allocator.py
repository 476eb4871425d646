"""simdev's simulated caching allocator (examples/simdev/anyrec_simdev/allocator.py), rule by rule: rounding,
pools and segments, reuse, peaks and their reset, empty_cache, the capacity and its out-of-memory error.

The module is loaded from its file alone: importing the package would register the device in this process.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import simdev_allocator

MiB = 1 << 20


A = simdev_allocator()


def test_requests_are_rounded_to_512_bytes_and_counted_rounded():
    alloc = A.CachingAllocator(64 * MiB)
    blocks = [alloc.malloc(n) for n in (1, 512, 513, 4000)]
    assert [b.rounded_bytes for b in blocks] == [512, 512, 1024, 4096]
    assert alloc.memory_allocated() == 512 + 512 + 1024 + 4096
    assert alloc.memory_reserved() == 2 * MiB  # all from one small-pool segment
    assert alloc.stat("allocation").current == 4 and alloc.stat("segment", "small_pool").current == 1


def test_small_blocks_split_one_segment_and_are_reused_after_free():
    alloc = A.CachingAllocator(64 * MiB)
    a, b = alloc.malloc(MiB), alloc.malloc(MiB)  # exactly fill one 2 MiB segment
    assert (a.segment is b.segment, b.offset, alloc.memory_reserved()) == (True, MiB, 2 * MiB)
    c = alloc.malloc(1)  # the segment is full: a second one
    assert alloc.memory_reserved() == 4 * MiB and c.segment is not a.segment
    alloc.free(a)
    again = alloc.malloc(MiB)  # a's block, not a new segment
    assert (again.segment, again.offset, alloc.memory_reserved()) == (a.segment, 0, 4 * MiB)


def test_freed_neighbours_merge_into_one_block():
    alloc = A.CachingAllocator(64 * MiB)
    quarters = [alloc.malloc(MiB // 2) for _ in range(4)]
    alloc.free(quarters[1])
    alloc.free(quarters[2])
    merged = alloc.malloc(MiB)  # fits only in the two freed quarters as one block
    assert (merged.segment, merged.offset) == (quarters[0].segment, MiB // 2)
    assert alloc.memory_reserved() == 2 * MiB and alloc.memory_allocated() == 2 * MiB


def test_large_requests_share_20_mib_buffers_below_10_mib_and_split_cached_blocks():
    alloc = A.CachingAllocator(256 * MiB)
    a = alloc.malloc(3 * MiB)  # under 10 MiB: a 20 MiB segment
    assert alloc.memory_reserved() == alloc.stat("reserved_bytes", "large_pool").current == 20 * MiB
    b = alloc.malloc(17 * MiB)  # the rest of that segment, split off it
    assert (b.segment, b.offset, alloc.memory_reserved()) == (a.segment, 3 * MiB, 20 * MiB)
    big = alloc.malloc(11 * MiB + 1)  # 10 MiB or more: its own segment, rounded up to 2 MiB
    assert alloc.memory_reserved() == 20 * MiB + 12 * MiB
    alloc.free(big)
    assert alloc.memory_allocated() == 20 * MiB and alloc.memory_reserved() == 32 * MiB  # cached
    c = alloc.malloc(10 * MiB)  # the cached 12 MiB block, split: 2 MiB (more than 1 MiB) stays free
    assert (c.segment, c.offset, alloc.memory_reserved()) == (big.segment, 0, 32 * MiB)
    d = alloc.malloc(2 * MiB)  # that 2 MiB remainder
    assert (d.segment, d.offset) == (big.segment, 10 * MiB)
    alloc.free(d)
    e = alloc.malloc(MiB + MiB // 2)  # 0.5 MiB would be left: the block is taken whole, not split
    assert (e.segment, e.offset) == (big.segment, 10 * MiB) and len(big.segment.blocks) == 2
    assert alloc.memory_allocated() == 20 * MiB + 10 * MiB + MiB + MiB // 2


def test_peaks_hold_until_reset():
    alloc = A.CachingAllocator(64 * MiB)
    blocks = [alloc.malloc(11 * MiB) for _ in range(3)]  # three 12 MiB segments
    for b in blocks[1:]:
        alloc.free(b)
    allocated, reserved = alloc.stat("allocated_bytes"), alloc.stat("reserved_bytes")
    assert (allocated.current, allocated.peak) == (11 * MiB, 33 * MiB)
    assert (reserved.current, reserved.peak) == (36 * MiB, 36 * MiB)
    alloc.reset_peak()
    assert alloc.stat("allocated_bytes").peak == 11 * MiB and alloc.stat("reserved_bytes").peak == 36 * MiB
    alloc.empty_cache()
    assert alloc.stat("reserved_bytes").peak == 36 * MiB and alloc.memory_reserved() == 12 * MiB


def test_empty_cache_releases_only_segments_with_nothing_allocated():
    alloc = A.CachingAllocator(64 * MiB)
    keep, drop, large = alloc.malloc(100), alloc.malloc(12 * MiB), alloc.malloc(14 * MiB)
    second = alloc.malloc(MiB)  # beside `keep` in the small segment
    alloc.free(drop)
    alloc.free(second)
    alloc.empty_cache()
    assert alloc.memory_reserved() == 2 * MiB + 14 * MiB  # the 12 MiB segment is gone
    assert keep.segment in alloc.segments and large.segment in alloc.segments


def test_past_the_capacity_cached_segments_go_first_then_out_of_memory():
    alloc = A.CachingAllocator(23 * MiB)
    alloc.free(alloc.malloc(12 * MiB))  # a cached 12 MiB segment
    held = alloc.malloc(22 * MiB)  # 12 + 22 > 23: the cached segment is released, then it fits
    assert alloc.memory_reserved() == 22 * MiB and alloc.memory_stats()["num_alloc_retries"] == 1
    with pytest.raises(torch.OutOfMemoryError) as e:
        alloc.malloc(1000)
    assert str(e.value).startswith(
        "simdev out of memory: tried to allocate 1.00 KiB (1024 bytes) on simdev:0 (a new segment of "
        "2.00 MiB (2097152 bytes)); 1.00 MiB (1048576 bytes) free of 23.00 MiB (24117248 bytes) capacity, "
        "22.00 MiB (23068672 bytes) allocated and 22.00 MiB (23068672 bytes) reserved by simdev; set "
        "SIMDEV_MEMORY_BYTES")
    assert alloc.memory_stats()["num_ooms"] == 1 and alloc.memory_allocated() == 22 * MiB
    alloc.free(held)
    assert alloc.malloc(1000).rounded_bytes == 1024  # the empty large segment released for it


def test_memory_stats_use_cudas_key_names():
    alloc = A.CachingAllocator(64 * MiB)
    alloc.malloc(3 * MiB)
    stats = alloc.memory_stats()
    assert stats["allocated_bytes.all.current"] == stats["allocated_bytes.large_pool.peak"] == 3 * MiB
    assert stats["reserved_bytes.all.current"] == 20 * MiB and stats["segment.large_pool.current"] == 1
    assert stats["allocation.all.allocated"] == 1 and stats["allocated_bytes.small_pool.current"] == 0
    assert list(stats) == sorted(stats)
    alloc.reset_accumulated()
    assert alloc.memory_stats()["allocation.all.allocated"] == 0


def test_a_free_that_arrives_while_the_allocator_is_busy_is_applied_by_the_next_operation():
    alloc = A.CachingAllocator(64 * MiB)
    b = alloc.malloc(3 * MiB)
    with alloc._lock:  # as when the garbage collector runs a finalizer inside malloc
        alloc.free(b)
    assert alloc.memory_allocated() == 0


def test_the_capacity_comes_from_the_environment():
    assert A.capacity_from_env({}) == 32 << 30
    assert A.capacity_from_env({"SIMDEV_MEMORY_BYTES": " 1048576 "}) == MiB
    for bad in ("1.5e9", "0", "-4", "8GiB"):
        with pytest.raises(A.CapacityError) as e:
            A.capacity_from_env({"SIMDEV_MEMORY_BYTES": bad})
        assert str(e.value) == f"SIMDEV_MEMORY_BYTES must be a positive whole number of bytes, got {bad!r}"
