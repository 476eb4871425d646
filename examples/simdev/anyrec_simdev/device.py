"""The simdev device: a renamed PrivateUse1 whose memory is host memory, and its ATen kernels.

A simdev tensor is a real PrivateUse1 tensor: its storage reports device `simdev:N`, has the right
size and a data pointer into host memory (so `data_ptr()`, views, `.data`, `detach()` and every
alias made in C++ behave as on any device). The host bytes are owned by a CPU storage kept on the
device storage object. Every ATen op on simdev tensors reaches `_kernel` (a boxed fallback for the
PrivateUse1 key): it checks that no host tensor was passed where a device tensor belongs, runs the
op's CPU kernel on host aliases of the device memory, and hands the results back as simdev tensors
(aliases of an input stay aliases of it). Ops of other libraries (fbgemm, ...) get no kernel here:
they must register their own for PrivateUse1, as on any new device.
"""

from __future__ import annotations

import functools
import math
import os
import weakref

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_unflatten

from anyrec_simdev.allocator import (
    ALLOC_CONF_ENV,
    Block,
    CachingAllocator,
    capacity_from_env,
    parse_alloc_conf,
    round_size,
)

NAME = "simdev"
# One simulated device per process (as if each process were launched with one visible device):
# torch's Python PrivateUse1 support creates device tensors on index 0 only.
DEVICE_COUNT = 1

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_SET_STORAGE = torch.ops.aten.set_.source_Storage_storage_offset
_SET_STORAGE_ON_CPU = _SET_STORAGE._handle.redispatch_boxed  # what _SET_STORAGE.redispatch calls
# Ops that move data between the host and the device take a host tensor by design.
HOST_ARG_OPS = frozenset({"aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize",
                          "aten::_to_copy", "aten::is_pinned", "aten::_pin_memory"})



@functools.cache
def allocators() -> list[CachingAllocator]:
    """One simulated caching allocator per device, made on first use with the capacity SIMDEV_MEMORY_BYTES
    sets (32 GiB unset; a bad value raises CapacityError, a ValueError, there) and the settings
    SIMDEV_ALLOC_CONF gives (as PYTORCH_CUDA_ALLOC_CONF: `expandable_segments:True`)."""
    capacity = capacity_from_env()
    expandable = parse_alloc_conf(os.environ.get(ALLOC_CONF_ENV, "")).get("expandable_segments", False)
    return [CachingAllocator(capacity, f"{NAME}:{i}", expandable) for i in range(DEVICE_COUNT)]


def set_allocator_settings(text: str) -> None:
    """Apply allocator settings (`expandable_segments:True`) to every device, before its first allocation
    (torch.cuda.memory._set_allocator_settings for simdev)."""
    expandable = parse_alloc_conf(text).get("expandable_segments")
    if expandable is not None:
        for allocator in allocators():
            allocator.set_expandable(expandable)


@functools.cache
def _device(index: int) -> torch.device:
    return torch.device(NAME, index)  # once the device is registered: torch knows the name from then on


def capacity_bytes() -> int:
    """The capacity of each simulated device."""
    return allocators()[0].capacity_bytes



def device_storage(host: torch.UntypedStorage, index: int,
                   block: Block | None = None) -> torch.UntypedStorage:
    """A simdev storage over `host`'s bytes (which it keeps alive), accounted by the device's allocator: in
    `block` (taken over) when the caller allocated it before the host bytes, else now, which raises
    torch.OutOfMemoryError past the capacity (the host bytes are then dropped with the caller's frame)."""
    allocator, nbytes = allocators()[index], host.nbytes()
    if block is not None and (nbytes == 0 or block.rounded_bytes != round_size(nbytes)):
        allocator.free(block)  # the output is not the size foreseen
        block = None
    if block is None and nbytes:
        block = allocator.malloc(nbytes)
    storage = torch._C._construct_storage_from_data_pointer(host.data_ptr(), _device(index), nbytes)
    storage._simdev_host = host
    if block is not None:
        weakref.finalize(storage, allocator.free, block)
    return storage


