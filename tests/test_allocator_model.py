"""The reserved-memory model (anyrec.planner.memory.allocator_slack) against the allocator it models:
simdev's caching allocator with expandable segments (examples/simdev/anyrec_simdev/allocator.py, loaded
from its file), and the backends' switch that turns expandable segments on."""

from __future__ import annotations

import random

import pytest
import torch

from anyrec.backends._gpu import configure_allocator
from anyrec.planner.memory import ALLOC_LARGE_PAGE_BYTES, allocator_slack

from .conftest import simdev_allocator

MiB = 1 << 20


A = simdev_allocator()


def _consistent(alloc) -> None:
    """Blocks tile each segment, unmapped ranges are whole pages, `reserved` is the mapped bytes."""
    mapped = 0
    for seg in alloc.segments:
        offset = 0
        for b in seg.blocks:
            assert b[0] == offset
            offset += b[1]
            if b[2] == A.UNMAPPED:
                assert b[0] % seg.page_bytes == 0 and b[1] % seg.page_bytes == 0
            else:
                mapped += b[1]
        assert offset == seg.size_bytes
    assert mapped == alloc.memory_reserved() >= alloc.stat("pages_in_use_bytes").current


def test_expandable_segments_map_pages_on_demand_and_reuse_freed_space_for_any_size():
    alloc = A.CachingAllocator(200 * MiB, expandable=True)
    a = alloc.malloc(30 * MiB)
    assert alloc.memory_reserved() == 40 * MiB  # two 20 MiB pages
    b = alloc.malloc(30 * MiB)
    assert (b.offset, alloc.memory_reserved()) == (30 * MiB, 60 * MiB)  # the rest of page 2, then page 3
    alloc.free(a)
    c = alloc.malloc(50 * MiB)  # a's 30 MiB hole is too small: mapped after b, joined to its free tail
    assert (c.offset, alloc.memory_reserved()) == (60 * MiB, 120 * MiB)
    small = alloc.malloc(100)
    assert alloc.stat("reserved_bytes", "small_pool").current == 2 * MiB and small.rounded_bytes == 512
    alloc.free(b)
    d = alloc.malloc(40 * MiB)  # a's and b's space merged: no new page
    assert (d.offset, alloc.memory_reserved()) == (0, 122 * MiB)
    _consistent(alloc)


def test_past_the_capacity_whole_free_pages_are_unmapped_and_the_request_retried():
    alloc = A.CachingAllocator(100 * MiB, expandable=True)
    _, b, _ = alloc.malloc(10 * MiB), alloc.malloc(45 * MiB), alloc.malloc(10 * MiB)  # pages [0, 80) MiB
    alloc.free(b)  # a 45 MiB hole over [10, 55): page [20, 40) wholly free
    big = alloc.malloc(50 * MiB)  # no free block holds it; 80 + 40 > 100: unmap that page, then map two
    assert alloc.memory_stats()["num_alloc_retries"] == 1 and big.offset == 65 * MiB
    assert alloc.memory_reserved() == alloc.stat("pages_in_use_bytes").current == 100 * MiB
    with pytest.raises(torch.OutOfMemoryError, match="simdev out of memory: tried to allocate 40.00 MiB"):
        alloc.malloc(40 * MiB)
    alloc.free(big)
    _consistent(alloc)


def test_settings_are_parsed_as_cudas_and_bound_to_the_first_allocation():
    assert A.parse_alloc_conf("expandable_segments:True") == {"expandable_segments": True}
    assert A.parse_alloc_conf(" expandable_segments:False ,") == {"expandable_segments": False}
    with pytest.raises(A.AllocConfError, match="'max_split_size_mb:20' unknown to simdev"):
        A.parse_alloc_conf("max_split_size_mb:20")
    alloc = A.CachingAllocator(64 * MiB)
    alloc.set_expandable(True)
    alloc.malloc(1)
    with pytest.raises(A.AllocConfError, match="before the first allocation"):
        alloc.set_expandable(False)


