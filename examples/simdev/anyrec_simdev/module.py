"""`torch.simdev`: the device module (what `torch.get_device_module("simdev")` returns).

Work on simdev runs when it is issued (the kernels are synchronous host code), so a stream is an
ordering token, `synchronize` returns at once and an event records the host clock when it is reached.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from anyrec_simdev.allocator import CachingAllocator
from anyrec_simdev.device import DEVICE_COUNT, NAME, allocators

_current = 0


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return DEVICE_COUNT


def current_device() -> int:
    return _current


def set_device(device: int | str | torch.device) -> None:
    global _current
    index = torch.device(NAME, device).index if isinstance(device, int) else torch.device(device).index
    if not 0 <= (index or 0) < DEVICE_COUNT:
        raise ValueError(f"simdev: no device {device} (this host has {DEVICE_COUNT})")
    _current = index or 0


def _index(device: int | str | torch.device | None) -> int:
    if device is None:
        return _current
    return device if isinstance(device, int) else (torch.device(device).index or 0)


def synchronize(device: int | str | torch.device | None = None) -> None:
    """Wait for the device's queued work (there is none: kernels run when issued)."""


def manual_seed(seed: int) -> None:
    """Seed the device's generator: simdev draws random numbers from the host generator."""


def manual_seed_all(seed: int) -> None:
    """Seed every device's generator (see manual_seed)."""


def get_rng_state(device: int | str | torch.device | None = None) -> torch.Tensor:
    """The device's generator state: the host generator's (see manual_seed)."""
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: int | str | torch.device | None = None) -> None:
    """Set the device's generator state: the host generator's (see manual_seed)."""
    torch.set_rng_state(new_state)


def _allocator(device: int | str | torch.device | None) -> CachingAllocator:
    return allocators()[_index(device)]


def memory_allocated(device: int | str | torch.device | None = None) -> int:
    """Bytes allocated now (requests rounded up to 512 bytes), as CUDA counts them."""
    return _allocator(device).stat("allocated_bytes").current


def max_memory_allocated(device: int | str | torch.device | None = None) -> int:
    """The most bytes allocated at once since the start or the last reset_peak_memory_stats."""
    return _allocator(device).stat("allocated_bytes").peak


def memory_reserved(device: int | str | torch.device | None = None) -> int:
    """Bytes in segments the allocator holds (allocated or cached)."""
    return _allocator(device).stat("reserved_bytes").current


def max_memory_reserved(device: int | str | torch.device | None = None) -> int:
    """The most bytes reserved at once since the start or the last reset_peak_memory_stats."""
    return _allocator(device).stat("reserved_bytes").peak


def reset_peak_memory_stats(device: int | str | torch.device | None = None) -> None:
    """Every peak statistic back to its current value."""
    _allocator(device).reset_peak()


def reset_accumulated_memory_stats(device: int | str | torch.device | None = None) -> None:
    """The totals of memory_stats (`.allocated`, `.freed`, num_ooms) back to zero."""
    _allocator(device).reset_accumulated()


def memory_stats(device: int | str | torch.device | None = None) -> dict[str, int]:
    """The allocator's statistics under CUDA's key names (`allocated_bytes.all.current`, ...)."""
    return _allocator(device).memory_stats()


def empty_cache() -> None:
    """Release the segments with nothing allocated in them (on every device)."""
    for allocator in allocators():
        allocator.empty_cache()


def mem_get_info(device: int | str | torch.device | None = None) -> tuple[int, int]:
    """(free, total) bytes of the simulated device: its capacity less what is reserved, and its capacity."""
    allocator = _allocator(device)
    return allocator.free_bytes(), allocator.capacity_bytes


def get_device_name(device: int | str | torch.device | None = None) -> str:
    return "simdev (simulated)"


class Event:
    """A point in a stream; records the host clock when reached (work is synchronous)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.t: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self.t = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        """Make `stream` wait for this event (already reached)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Wait for the event (already reached)."""

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds between this event and `end` (both recorded, timing enabled)."""
        if not (self.enable_timing and end.enable_timing) or self.t is None or end.t is None:
            raise RuntimeError("simdev: elapsed_time needs two recorded events made with enable_timing=True")
        return (end.t - self.t) * 1e3


class Stream:
    """An ordering token for device work (simdev runs work in issue order on the host)."""

    def __init__(self, device: int | str | torch.device | None = None, priority: int = 0,
                 **kwargs) -> None:
        self.device = torch.device(NAME, _index(device))
        self.priority = priority

    def wait_stream(self, stream: Stream) -> None:
        """Order later work on this stream after `stream`'s (already in order)."""

    def wait_event(self, event: Event) -> None:
        """Order later work after `event` (already reached)."""

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Wait for the stream's work (already done)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.device == self.device and other.priority == self.priority

    def __hash__(self) -> int:
        return hash((self.device, self.priority))


_default_streams: dict[int, Stream] = {}


def default_stream(device: int | str | torch.device | None = None) -> Stream:
    i = _index(device)
    return _default_streams.setdefault(i, Stream(i))


def current_stream(device: int | str | torch.device | None = None) -> Stream:
    return default_stream(device)


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Issue work on `s` inside the block (one queue per device: work stays in issue order)."""
    yield


def set_stream(s: Stream) -> None:
    """Make `s` current (one queue per device: a no-op)."""


def get_amp_supported_dtype() -> list[torch.dtype]:
    """Autocast dtypes: none (simdev registers no autocast kernels, so it computes in fp32)."""
    return []
