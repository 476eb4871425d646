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
from torch.utils._pytree import tree_flatten, tree_unflatten

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
    storage = torch._C._construct_storage_from_data_pointer(host.data_ptr(), torch.device(NAME, index),
                                                            nbytes)
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
    return _SET_STORAGE.redispatch(_CPU_KEYS, t, storage, like.storage_offset(), like.size(),
                                   like.stride())


def to_device(host: torch.Tensor, index: int, storage: torch.UntypedStorage | None = None,
              block: Block | None = None) -> torch.Tensor:
    """A simdev tensor viewing `host`'s memory (through `storage` when it already has one; else a new
    device storage, accounted in `block` where that was allocated ahead)."""
    if storage is None:
        storage = device_storage(host.untyped_storage(), index, block)
    return _set(torch._C._acc.create_empty_tensor([0], host.dtype), storage, host)


def host_view(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor aliasing simdev tensor `t`'s memory (same offset, sizes and strides)."""
    storage = t.untyped_storage()
    host = getattr(storage, "_simdev_host", None)
    if host is None:
        if storage.nbytes() == 0:
            return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
        raise RuntimeError(f"simdev: a tensor of shape {tuple(t.shape)} has device memory simdev did "
                           f"not allocate")
    return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())


class MisplacedTensorError(RuntimeError):
    """A host tensor reached a simdev op where a device tensor belongs."""


def _kernel(op: torch._ops.OpOverload, *args, **kwargs):
    """The PrivateUse1 fallback: every ATen op on simdev tensors, computed on host aliases."""
    name = op._schema.name
    if op.namespace not in ("aten", "prims"):
        raise NotImplementedError(f"simdev: no kernel for {op.name()} (a library must register its "
                                  f"own PrivateUse1 kernel for it)")
    if name in ("aten::_copy_from", "aten::_copy_from_and_resize"):
        return _copy_from(name, *args, **kwargs)
    args, kwargs = _numbers_as_tensors(op, args, kwargs)
    flat, spec = tree_flatten((args, kwargs))
    index = None
    for x in flat:
        if isinstance(x, torch.Tensor) and x.device.type == NAME:
            index = x.device.index or 0
            break
    host_ok = name in HOST_ARG_OPS
    devs, hosts, by_ptr = [], [], {}
    cargs = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            if x.device.type == NAME:
                h = host_view(x)
                devs.append(x)
                hosts.append(h)
                if x.untyped_storage().nbytes():
                    by_ptr[h.untyped_storage().data_ptr()] = x.untyped_storage()
                x = h
            elif x.device.type == "cpu" and not host_ok and x.dim() > 0:
                raise MisplacedTensorError(
                    f"simdev: {op.name()} got a cpu tensor of shape {tuple(x.shape)} where a "
                    f"{NAME} tensor belongs (move it with .to('{NAME}') first)")
        elif isinstance(x, torch.device) and x.type == NAME:
            index = x.index or 0
            x = torch.device("cpu")
        cargs.append(x)
    if index is None:
        index = 0
    if index >= DEVICE_COUNT:
        raise RuntimeError(f"simdev: no device simdev:{index} (each process has {DEVICE_COUNT})")
    cargs, ckwargs = tree_unflatten(cargs, spec)
    foreseen = _foreseen_nbytes(op, args, kwargs)
    ahead = [allocators()[index].malloc(foreseen)] if foreseen else []  # before the host bytes
    try:
        return _run(op, name, index, cargs, ckwargs, kwargs, devs, hosts, by_ptr, ahead)
    finally:
        for block in ahead:  # foreseen but not made: the op failed or made no new storage
            allocators()[index].free(block)


def _run(op: torch._ops.OpOverload, name: str, index: int, cargs: tuple, ckwargs: dict, kwargs: dict,
         devs: list[torch.Tensor], hosts: list[torch.Tensor], by_ptr: dict, ahead: list[Block]):
    """Run `op`'s CPU kernel on the host aliases and hand its results back as simdev tensors; the block
    in `ahead` (allocated before the op ran, if any) is taken by its new device storage."""
    out = op(*cargs, **ckwargs)
    for d, h in zip(devs, hosts, strict=True):  # an op that resized or re-pointed a device tensor
        if (h.size(), h.stride(), h.storage_offset(), h.untyped_storage().data_ptr()) != \
                (d.size(), d.stride(), d.storage_offset(), d.untyped_storage().data_ptr()):
            st = by_ptr.get(h.untyped_storage().data_ptr()) if h.untyped_storage().nbytes() else None
            _set(d, st if st is not None else device_storage(h.untyped_storage(), index), h)
    to = kwargs.get("device")
    if name == "aten::_to_copy" and to is not None and torch.device(to).type != NAME:
        return out  # the copy's destination is another device
    oflat, ospec = tree_flatten(out)
    res = []
    for o in oflat:
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            same = next((d for d, h in zip(devs, hosts, strict=True) if o is h), None)
            if same is not None:
                o = same
            else:
                ptr = o.untyped_storage().data_ptr()
                storage = by_ptr.get(ptr) if o.untyped_storage().nbytes() else None
                o = to_device(o, index, storage, ahead.pop() if storage is None and ahead else None)
        res.append(o)
    return tree_unflatten(res, ospec)


def _numbers_as_tensors(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # A Python number passed where the schema wants a Tensor (`x & 0xFF`) reaches a Python kernel as
    # the number (torch unwraps "wrapped number" tensors); the CPU kernel needs it back as a tensor.
    schema = op._schema.arguments
    if not any(isinstance(a, (int, float, complex)) for a in (*args, *kwargs.values())):
        return args, kwargs

    def fix(arg, value):
        if isinstance(value, (int, float, complex)) and isinstance(arg.type, torch._C.TensorType):
            return torch.tensor(value)  # 0-dim: promotes like the number it was
        return value

    args = tuple(fix(a, v) for a, v in zip(schema[:len(args)], args, strict=True))
    by_name = {a.name: a for a in schema}
    return args, {k: fix(by_name[k], v) if k in by_name else v for k, v in kwargs.items()}


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