def test_random_traffic_keeps_the_blocks_consistent():
    rng = random.Random(0)
    alloc = A.CachingAllocator(300 * MiB, expandable=True)
    live = []
    for step in range(600):
        if live and rng.random() < 0.45:
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            with _maybe_oom():
                live.append(alloc.malloc(rng.choice([rng.randint(1, MiB), rng.randint(MiB, 60 * MiB)])))
        if step % 100 == 0:
            alloc.empty_cache()  # every whole free page unmapped: reserved is the pages in use
            assert alloc.memory_reserved() == alloc.stat("pages_in_use_bytes").current
        _consistent(alloc)


class _maybe_oom:
    """Lets an out-of-memory error pass (random traffic may ask for more than the capacity)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:
        return kind is torch.OutOfMemoryError


def _step_traffic(alloc, rng: random.Random, steps: int) -> None:
    """A training job's allocations in the model's shape: start-up's tables and state, the initialiser's
    temporaries, then steps that each bring a batch (two in flight) and free-for-all temporaries of many
    sizes (lookups, activations, the update), freed in another order than made."""
    persistent = [alloc.malloc(rng.randint(MiB, 40 * MiB)) for _ in range(12)]
    persistent += [alloc.malloc(rng.randint(1000, MiB)) for _ in range(40)]
    for _ in range(3):
        alloc.free(alloc.malloc(21 * MiB))
    batches = []
    for _ in range(steps):
        batches.append([alloc.malloc(rng.randint(MiB, 8 * MiB)) for _ in range(3)])
        temps = [alloc.malloc(rng.choice([rng.randint(MiB, 130 * MiB), rng.randint(512, MiB)]))
                 for _ in range(rng.randint(6, 14))]
        rng.shuffle(temps)
        for t in temps:
            alloc.free(t)
        if len(batches) > 2:
            for b in batches.pop(0):
                alloc.free(b)
    assert persistent


def test_a_capacity_of_the_allocated_peak_plus_the_modelled_slack_never_runs_out_with_expandable_segments():
    """For each of several random jobs: measure the allocated peak on a roomy device, then replay the same
    traffic on a device of that peak plus allocator_slack. With expandable segments every job fits; with
    CUDA's plain segments (what the model does not describe) some jobs run out of memory."""
    plain_ooms = 0
    for seed in range(8):
        roomy = A.CachingAllocator(8 << 30, expandable=True)
        _step_traffic(roomy, random.Random(seed), 12)
        peak = roomy.stat("allocated_bytes").peak
        capacity = peak + allocator_slack(peak, 0)
        # the model's slack is what the pages cost, not a fraction of the peak
        assert allocator_slack(peak, 0) <= (1 + 3) * ALLOC_LARGE_PAGE_BYTES + 4 * MiB
        _step_traffic(A.CachingAllocator(capacity, expandable=True), random.Random(seed), 12)
        try:
            _step_traffic(A.CachingAllocator(capacity), random.Random(seed), 12)
        except torch.OutOfMemoryError:
            plain_ooms += 1
    assert plain_ooms > 0


def test_start_up_pages_stay_mapped_and_count_where_start_up_peaks_higher():
    assert allocator_slack(100 * MiB, 300 * MiB) == allocator_slack(300 * MiB, 0) + 200 * MiB
    assert allocator_slack(300 * MiB, 100 * MiB) == allocator_slack(300 * MiB, 0)


@pytest.mark.parametrize(("hip", "name"), [(False, "PYTORCH_CUDA_ALLOC_CONF"),
                                           (True, "PYTORCH_HIP_ALLOC_CONF")])
def test_the_gpu_backends_turn_expandable_segments_on_keeping_other_settings(hip, name):
    env = {name: "max_split_size_mb:128"}
    assert configure_allocator(hip, env) is True
    assert env == {name: "max_split_size_mb:128,expandable_segments:True"}
    empty: dict[str, str] = {}
    assert configure_allocator(hip, empty) and empty == {name: "expandable_segments:True"}


def test_a_users_own_expandable_setting_is_kept_and_off_is_reported(caplog):
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    assert configure_allocator(False, env) is False
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    assert "turns expandable segments off" in caplog.text
