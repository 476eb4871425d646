"""The hardware abstraction layer: one `Backend` interface every accelerator implements. Only
`anyrec/backends/` may name `torch.cuda`, `torch.version.hip` or vendor libraries."""

from __future__ import annotations

import abc
import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from anyrec.backends.dispatch import OPS, Impl, select_all
from anyrec.backends.specs import DeviceSpec
from anyrec.choices import Precision, Switch

if TYPE_CHECKING:
    from anyrec.backends.core_load import BindChoice
    from anyrec.backends.threads import ThreadChoice


@dataclass(frozen=True)
class Binding:
    """What a process decided about its host threads, once, at start: the cores its threads are bound to
    (None: not bound), the binding decision with the load sample behind it, and the thread count's (None
    where the backend leaves them alone: accelerators, one rank)."""

    cores: tuple[int, ...] | None = None
    bind: BindChoice | None = None
    threads: ThreadChoice | None = None


@dataclass(frozen=True)
class DeviceFacts:
    """What the runtime reports about the machine; detection is a pure function of these facts."""

    cuda_available: bool = False  # torch.cuda.is_available() (true on ROCm builds too)
    hip_version: str | None = None  # torch.version.hip: set on ROCm builds
    device_count: int = 0
    device_name: str = ""  # e.g. "NVIDIA H200", "AMD Instinct MI300X"
    arch: str = ""  # "sm_90", "gfx942", ...
    memory_bytes: int = 0
    multiprocessors: int = 0


