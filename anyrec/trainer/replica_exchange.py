"""2D's replicas kept equal by exchanging each step's embedding gradients instead of averaging weights.

torchrec's `DMPCollection.sync()` averages the replicas' weights and fused optimizer state after each
group applied its own update. For SGD that is 1D's update (the mean of the replicas' steps is the step of
the mean gradient); for a stateful rule it is not: Adagrad's replicas accumulate m_r = m + g_r^2 and step
lr g_r / sqrt(m_r), and neither the mean of m_r (m + mean(g_r^2)) nor the mean of the steps is what 1D
computes from the mean gradient (m + mean(g_r)^2, lr mean(g_r) / sqrt(that)). No function of the
averaged (weights, state) recovers it.

The exchange gives every replica 1D's update instead: in the backward, each table-batched kernel (FBGEMM's
`SplitTableBatchedEmbeddingBagsCodegen` or anyrec's `TritonTableBatchedEmbedding`) gathers its replica
group's lookups (ids, bag offsets, per-sample weights) and the gradients of their pooled outputs, and runs
its fused backward once on all of them, the gradients divided by the replicas. torchrec divides the
gradient by the group's size, so each row's gradient is then the world's mean, 1D's, and every replica
applies the same update from the same state: the replicas stay equal with nothing to average. The cost
is an all-gather over the replica group of the group's lookups and their output gradients per step, and
each kernel's backward running over R groups' lookups (1D's backward load per shard).
Legend (shape suffixes): N lookups, F features, B batch (bags per feature), Dt output dim, R replicas.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
from torch import nn

from anyrec.kernels.tbe import TritonTableBatchedEmbedding

# kernels whose backward applies the fused update and whose forward takes (indices, offsets,
# per_sample_weights): the ones the exchange wraps
EXCHANGED_KERNELS = (SplitTableBatchedEmbeddingBagsCodegen, TritonTableBatchedEmbedding)


class ReplicaUpdate(enum.StrEnum):
    """How 2D keeps a shard's replicas one model (`planner.replica_update`)."""

    AVERAGE = "average"  # torchrec's sync(): weights and optimizer state averaged every k steps
    GRADIENTS = "gradients"  # each step's embedding gradients exchanged before the fused update


def resolve_replica_update(text: str, optimizer: str, sync_every: int) -> ReplicaUpdate:
    """`planner.replica_update` for a job: `auto` exchanges gradients where averaging is not 1D's update
    (a stateful optimizer, averaged every step) and averages otherwise (SGD, or k > 1 steps, where the
    replicas are meant to drift between averagings). ValueError for an unknown value or gradients with
    k > 1 (exchanged replicas never drift; k would be ignored)."""
    if text == "auto":
        stateful = optimizer != "sgd"
        return ReplicaUpdate.GRADIENTS if stateful and sync_every == 1 else ReplicaUpdate.AVERAGE
    try:
        update = ReplicaUpdate(text)
    except ValueError:
        raise ValueError(f"planner.replica_update={text}: expected auto, average or gradients") from None
    if update == ReplicaUpdate.GRADIENTS and sync_every != 1:
        raise ValueError(f"planner.replica_update=gradients keeps the replicas equal every step; "
                         f"planner.replica_sync_every={sync_every} applies to average only")
    return update


def exchange_gradients(kernels: list[nn.Module], replica_pg: dist.ProcessGroup, replicas: int,
                       group_size: int) -> int:
    """Make every kernel of `kernels` that `EXCHANGED_KERNELS` lists run its fused update on its replica
    group's gradients (the module docstring; `replicas` groups of `group_size` ranks): its `forward` is
    replaced on the instance (hooks cannot move the update into the backward). Returns how many kernels
    were wrapped."""
    wrapped = 0
    for kernel in kernels:
        if isinstance(kernel, EXCHANGED_KERNELS) and not hasattr(kernel, "_anyrec_unexchanged_forward"):
            kernel._anyrec_unexchanged_forward = kernel.forward
            kernel.forward = _ExchangedForward(kernel, kernel.forward, replica_pg, replicas, group_size)
            wrapped += 1
    return wrapped