def _foreseen_nbytes(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> int | None:
    """The bytes of the one new device storage `op` makes, where known before it runs (the allocation
    ops and copies to the device), so the capacity is checked before host memory is committed."""
    def itemsize(dtype: torch.dtype | None, default: torch.dtype) -> int:
        return (dtype or default).itemsize

    if op is torch.ops.aten.empty.memory_format:
        return math.prod(args[0]) * itemsize(kwargs.get("dtype"), torch.get_default_dtype())
    if op is torch.ops.aten.empty_strided.default:
        size, stride = args[0], args[1]
        if any(s == 0 for s in size):
            return 0
        elements = 1 + sum((s - 1) * st for s, st in zip(size, stride, strict=True))
        return elements * itemsize(kwargs.get("dtype"), torch.get_default_dtype())
    to = kwargs.get("device")
    if op is torch.ops.aten._to_copy.default and to is not None and torch.device(to).type == NAME:
        return args[0].numel() * itemsize(kwargs.get("dtype"), args[0].dtype)
    return None


def _set(t: torch.Tensor, storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    # aten::set_ has no PrivateUse1 kernel; the CPU one only rewrites the TensorImpl's metadata.
    return _SET_STORAGE_ON_CPU(_CPU_KEYS, t, storage, like.storage_offset(), like.size(), like.stride())


def to_device(host: torch.Tensor, index: int, storage: torch.UntypedStorage | None = None,
              block: Block | None = None, host_storage: torch.UntypedStorage | None = None) -> torch.Tensor:
    """A simdev tensor viewing `host`'s memory (through `storage` when it already has one; else a new
    device storage over `host_storage` (host's own when not given), accounted in `block` where that was
    allocated ahead)."""
    if storage is None:
        storage = device_storage(host.untyped_storage() if host_storage is None else host_storage, index,
                                 block)
    return _set(torch._C._acc.create_empty_tensor([0], host.dtype), storage, host)


def host_view(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor aliasing simdev tensor `t`'s memory (same offset, sizes and strides)."""
    return _host_view(t, t.untyped_storage())


class MisplacedTensorError(RuntimeError):
    """A host tensor reached a simdev op where a device tensor belongs."""


class _OpFacts:
    """What the fallback needs to know of one op, read from its schema once: every op on the device
    reaches `_kernel`, so whatever it works out per call is paid on every op."""

    __slots__ = ("op", "name", "supported", "host_ok", "copy_from", "to_copy", "foresees", "as_strided",
                 "tensor_positions", "tensor_names", "written_positions", "written_names")

    def __init__(self, op: torch._ops.OpOverload) -> None:
        schema = op._schema
        arguments = schema.arguments
        self.op = op  # kept: the facts are found by the op's id, which must not be reused
        self.name = schema.name
        self.supported = op.namespace in ("aten", "prims")
        self.host_ok = self.name in HOST_ARG_OPS
        self.copy_from = self.name in ("aten::_copy_from", "aten::_copy_from_and_resize")
        self.to_copy = self.name == "aten::_to_copy"
        self.foresees = op in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                               torch.ops.aten._to_copy.default)
        self.as_strided = op is torch.ops.aten.as_strided.default
        # Where a Python number may stand for a Tensor (see _numbers_as_tensors).
        wants_tensor = [isinstance(a.type, torch._C.TensorType) for a in arguments]
        self.tensor_positions = frozenset(i for i, w in enumerate(wants_tensor) if w)
        self.tensor_names = frozenset(a.name for a, w in zip(arguments, wants_tensor, strict=True) if w)
        # The arguments the op writes (`Tensor(a!)`): only there can it resize or re-point a tensor.
        written = [a.alias_info is not None and a.alias_info.is_write for a in arguments]
        self.written_positions = frozenset(i for i, w in enumerate(written) if w)
        self.written_names = frozenset(a.name for a, w in zip(arguments, written, strict=True) if w)


_FACTS: dict[int, _OpFacts] = {}  # by id(op): OpOverload's own hash is a Python method
_CPU = torch.device("cpu")
_NUMBERS = (int, float, complex)
_NUMBER_TYPES = frozenset({int, float, complex, bool})  # the exact types isinstance(x, _NUMBERS) holds for
_MOVABLE = (torch.Tensor, torch.device)
# Values of an op's arguments and results that are no containers and never move: the fast paths leave
# them as they are; anything not one of these, a Tensor, a device, a list or a tuple goes through pytree.
_PLAIN = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.layout,
                    torch.memory_format})