class Backend(abc.ABC):
    """One accelerator family: its torch device, collectives backend, spec and kernels."""

    name: str = ""  # "cpu" | "cuda" | "rocm" | plugin name
    device_type: str = ""  # torch device type; ROCm keeps "cuda"
    dist_backend: str = ""  # torch.distributed backend: "gloo", "nccl" (RCCL on ROCm)
    # Whether backend.name=auto may pick it; False for a simulation or emulator, chosen by name only.
    auto_detect: ClassVar[bool] = True
    # Per op (see anyrec.backends.dispatch.OPS), registered implementations in order of preference.
    kernel_order: ClassVar[dict[str, tuple[str, ...]]] = {
        "embedding": ("fbgemm", "triton", "torch"),
        "interaction": ("triton", "torch"),
        "dcn_cross": ("triton", "torch"),
        "hstu_attention": ("triton", "torch"),
        "collectives": ("gloo",),
        "sparse_ops": ("fbgemm", "portable"),
    }

    def __init__(self, facts: DeviceFacts | None = None) -> None:
        self._facts = facts
        self._kernels: dict[tuple, dict[str, Impl]] = {}
        self._pins: bool | None = None

    @property
    def facts(self) -> DeviceFacts:
        if self._facts is None:
            self._facts = self.probe_facts()
        return self._facts

    @classmethod
    @abc.abstractmethod
    def probe_facts(cls) -> DeviceFacts:
        """Read the facts about this machine from the runtime (cheap, no kernels launched)."""

    @classmethod
    @abc.abstractmethod
    def matches(cls, facts: DeviceFacts) -> bool:
        """Whether this backend can drive the machine described by `facts`."""

    @abc.abstractmethod
    def device(self, local_rank: int = 0) -> torch.device:
        """The torch device a process with this local rank uses."""

    def set_device(self, local_rank: int = 0) -> None:  # noqa: B027 - optional hook
        """Bind this process to its device (no-op where devices are not per-process)."""

    def bind_local_rank(self, local_rank: int, local_world_size: int,  # noqa: B027 - optional hook
                        bind_cores: Switch = Switch.auto, threads: int | None = None, rank: int = 0,
                        world_size: int = 1) -> Binding:
        """Give this local rank its share of the host's cores (and its thread count; `rank` of the job's
        `world_size` ranks, for choices the ranks agree on); what was decided (on accelerators torchrun
        --numa-binding binds host cores to devices: nothing here)."""
        return Binding()

    def step_hooks(self) -> list[Callable[[Any], None]]:
        """Hooks to call after every training step (the CPU backend's thread re-check); none by default."""
        return []

    @abc.abstractmethod
    def device_spec(self) -> DeviceSpec:
        """The spec of the device this process runs on (SKU table entry or derived from facts)."""

    def synchronize(self) -> None:  # noqa: B027 - optional hook
        """Wait for queued device work (used by timers)."""

    def queues_device_work(self) -> bool:
        """Whether ops return before the device has done them (an accelerator's stream): a step's time is
        then known only at a sync point. False where every op is done when its call returns (the host
        CPU), so each step can be timed alone."""
        return True

    # ---- host memory: every page-locked buffer is asked for here ---------------------------------

    def pins_host_memory(self) -> bool:
        """Whether host memory can be page-locked for this device (probed once). torch pins for the
        process's current accelerator only: not on the host, not where that accelerator is another
        device type (a plugin registered beside this one), not where the device has no pinned allocator."""
        if self._pins is None:
            self._pins = self._probe_pinning()
        return self._pins

    def _probe_pinning(self) -> bool:
        if self.device_type == "cpu" or not torch.accelerator.is_available():
            return False
        if torch.accelerator.current_accelerator().type != self.device_type:
            return False
        try:
            torch.empty(1, pin_memory=True)
        except (RuntimeError, NotImplementedError):
            return False
        return True

    def pin(self, x: Any) -> Any:
        """`x` (a host tensor, anything with `pin_memory()` such as a torchrec Batch or KJT, or a batch
        that maps its tensors, `map_tensors(fn)`, such as anyrec's SequenceBatch) in page-locked memory
        for this device; `x` itself, pageable, where this backend cannot pin."""
        if not self.pins_host_memory():
            return x
        return x.map_tensors(self.pin) if hasattr(x, "map_tensors") else x.pin_memory()

    def pinned_empty(self, *size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised host tensor, page-locked for this device where it can be, else pageable."""
        return torch.empty(*size, dtype=dtype, pin_memory=self.pins_host_memory())

    # ---- device memory statistics (None where the backend does not measure them) -----------------

    def memory_allocated(self) -> int | None:
        """Bytes allocated on the device by this process now."""
        return None

    def max_memory_allocated(self) -> int | None:
        """Peak bytes allocated on the device by this process (None where it is not measured)."""
        return None

    def memory_reserved(self) -> int | None:
        """Bytes the device's caching allocator holds (allocated or cached)."""
        return None

    def max_memory_reserved(self) -> int | None:
        """Peak bytes the device's caching allocator held."""
        return None

    def memory_capacity_bytes(self) -> int | None:
        """The device memory this process can use, as the runtime reports it."""
        return None

    def memory_stats(self) -> dict[str, int]:
        """The allocator's statistics under CUDA's key names (`allocated_bytes.all.peak`, ...); empty
        where not measured."""
        return {}

    def reset_peak_memory_stats(self) -> None:  # noqa: B027 - optional hook
        """Reset the peak memory counters."""

    def empty_cache(self) -> None:  # noqa: B027 - optional hook
        """Release the device memory the caching allocator holds unused."""

    def dense_precision(self, choice: Precision) -> Precision:
        """The precision the dense part runs in on this device (bf16 or fp32), resolved once from the
        `trainer.mixed_precision` choice: auto is bf16 autocast on an accelerator that has it (torch would
        warn and compute in fp32 on one without) and fp32 on a CPU; bf16 where there is none is a
        ValueError."""
        if choice == Precision.fp32 or (choice == Precision.auto and self.device_type == "cpu"):
            return Precision.fp32
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast(self.device_type, dtype=torch.bfloat16):
                runs = torch.is_autocast_enabled(self.device_type)
        if choice == Precision.bf16 and not runs:
            raise ValueError(f"trainer.mixed_precision=bf16: {self.device_type} has no bf16 autocast; "
                             f"use auto or fp32")
        return Precision.bf16 if runs else Precision.fp32

    def autocast(self, enabled: bool) -> contextlib.AbstractContextManager:
        """bf16 autocast on this device when enabled (and supported)."""
        if not enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=torch.bfloat16)

    @property
    def compiles(self) -> bool:
        """Whether torch.compile's inductor generates code for this device type (CPU, CUDA and ROCm, XPU);
        a plugin device without a registered inductor back end answers False (its models stay eager).
        torch's own `cpu` and `cuda` always have one: answered without importing inductor (~1 s a process)."""
        if self.device_type in ("cpu", "cuda"):
            return True
        from torch._inductor.codegen.common import get_scheduling_for_device, init_backend_registration

        init_backend_registration()
        return get_scheduling_for_device(self.device_type) is not None

    def probe(self, impl: str) -> str | None:
        """This backend's veto on implementation `impl` (None: let the Impl's own probe decide); override
        to answer for a library of your own, or to rule one out on your device."""
        return None

    def select_kernels(self, cfg: Any = None) -> dict[str, Impl]:
        """Op name -> its Impl record, honouring `cfg` (a BackendConfig); probes and logs once per key."""
        requested = {op.name: str(getattr(cfg, op.config_key, "auto") or "auto")
                     for op in OPS.values() if op.config_key}
        key = tuple(sorted(requested.items()))
        if key not in self._kernels:
            self._kernels[key] = select_all(self, requested)
        return dict(self._kernels[key])

    def describe(self) -> str:
        f = self.facts
        return f"{self.name} ({f.device_name or 'host'}, {f.arch or '-'}, dist={self.dist_backend})"