class _ExchangedForward:
    """A kernel's forward whose training lookups update through `_ReplicaLookup`."""

    def __init__(self, kernel: nn.Module, forward: Callable[..., torch.Tensor], pg: dist.ProcessGroup,
                 replicas: int, group_size: int) -> None:
        self._kernel, self._forward = kernel, forward
        self.pg, self.replicas, self.group_size = pg, replicas, group_size
        self._placeholder = torch.zeros(0, requires_grad=True)  # gives the output a grad_fn

    def __call__(self, indices: torch.Tensor, offsets: torch.Tensor,
                 per_sample_weights: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if not (torch.is_grad_enabled() and self._kernel.training):
            return self._forward(indices=indices, offsets=offsets, per_sample_weights=per_sample_weights,
                                 **kwargs)
        if kwargs.get("batch_size_per_feature_per_rank") is not None:
            raise ValueError("planner.replica_update=gradients does not support variable batch sizes per "
                             "feature (torchrec's VBE); use planner.replica_update=average")
        return _ReplicaLookup.apply(self._placeholder, self, indices, offsets, per_sample_weights, kwargs)

    def replay(self, indices: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None,
               kwargs: dict[str, Any], grad_out_BDt: torch.Tensor) -> None:
        """The kernel's own forward and fused backward over `indices`/`offsets` (the replica group's
        lookups), counted as the step's one lookup by kernels that count their iterations."""
        for name in ("iter", "iter_cpu"):  # FBGEMM counts forwards (Adam's bias correction reads it)
            counter = getattr(self._kernel, name, None)
            if isinstance(counter, torch.Tensor):
                counter.sub_(1)
        with torch.enable_grad():
            out_BDt = self._forward(indices=indices, offsets=offsets, per_sample_weights=psw, **kwargs)
        torch.autograd.backward(out_BDt, grad_out_BDt.to(out_BDt.dtype))


class _ReplicaLookup(torch.autograd.Function):
    """Forward: the kernel's lookup of this rank's batch, with no update recorded. Backward: gather the
    replica group's lookups and output gradients, and run the kernel's fused update over all of them."""

    @staticmethod
    def forward(ctx, placeholder, exchange, indices_N, offsets_FB1, psw_N, kwargs):
        out_BDt = exchange._forward(indices=indices_N, offsets=offsets_FB1, per_sample_weights=psw_N,
                                    **kwargs)
        ctx.exchange, ctx.kwargs = exchange, kwargs
        ctx.inputs = (indices_N, offsets_FB1, psw_N)
        return out_BDt

    @staticmethod
    def backward(ctx, grad_out_BDt):
        exchange = ctx.exchange
        indices_N, offsets_FB1, psw_N, grad_BDt = gather_lookups(*ctx.inputs, grad_out_BDt, exchange.pg,
                                                                 exchange.replicas, exchange.group_size)
        exchange.replay(indices_N, offsets_FB1, psw_N, ctx.kwargs, grad_BDt)
        return None, None, None, None, None, None


def gather_lookups(indices_N: torch.Tensor, offsets_FB1: torch.Tensor, psw_N: torch.Tensor | None,
                   grad_BDt: torch.Tensor, pg: dist.ProcessGroup, replicas: int, group_size: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The replica group's lookups as one batch, the same on every replica, and their output gradients
    divided by `replicas` (the mean over the replicas). A replica's batch is its group's `group_size`
    ranks' batches in group order (torchrec's all-to-all orders by source rank); with equal batches the
    result interleaves them in world-rank order (group g's i-th rank is rank i R + g, torchrec's layout),
    the order 1D's kernel sees, so each row's gradient is summed in 1D's order. Otherwise replica 0's
    bags come first in every feature."""
    batch = grad_BDt.shape[0]
    if batch == 0 or (offsets_FB1.numel() - 1) % batch:
        raise ValueError(f"a lookup of {offsets_FB1.numel() - 1} bags does not split into a batch of {batch}")
    features = (offsets_FB1.numel() - 1) // batch
    sizes = torch.tensor([indices_N.numel(), batch], dtype=torch.int64, device=grad_BDt.device)
    sizes_R2 = torch.stack(_all_gather(sizes, pg, replicas)).cpu()
    n_max, b_max = (int(v) for v in sizes_R2.max(0).values)
    lengths_FB = (offsets_FB1[1:] - offsets_FB1[:-1]).view(features, batch)
    ids_R = _all_gather(_padded(indices_N, n_max), pg, replicas)
    lengths_R = _all_gather(_padded(lengths_FB, b_max, dim=1), pg, replicas)
    grads_R = _all_gather(_padded(grad_BDt.contiguous(), b_max), pg, replicas)
    psw_R = _all_gather(_padded(psw_N, n_max), pg, replicas) if psw_N is not None else None
    equal = bool((sizes_R2[:, 1] == batch).all()) and batch % group_size == 0
    blocks = group_size if equal else 1  # per replica: its ranks' batches, or one block
    ids, psws, keys, lens, grads = [], [], [], {}, {}
    for r in range(replicas):
        n, b = (int(v) for v in sizes_R2[r])
        lengths_FB = lengths_R[r][:, :b]
        step = b // blocks
        ids.append(ids_R[r][:n])
        if psw_R is not None:
            psws.append(psw_R[r][:n])
        for i in range(blocks):
            lens[i * replicas + r] = lengths_FB[:, i * step:(i + 1) * step]
            grads[i * replicas + r] = grads_R[r][i * step:(i + 1) * step]
        # each id's place in the result: feature-major, then block i, then replica r
        block_FB = (torch.arange(b, device=lengths_FB.device) // step).expand(features, b)
        feature_FB = torch.arange(features, device=lengths_FB.device)[:, None].expand(features, b)
        key_FB = (feature_FB * blocks + block_FB) * replicas + r
        keys.append(torch.repeat_interleave(key_FB.reshape(-1), lengths_FB.reshape(-1), output_size=n))
    order = torch.sort(torch.cat(keys), stable=True).indices
    lengths = torch.cat([lens[k] for k in sorted(lens)], dim=1).reshape(-1)
    offsets = torch.zeros(lengths.numel() + 1, dtype=offsets_FB1.dtype, device=offsets_FB1.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    psw = torch.cat(psws)[order] if psw_R is not None else None
    return torch.cat(ids)[order], offsets, psw, torch.cat([grads[k] for k in sorted(grads)]) / replicas


def _padded(t: torch.Tensor, size: int, dim: int = 0) -> torch.Tensor:
    """`t` zero-padded along `dim` to `size` (all_gather needs one shape on every rank)."""
    if t.shape[dim] == size:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def _all_gather(t: torch.Tensor, pg: dist.ProcessGroup, replicas: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(replicas)]
    dist.all_gather(out, t, group=pg)
    return out