_SEQUENCES = frozenset({list, tuple, torch.Size})


class _HostArgs:
    """One op call's arguments moved to the host: each simdev tensor replaced by its host alias (kept
    with the device tensor it stands for), each simdev device by the CPU, host tensors refused where a
    device tensor belongs."""

    __slots__ = ("op", "host_ok", "devs", "hosts", "check", "by_ptr", "first_index", "device_index")

    def __init__(self, op: torch._ops.OpOverload, host_ok: bool) -> None:
        self.op, self.host_ok = op, host_ok
        self.devs: list[torch.Tensor] = []
        self.hosts: list[torch.Tensor] = []
        # Per device tensor: whether its alias must be compared with it after the op (see _run).
        self.check: list[bool] = []
        self.by_ptr: dict[int, torch.UntypedStorage] = {}
        self.first_index: int | None = None  # of the first simdev tensor
        self.device_index: int | None = None  # of the last simdev device passed

    def index(self) -> int:
        if self.device_index is not None:
            return self.device_index
        return 0 if self.first_index is None else self.first_index

    def leaf(self, x, written: bool = True):
        """`x` as the CPU kernel takes it; `written`: the op may write it (True where not known)."""
        if isinstance(x, torch.Tensor):
            device = x.device
            if device.type == NAME:
                storage = x.untyped_storage()
                h = _host_view(x, storage)
                if self.first_index is None:
                    self.first_index = device.index or 0
                self.devs.append(x)
                self.hosts.append(h)
                if storage.nbytes():
                    ptr = h.untyped_storage().data_ptr()
                    self.by_ptr[ptr] = storage
                    # an alias of other memory than the device tensor's: a resize moved it
                    self.check.append(written or ptr != storage.data_ptr())
                else:
                    self.check.append(True)  # a fresh host tensor stands for it
                return h
            if device.type == "cpu" and not self.host_ok and x.dim() > 0:
                raise MisplacedTensorError(
                    f"simdev: {self.op.name()} got a cpu tensor of shape {tuple(x.shape)} where a "
                    f"{NAME} tensor belongs (move it with .to('{NAME}') first)")
            return x
        if isinstance(x, torch.device) and x.type == NAME:
            self.device_index = x.index or 0
            return _CPU
        return x

    def move(self, facts: _OpFacts, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments for the CPU kernel (numbers where the schema wants a Tensor made 0-dim tensors,
        see _numbers_as_tensors), leaves visited in pytree's order (args, then kwargs)."""
        moved = self._move_flat(facts, args, kwargs)
        if moved is not None:
            return moved
        self.__init__(self.op, self.host_ok)  # a container the fast path does not know: start again
        args, kwargs = _numbers_as_tensors(facts, args, kwargs)
        flat, spec = tree_flatten((args, kwargs))
        return tree_unflatten([self.leaf(x) for x in flat], spec)

    def _move_flat(self, facts: _OpFacts, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # ATen arguments are values or lists of values: walked here without pytree; None for anything
        # else (nothing is kept of a walk given up, and leaves are visited in pytree's order).
        out = []
        for i, x in enumerate(args):
            moved = self._move_arg(x, i in facts.tensor_positions, i in facts.written_positions)
            if moved is _GIVE_UP:
                return None
            out.append(moved)
        kw = {}
        for k, x in kwargs.items():
            moved = self._move_arg(x, k in facts.tensor_names, k in facts.written_names)
            if moved is _GIVE_UP:
                return None
            kw[k] = moved
        return tuple(out), kw

    def _move_arg(self, x, wants_tensor: bool, written: bool):
        """One argument as the CPU kernel takes it (a number the schema wants as a Tensor made a 0-dim
        tensor); _GIVE_UP for a container the fast path does not know."""
        kind = type(x)
        if kind in _PLAIN:
            return torch.tensor(x) if wants_tensor and kind in _NUMBER_TYPES else x
        if kind in _SEQUENCES:
            seq = _map_seq(self.leaf, x, written)
            return _GIVE_UP if seq is None else seq
        if isinstance(x, _MOVABLE) and kind not in SUPPORTED_NODES:
            return self.leaf(x, written)
        return _GIVE_UP


_GIVE_UP = object()  # _move_arg: the argument is not one the fast path walks


def _map_seq(fn, seq: list | tuple, *flags):
    """`fn(x, *flags)` for each Tensor or device in `seq`, in a sequence of its type; None where `seq`
    holds something else than those and plain values."""
    if all(type(x) in _PLAIN for x in seq):
        return seq  # sizes, strides, dims: nothing to move
    out = []
    for x in seq:
        kind = type(x)
        if kind in _PLAIN:
            out.append(x)
        elif isinstance(x, _MOVABLE) and kind not in SUPPORTED_NODES:
            out.append(fn(x, *flags))
        else:
            return None
    return out if type(seq) is list else tuple(out)


def _host_view(t: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    host = getattr(storage, "_simdev_host", None)
    if host is None:
        if storage.nbytes() == 0:
            return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
        raise RuntimeError(f"simdev: a tensor of shape {tuple(t.shape)} has device memory simdev did "
                           f"not allocate")
    return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())


def _kernel(op: torch._ops.OpOverload, *args, **kwargs):
    """The PrivateUse1 fallback: every ATen op on simdev tensors, computed on host aliases."""
    facts = _FACTS.get(id(op))
    if facts is None:
        facts = _FACTS[id(op)] = _OpFacts(op)
    if not facts.supported:
        raise NotImplementedError(f"simdev: no kernel for {op.name()} (a library must register its "
                                  f"own PrivateUse1 kernel for it)")
    if facts.copy_from:
        return _copy_from(facts.name, *args, **kwargs)
    if facts.foresees:  # the numbers the sizes are worked out from (the others are turned on the way)
        args, kwargs = _numbers_as_tensors(facts, args, kwargs)
    if facts.as_strided and not kwargs and 3 <= len(args) <= 4:
        view = _as_strided(*args)
        if view is not None:
            return view
    moved = _HostArgs(op, facts.host_ok)
    cargs, ckwargs = moved.move(facts, args, kwargs)
    index = moved.index()
    if index >= DEVICE_COUNT:
        raise RuntimeError(f"simdev: no device simdev:{index} (each process has {DEVICE_COUNT})")
    foreseen = _foreseen_nbytes(op, args, kwargs) if facts.foresees else None
    ahead = [allocators()[index].malloc(foreseen)] if foreseen else []  # before the host bytes
    try:
        return _run(op, facts, index, cargs, ckwargs, kwargs, moved, ahead)
    finally:
        for block in ahead:  # foreseen but not made: the op failed or made no new storage
            allocators()[index].free(block)


def _run(op: torch._ops.OpOverload, facts: _OpFacts, index: int, cargs: tuple, ckwargs: dict, kwargs: dict,
         moved: _HostArgs, ahead: list[Block]):
    """Run `op`'s CPU kernel on the host aliases and hand its results back as simdev tensors; the block
    in `ahead` (allocated before the op ran, if any) is taken by its new device storage."""
    out = op._op(*cargs, **ckwargs)
    devs, hosts, by_ptr = moved.devs, moved.hosts, moved.by_ptr
    reset: list[torch.Tensor] = []
    for d, h, check in zip(devs, hosts, moved.check, strict=True):
        # An alias the op did not write, of the device tensor's own memory, still matches it unless
        # an earlier alias of the same tensor re-set it: only the others can differ.
        if not check and not any(r is d for r in reset):
            continue
        if h.size() != d.size() or h.stride() != d.stride() or h.storage_offset() != d.storage_offset() \
                or h.untyped_storage().data_ptr() != d.untyped_storage().data_ptr():
            # the op resized or re-pointed a device tensor
            st = by_ptr.get(h.untyped_storage().data_ptr()) if h.untyped_storage().nbytes() else None
            _set(d, st if st is not None else device_storage(h.untyped_storage(), index), h)
            reset.append(d)
    if facts.to_copy:
        to = kwargs.get("device")
        if to is not None and torch.device(to).type != NAME:
            return out  # the copy's destination is another device

    def back(o):
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            for d, h in zip(devs, hosts, strict=True):
                if o is h:
                    return d
            storage = o.untyped_storage()
            found = by_ptr.get(storage.data_ptr()) if storage.nbytes() else None
            return to_device(o, index, found, ahead.pop() if found is None and ahead else None, storage)
        return o

    kind = type(out)
    if kind in _PLAIN:
        return out
    if isinstance(out, torch.Tensor) and kind not in SUPPORTED_NODES:
        return back(out)
    if kind is list or kind is tuple:
        res = _map_seq(back, out)
        if res is not None:
            return res
    oflat, ospec = tree_flatten(out)
    return tree_unflatten([back(o) for o in oflat], ospec)


def _as_strided(x, size, stride, storage_offset=None) -> torch.Tensor | None:
    """as_strided of a simdev tensor, made directly on its device memory where the result lies inside it
    (what the CPU kernel would give on the host alias, which `_run` would hand back on the same device
    storage); None where the CPU kernel must judge the arguments (it raises the errors)."""
    if not isinstance(x, torch.Tensor) or type(x) in SUPPORTED_NODES or x.device.type != NAME:
        return None
    storage = x.untyped_storage()
    host = getattr(storage, "_simdev_host", None)
    if (host is None or not storage.nbytes() or not host.nbytes() or host.data_ptr() != storage.data_ptr()
            or (x.device.index or 0) >= DEVICE_COUNT or type(size) not in _SEQUENCES
            or type(stride) not in _SEQUENCES or len(size) != len(stride)):
        return None
    offset = x.storage_offset() if storage_offset is None else storage_offset
    if type(offset) is not int or offset < 0:
        return None
    span = 1
    for n, step in zip(size, stride, strict=True):
        if type(n) is not int or type(step) is not int or n < 0 or step < 0:
            return None
        span += (n - 1) * step if n else 0
    if 0 not in size and (span + offset) * x.element_size() > host.nbytes():
        return None
    view = torch._C._acc.create_empty_tensor([0], x.dtype)
    return _SET_STORAGE_ON_CPU(_CPU_KEYS, view, storage, offset, size, stride)


def _numbers_as_tensors(facts: _OpFacts, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # A Python number passed where the schema wants a Tensor (`x & 0xFF`) reaches a Python kernel as
    # the number (torch unwraps "wrapped number" tensors); the CPU kernel needs it back as a tensor.
    fixed = None
    for i in facts.tensor_positions:
        if i < len(args) and isinstance(args[i], _NUMBERS):
            if fixed is None:
                fixed = list(args)
            fixed[i] = torch.tensor(args[i])  # 0-dim: promotes like the number it was
    if fixed is not None:
        args = tuple(fixed)
    if kwargs and any(k in facts.tensor_names and isinstance(v, _NUMBERS) for k, v in kwargs.items()):
        kwargs = {k: torch.tensor(v) if k in facts.tensor_names and isinstance(v, _NUMBERS) else v
                  for k, v in kwargs.items()}
    return args, kwargs


def _host_or_self(t: torch.Tensor) -> torch.Tensor:
    return host_view(t) if t.device.type == NAME else t


def _copy_from(name: str, src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    # torch's copy_ hands every copy that involves a PrivateUse1 tensor to _copy_from: host<->device
    # and device<->device copies are all host memcpy here.
    if name == "aten::_copy_from_and_resize" and dst.size() != src.size():
        dst.resize_(src.size())
    _host_or_self(dst).copy_(_host_or_self(src))
    return dst


_LIB: torch.library.Library | None = None
_ATEN: torch.library.Library | None = None
# Ops with a CompositeExplicitAutograd kernel, which would run before a fallback, that cannot serve
# simdev: `_to_copy` to the host with non_blocking=True asks the device for pinned host memory.
OWN_KERNELS = ("_to_copy",)


def register() -> None:
    """Rename PrivateUse1 to simdev and install its hooks, device module and the ATen fallback (once)."""
    global _LIB, _ATEN
    if _LIB is not None:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from anyrec_simdev import module

    _setup_privateuseone_for_python_backend(NAME, backend_module=module)
    _LIB = torch.library.Library("_", "IMPL")
    _LIB.fallback(_kernel, "PrivateUse1")
    _ATEN = torch.library.Library("aten", "IMPL")
    for name in OWN_KERNELS:
        op = getattr(torch.ops.aten, name).default
        _ATEN.impl(name, functools.partial(_kernel, op), "PrivateUse1")
