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

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
from torch import nn

from anyrec.kernels.tbe import TritonTableBatchedEmbedding
from anyrec.runtime.distributed import all_gather_list, padded

# kernels whose backward applies the fused update and whose forward takes (indices, offsets,
# per_sample_weights): the ones the exchange wraps
EXCHANGED_KERNELS = (SplitTableBatchedEmbeddingBagsCodegen, TritonTableBatchedEmbedding)


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
        # features the kernel pools (a lookup's bags are features x its batch, even an empty batch's)
        layout = getattr(kernel, "layout", None)
        self.features = len(layout.feature_table_map if layout is not None else kernel.feature_table_map)
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
        indices_N, offsets_FB1, psw_N, grad_BDt = gather_lookups(
            *ctx.inputs, grad_out_BDt, exchange.features, exchange.pg, exchange.replicas, exchange.group_size)
        exchange.replay(indices_N, offsets_FB1, psw_N, ctx.kwargs, grad_BDt)
        return None, None, None, None, None, None


def gather_lookups(indices_N: torch.Tensor, offsets_FB1: torch.Tensor, psw_N: torch.Tensor | None,
                   grad_BDt: torch.Tensor, features: int, pg: dist.ProcessGroup, replicas: int,
                   group_size: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """This rank's lookups of `features` features and their output gradients gathered over its replica
    group (`replicas` ranks) and merged into one batch by `merge_lookups`: the same batch on every
    replica."""
    batch = grad_BDt.shape[0]
    assert offsets_FB1.numel() - 1 == features * batch, (offsets_FB1.numel(), features, batch)
    sizes = torch.tensor([indices_N.numel(), batch], dtype=torch.int64, device=grad_BDt.device)
    sizes_R2 = torch.stack(all_gather_list(sizes, pg, replicas)).cpu()
    n_max, b_max = (int(v) for v in sizes_R2.max(0).values)
    lengths_FB = (offsets_FB1[1:] - offsets_FB1[:-1]).view(features, batch)
    ids_R = all_gather_list(padded(indices_N, n_max), pg, replicas)
    lengths_R = all_gather_list(padded(lengths_FB, b_max, dim=1), pg, replicas)
    grads_R = all_gather_list(padded(grad_BDt.contiguous(), b_max), pg, replicas)
    psw_R = all_gather_list(padded(psw_N, n_max), pg, replicas) if psw_N is not None else None
    n_R, b_R = sizes_R2[:, 0].tolist(), sizes_R2[:, 1].tolist()
    ids, offsets, psw, grads = merge_lookups(
        [t[:n] for t, n in zip(ids_R, n_R, strict=True)],
        [t[:, :b] for t, b in zip(lengths_R, b_R, strict=True)],
        None if psw_R is None else [t[:n] for t, n in zip(psw_R, n_R, strict=True)],
        [t[:b] for t, b in zip(grads_R, b_R, strict=True)], group_size)
    return ids, offsets.to(offsets_FB1.dtype), psw, grads


def merge_lookups(ids_R: list[torch.Tensor], lengths_R: list[torch.Tensor], psw_R: list[torch.Tensor] | None,
                  grads_R: list[torch.Tensor], group_size: int = 1
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One batch of the R replicas' lookups (per replica: its ids [N], bag lengths [F, B], per-sample
    weights [N] or None, output gradients [B, Dt]): (ids, offsets [F * sum B + 1], weights, gradients /
    R, the mean over the replicas). A replica's batch is its group's `group_size` ranks' batches in group
    order (torchrec's all-to-all orders by source rank); with equal batches the result interleaves them
    in world-rank order (group g's i-th rank is rank i R + g, torchrec's layout), the order 1D's kernel
    sees, so each row's gradient is summed in 1D's order. Otherwise replica 0's bags come first in
    every feature."""
    replicas, features = len(ids_R), lengths_R[0].shape[0]
    batches = [lengths.shape[1] for lengths in lengths_R]
    blocks = group_size if len(set(batches)) == 1 and batches[0] % group_size == 0 else 1
    keys, lens, grads = [], {}, {}
    for r, (lengths_FB, b) in enumerate(zip(lengths_R, batches, strict=True)):
        step = b // blocks
        for i in range(blocks):
            lens[i * replicas + r] = lengths_FB[:, i * step:(i + 1) * step]
            grads[i * replicas + r] = grads_R[r][i * step:(i + 1) * step]
        # each id's place in the result: feature-major, then block i, then replica r
        block_FB = (torch.arange(b, device=lengths_FB.device) // max(step, 1)).expand(features, b)
        feature_FB = torch.arange(features, device=lengths_FB.device)[:, None].expand(features, b)
        key_FB = (feature_FB * blocks + block_FB) * replicas + r
        keys.append(torch.repeat_interleave(key_FB.reshape(-1), lengths_FB.reshape(-1),
                                            output_size=ids_R[r].numel()))
    order = torch.sort(torch.cat(keys), stable=True).indices
    lengths = torch.cat([lens[k] for k in sorted(lens)], dim=1).reshape(-1)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    offsets[1:] = torch.cumsum(lengths, 0)
    psw = torch.cat(psw_R)[order] if psw_R is not None else None
    return torch.cat(ids_R)[order], offsets, psw, torch.cat([grads[k] for k in sorted(grads)]) / replicas


