"""Selective recompute: a tensor made from kept inputs, recomputed in the backward wherever autograd would
keep it (the MLPerf DLRMv4 reference's STU keeps its input, U and the attention output this way and
recomputes the input norm, the UVQK projection and the gated output: its `recompute_normed_x`,
`recompute_uvqk` and `recompute_y`).

`recomputed(fn, *inputs)` runs `fn` without a graph and returns its one output; its backward keeps `inputs`
(through `save_for_backward`, so saved-tensor hooks see them), autocast's state and, for a `random` `fn`
(dropout), the random number generators' states: the same mask is drawn again and none of it is kept.
Around the ops that read that output, `recompute_saved(out)` makes autograd save any tensor that shares its
storage as a note instead. In the backward, the first note read (or the function's own backward) runs `fn`
again with a graph, once; the notes read views of that run and the function's backward differentiates it.

Numerics: the backward runs the forward's ops on the same inputs, under the same autocast and generator
states, then the plain graph's backward ops; the gradients are the plain graph's, bit for bit on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from anyrec.backends.rng import RngStates, rng_states, set_rng_states


@dataclass(frozen=True)
class _Note:
    """Where a saved tensor sits in a recomputed output: that output's node and the view's geometry."""

    node: object  # the _Recompute node (its ctx) that made the output
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@contextlib.contextmanager
def _replayed_rng(states: RngStates) -> Iterator[None]:
    """The generators set to `states` (the forward's), then back to where they were."""
    now = rng_states(states[-1][0])
    set_rng_states(states)
    try:
        yield
    finally:
        set_rng_states(now)


class _Recompute(torch.autograd.Function):
    """fn(*inputs) without a graph; the backward runs it again with one (see the module docstring)."""

    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], random: bool, *inputs: torch.Tensor) -> torch.Tensor:
        device = inputs[0].device
        ctx.fn, ctx.device_type = fn, device.type
        ctx.autocast_dtype = (torch.get_autocast_dtype(device.type)
                              if torch.is_autocast_enabled(device.type) else None)
        ctx.rng = rng_states(device) if random else None
        out = fn(*inputs)
        ctx.layout = (out.size(), out.stride(), out.storage_offset())
        ctx.run = None
        ctx.save_for_backward(*inputs)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        leaves, out = _rerun(ctx)
        ctx.run = None
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True) if wanted else ())
        return (None, None, *(next(grads) if leaf.requires_grad else None for leaf in leaves))


def _rerun(ctx) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the inputs as leaves, fn's output with a graph): run once per backward, under the forward's
    autocast and generator states."""
    if ctx.run is None:
        needs = ctx.needs_input_grad[2:]  # after fn and random
        leaves = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs, strict=True)]
        with contextlib.ExitStack() as stack:
            if ctx.autocast_dtype is not None:
                stack.enter_context(torch.autocast(ctx.device_type, dtype=ctx.autocast_dtype))
            elif torch.is_autocast_enabled(ctx.device_type):  # a backward called inside autocast
                stack.enter_context(torch.autocast(ctx.device_type, enabled=False))
            if ctx.rng is not None:
                stack.enter_context(_replayed_rng(ctx.rng))
            with torch.enable_grad():
                out = ctx.fn(*leaves)
        # the notes' views are taken at the forward's geometry
        assert (out.size(), out.stride(), out.storage_offset()) == ctx.layout, "recompute changed the layout"
        ctx.run = (leaves, out)
    return ctx.run


def recomputed(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor, random: bool = False) -> torch.Tensor:
    """`fn(*inputs)` (one tensor), its backward keeping `inputs` only; `random`: fn draws random numbers
    (its generators' states are kept and replayed). Read it inside `recompute_saved` so that what later ops
    save of it is recomputed rather than kept."""
    return _Recompute.apply(fn, random, *inputs)


@contextlib.contextmanager
def recompute_saved(out: torch.Tensor) -> Iterator[None]:
    """Inside: a tensor autograd saves that shares `out`'s storage (`out` made by `recomputed`; keep it alive
    meanwhile) is kept as a note and recomputed in the backward; the other saved tensors go to the
    saved-tensor hooks around this scope (offloading, a measurement), if any, as they would without it."""
    node = out.grad_fn
    if node is None or not torch.is_grad_enabled():
        yield  # no graph (evaluation): nothing is saved
        return
    assert hasattr(node, "layout"), "recompute_saved takes a `recomputed` output"
    ptr, device, dtype = out.untyped_storage().data_ptr(), out.device, out.dtype
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer or (lambda t: t, lambda t: t)

    def pack(t: torch.Tensor) -> object:
        if t.device == device and t.dtype == dtype and t.untyped_storage().data_ptr() == ptr:
            return _Note(node, t.size(), t.stride(), t.storage_offset())
        return outer_pack(t)

    def unpack(saved: object) -> torch.Tensor:
        if isinstance(saved, _Note):
            return _rerun(saved.node)[1].detach().as_strided(saved.size, saved.stride, saved.offset)
        return outer_unpack(saved)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
