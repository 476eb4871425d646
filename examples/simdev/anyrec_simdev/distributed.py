"""The `simdev` torch.distributed backend: collectives on simdev tensors, carried by gloo.

A process group created with `backend="simdev"` (what anyrec's simdev backend asks for) is a
`SimdevProcessGroup`: torch takes a `ProcessGroup` returned by a registered backend's creator as the
whole group, so it carries host tensors too (object collectives). For simdev tensors each call hands
gloo host aliases of the device memory, so gloo reads and writes the device tensors themselves and
no copy is made; a call that mixes host and device tensors raises.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from anyrec_simdev.device import NAME, MisplacedTensorError, host_view

# torch's Python process-group hooks (left) and the gloo backend method that does the work (right).
_METHODS = {
    "allreduce": "allreduce",
    "allreduce_coalesced": "allreduce_coalesced",
    "broadcast": "broadcast",
    "allgather": "allgather",
    "all_gather_single": "_allgather_base",
    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "alltoall": "alltoall",
    "all_to_all_single": "alltoall_base",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "_reduce_scatter_base",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "gather": "gather",
    "scatter": "scatter",
    "send": "send",
    "recv": "recv",
}


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for y in x for t in _tensors(y)] if isinstance(x, list) else []


def _host(x):
    if isinstance(x, torch.Tensor):
        return host_view(x) if x.device.type == NAME else x
    return [_host(y) for y in x] if isinstance(x, list) else x


def _check_one_device(method: str, args) -> None:
    devices = {t.device.type for a in args for t in _tensors(a)}
    if len(devices) > 1:
        raise MisplacedTensorError(f"simdev: collective {method} got tensors on {sorted(devices)}; "
                                   f"all must be on one device")


class SimdevProcessGroup(dist.ProcessGroup):
    """simdev's process-group backend: each collective runs in gloo on host views of device memory."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        # torch keeps a group's name and description on its backends: give it gloo's, for host tensors.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)

    def getBackendName(self) -> str:
        return NAME

    def barrier(self, opts=None):
        return self._gloo.barrier() if opts is None else self._gloo.barrier(opts)

    def _get_backend(self, device: torch.device):
        """The backend for `device` (this group carries every device type itself)."""
        return self

    @property
    def supports_splitting(self) -> bool:
        return False


def _forward(method: str, gloo_method: str):
    def call(self, *args, **kwargs):  # torch's callers pass options by keyword too (opts=...)
        _check_one_device(method, [*args, *kwargs.values()])
        return getattr(self._gloo, gloo_method)(*(_host(a) for a in args),
                                                **{k: _host(v) for k, v in kwargs.items()})

    call.__name__ = method
    call.__doc__ = f"{method} on host views of the device tensors, by gloo's {gloo_method}."
    return call


for _m, _g in _METHODS.items():
    setattr(SimdevProcessGroup, _m, _forward(_m, _g))


def _create(store: dist.Store, rank: int, size: int, timeout) -> SimdevProcessGroup:
    return SimdevProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register the `simdev` process-group backend for simdev tensors (once)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=[NAME])
