"""Portable (pure torch) kernels for the FBGEMM sparse ops torchrec's distributed path calls.

torchrec's `DistributedModelParallel` moves ids and pooled embeddings with FBGEMM operators (KJT permutes,
offsets, row-wise bucketisation, pooled-embedding permutes); a device with no FBGEMM build for it has their
schemas but no kernels. `install` registers the kernels below with `torch.library` for the backend's
dispatch key (`backend.sparse_ops`: auto, only where FBGEMM has no kernel; portable, every op; fbgemm,
none). The ops are what a recording of a 2-stage pipelined training step found for every sharding type
anyrec plans (docs/porting.md, "Sparse ops").

Each kernel gives bit-identical results to FBGEMM's CPU one, including its unsigned treatment of
negative ids in bucketisation; index arithmetic is int64; no kernel synchronises with the device when
torchrec passes the output size.

Legend: T features (rows of a 2-D lengths), B batch, N ids, D_sum summed embedding dims.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from anyrec.backends.dispatch import dispatch_key, fbgemm_load_error, has_kernel, select

if TYPE_CHECKING:
    from anyrec.backends.interface import Backend

logger = logging.getLogger(__name__)

MODES = ("auto", "fbgemm", "portable")

# ---- the kernels ---------------------------------------------------------------------------------

def _complete_cumsum(x: torch.Tensor) -> torch.Tensor:
    """[0, x0, x0+x1, ...] along the last dim, in x's dtype."""
    zero = torch.zeros((*x.shape[:-1], 1), dtype=x.dtype, device=x.device)
    return torch.cat([zero, torch.cumsum(x, -1, dtype=x.dtype)], -1)


def asynchronous_complete_cumsum(t_in: torch.Tensor) -> torch.Tensor:
    """Offsets from lengths: 1-D [N] -> [N+1], 2-D [R, N] -> [R, N+1] (each row on its own)."""
    if t_in.dim() not in (1, 2):
        raise RuntimeError(f"asynchronous_complete_cumsum: expected a 1-D or 2-D tensor, got {t_in.dim()}-D")
    return _complete_cumsum(t_in.contiguous())


def _segment_gather(starts_S: torch.Tensor, lens_S: torch.Tensor, total: int | None) -> torch.Tensor:
    """Positions that concatenate segments [start, start + len) in order (int64)."""
    lens_S = lens_S.to(torch.int64)
    if total is None:
        total = int(lens_S.sum())  # a sync; torchrec passes the size to avoid it
    out_starts_S = _complete_cumsum(lens_S)[:-1]
    shift_N = torch.repeat_interleave(starts_S.to(torch.int64) - out_starts_S, lens_S, output_size=total)
    return shift_N + torch.arange(total, dtype=torch.int64, device=lens_S.device)


def _permute_segments(permute: torch.Tensor, seg_lens_S: torch.Tensor, values: torch.Tensor,
                      weights: torch.Tensor | None, total: int | None):
    seg_lens_S = seg_lens_S.to(torch.int64)
    starts_S = _complete_cumsum(seg_lens_S)[:-1]
    perm = permute.to(torch.int64)
    idx_N = _segment_gather(starts_S[perm], seg_lens_S[perm], total)
    return values[idx_N], (weights[idx_N] if weights is not None else None)


def permute_2D_sparse_data(permute: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor,
                           weights: torch.Tensor | None = None, permuted_lengths_sum: int | None = None):
    """Reorder the rows (features) of a [T, B] jagged batch: lengths, values and weights."""
    if lengths.dim() != 2:
        raise RuntimeError(f"permute_2D_sparse_data: lengths must be 2-D, got {lengths.dim()}-D")
    perm = permute.to(torch.int64)
    permuted_lengths = lengths.index_select(0, perm)
    values_out, weights_out = _permute_segments(perm, lengths.sum(1), values, weights, permuted_lengths_sum)
    return permuted_lengths, values_out, weights_out


def permute_1D_sparse_data(permute: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor,
                           weights: torch.Tensor | None = None, permuted_lengths_sum: int | None = None):
    """Reorder the bags of a 1-D jagged batch (each length its own segment)."""
    perm = permute.to(torch.int64)
    flat = lengths.reshape(-1)
    permuted_lengths = flat.index_select(0, perm)
    values_out, weights_out = _permute_segments(perm, flat, values, weights, permuted_lengths_sum)
    return permuted_lengths, values_out, weights_out


def _as_unsigned(ids: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """int64 ids as FBGEMM reads them (unsigned): exact for int32; int64 keeps a flag for x < 0."""
    if ids.dtype == torch.int32:
        return ids.to(torch.int64) & 0xFFFFFFFF, False
    return ids.to(torch.int64), True


def _udivmod(x: torch.Tensor, n: torch.Tensor, wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x // n, x % n) with x read as unsigned 64-bit when `wide` (n > 0, int64 tensors)."""
    q, r = torch.div(x, n, rounding_mode="floor"), torch.remainder(x, n)
    if not wide:
        return q, r
    # x < 0 stands for u = x + 2^64 = y + 2^63, with y = x + 2^63 in [0, 2^63) and 2^63 = a*n + c.
    # Quotients wrap modulo 2^64 like FBGEMM's unsigned ones (n == 1 gives back x).
    neg = x < 0
    y = torch.where(neg, x + (2**63 - 1) + 1, x)
    m = torch.full_like(n, 2**63 - 1)
    m_mod = torch.remainder(m, n) + 1
    a = torch.div(m, n, rounding_mode="floor") + torch.div(m_mod, n, rounding_mode="floor")
    c = torch.remainder(m_mod, n)
    yq, yr = torch.div(y, n, rounding_mode="floor"), torch.remainder(y, n)
    uq = yq + a + torch.div(yr + c, n, rounding_mode="floor")
    ur = torch.remainder(yr + c, n)
    return torch.where(neg, uq, q), torch.where(neg, ur, r)


def block_bucketize_sparse_features(
    lengths: torch.Tensor, indices: torch.Tensor, bucketize_pos: bool, sequence: bool,
    block_sizes: torch.Tensor, my_size: int, weights: torch.Tensor | None = None,
    batch_size_per_feature: torch.Tensor | None = None, max_B: int = -1,
    block_bucketize_pos: list[torch.Tensor] | None = None, keep_orig_idx: bool = False,
    total_num_blocks: torch.Tensor | None = None, keep_orig_idx_per_feature: torch.Tensor | None = None,
):
    """Split each bag's ids by the rank owning their row block (row-wise input distribution): (lengths
    [my_size * T*B], ids, weights?, positions?, unbucketize permute?) bucket by bucket; ids keep their
    order inside a bag, as in FBGEMM's sequential CPU kernel."""
    if block_bucketize_pos:
        raise NotImplementedError("block_bucketize_sparse_features: the portable kernel does not "
                                  "implement block_bucketize_pos (uneven/ZCH buckets)")
    device = indices.device
    T = block_sizes.numel()
    lengths_size = lengths.numel()
    n = indices.numel()
    lengths64 = lengths.reshape(-1).to(torch.int64)
    # Feature of every bag (batch sizes may vary per feature), then of every id.
    if batch_size_per_feature is not None:
        bags_per_feature_T = batch_size_per_feature.to(torch.int64).to(device)
    else:
        bags_per_feature_T = torch.full((T,), lengths_size // max(T, 1), dtype=torch.int64, device=device)
    bag_feature = torch.repeat_interleave(torch.arange(T, device=device), bags_per_feature_T,
                                          output_size=lengths_size)
    bag_of_id = torch.repeat_interleave(torch.arange(lengths_size, device=device), lengths64, output_size=n)
    feat = bag_feature[bag_of_id]
    blk = block_sizes.to(device=device, dtype=torch.int64)[feat]
    if total_num_blocks is not None:
        global_blks_T = total_num_blocks.to(device=device, dtype=torch.int64)
        local_blks_T = torch.div(global_blks_T, my_size, rounding_mode="floor")
    else:
        global_blks_T = torch.full((T,), my_size, dtype=torch.int64, device=device)
        local_blks_T = torch.ones(T, dtype=torch.int64, device=device)
    global_blks, local_blks = global_blks_T[feat], local_blks_T[feat]
    global_size, local_size = blk * global_blks, blk * local_blks
    u, wide = _as_unsigned(indices)
    in_range = (u >= 0) & (u < global_size) if wide else u < global_size
    safe_local = torch.where(in_range, local_size, torch.ones_like(local_size))
    q_in, r_in = _udivmod(u, safe_local, wide)
    q_out, r_out = _udivmod(u, global_blks, wide)
    bucket = torch.where(in_range, q_in, torch.div(r_out, local_blks, rounding_mode="floor"))
    new_ids = torch.where(in_range, r_in, q_out)
    keep = None
    if keep_orig_idx_per_feature is not None:
        keep = keep_orig_idx_per_feature.to(device=device, dtype=torch.bool)[feat]
    elif keep_orig_idx:
        keep = torch.ones_like(in_range)
    if keep is not None:
        new_ids = torch.where(keep, u, new_ids)
    # Output bag (bucket-major), then a stable sort keeps each bag's ids in their input order.
    out_bag = bucket * lengths_size + bag_of_id
    order = torch.sort(out_bag, stable=True).indices
    new_lengths = torch.bincount(out_bag, minlength=my_size * lengths_size).to(lengths.dtype)
    new_indices = new_ids[order].to(indices.dtype)
    new_weights = weights[order] if weights is not None else None
    new_pos = None
    if bucketize_pos:
        bag_start = _complete_cumsum(lengths64)[:-1]
        pos = torch.arange(n, dtype=torch.int64, device=device) - bag_start[bag_of_id]
        new_pos = pos[order].to(indices.dtype)
    unbucketize_permute = None
    if sequence:
        unbucketize_permute = torch.empty(n, dtype=torch.int64, device=device)
        unbucketize_permute[order] = torch.arange(n, dtype=torch.int64, device=device)
        unbucketize_permute = unbucketize_permute.to(indices.dtype)
    return new_lengths, new_indices, new_weights, new_pos, unbucketize_permute


def permute_pooled_embs(pooled_embs: torch.Tensor, offset_dim_list: torch.Tensor, permute_list: torch.Tensor,
                        inv_offset_dim_list: torch.Tensor | None = None,
                        inv_permute_list: torch.Tensor | None = None) -> torch.Tensor:
    """Column blocks of [B, D_sum] in `permute_list` order (block i is columns offsets[i]:offsets[i+1]);
    also serves the `_split` variant the column-wise output dist calls (same schema, same result)."""
    if pooled_embs.numel() == 0:
        return pooled_embs
    offsets = offset_dim_list.to(torch.int64)
    perm = permute_list.to(torch.int64)
    dims = offsets[1:] - offsets[:-1]
    total = pooled_embs.size(1) if perm.numel() == dims.numel() else None  # a full permutation: no sync
    cols = _segment_gather(offsets[:-1][perm], dims[perm], total)
    return pooled_embs.index_select(1, cols)


class _PermutePooled(torch.autograd.Function):
    """Pooled-embedding permute whose backward is the inverse permute."""

    @staticmethod
    def forward(ctx, pooled_embs, offset_dim_list, permute_list, inv_offset_dim_list, inv_permute_list):
        ctx.save_for_backward(inv_offset_dim_list, inv_permute_list)
        return permute_pooled_embs(pooled_embs, offset_dim_list, permute_list)

    @staticmethod
    def backward(ctx, grad_out):
        inv_offsets, inv_perm = ctx.saved_tensors
        return permute_pooled_embs(grad_out.contiguous(), inv_offsets, inv_perm), None, None, None, None


def permute_pooled_embs_auto_grad(pooled_embs, offset_dim_list, permute_list, inv_offset_dim_list,
                                  inv_permute_list) -> torch.Tensor:
    """The pooled-embedding permute with its gradient (the inverse permute), both `_auto_grad` ops."""
    return _PermutePooled.apply(pooled_embs, offset_dim_list, permute_list, inv_offset_dim_list,
                                inv_permute_list)


def invert_permute(permute: torch.Tensor) -> torch.Tensor:
    """The inverse permutation (out[permute[i]] = i), in permute's dtype: the row-wise sequence output
    dist puts the rows it got back in the input's order with it."""
    out = torch.empty_like(permute)
    out[permute.to(torch.int64)] = torch.arange(permute.numel(), dtype=permute.dtype, device=permute.device)
    return out


@dataclass(frozen=True)
class SparseOp:
    """One FBGEMM operator with its portable kernel; `autograd` ops also get it at the Autograd key."""

    name: str
    kernel: Callable[..., Any]
    autograd: bool = False


# The recorded inventory, plus siblings the same torchrec code reaches with other inputs (where torchrec
# and fbgemm_gpu call each in the training step: docs/porting.md, "Sparse ops").
SPARSE_OPS: dict[str, SparseOp] = {op.name: op for op in (
    SparseOp("fbgemm::asynchronous_complete_cumsum", asynchronous_complete_cumsum),
    SparseOp("fbgemm::permute_2D_sparse_data", permute_2D_sparse_data),
    SparseOp("fbgemm::permute_1D_sparse_data", permute_1D_sparse_data),  # variable batch per rank
    SparseOp("fbgemm::block_bucketize_sparse_features", block_bucketize_sparse_features),  # row-wise
    SparseOp("fbgemm::invert_permute", invert_permute),  # row-wise sequence tables (EmbeddingCollection)
    # each pooled permute is what FBGEMM's Python autograd glue calls for the auto_grad op after it
    SparseOp("fbgemm::permute_pooled_embs_split", permute_pooled_embs),
    SparseOp("fbgemm::permute_pooled_embs_auto_grad_split", permute_pooled_embs_auto_grad, autograd=True),
    SparseOp("fbgemm::permute_pooled_embs", permute_pooled_embs),
    SparseOp("fbgemm::permute_pooled_embs_auto_grad", permute_pooled_embs_auto_grad, autograd=True),
)}


# ---- registration --------------------------------------------------------------------------------

@dataclass(frozen=True)
class SparseOpsChoice:
    """What serves the sparse ops on one dispatch key: `portable` lists the ops given our kernels."""

    impl: str  # fbgemm | portable
    dispatch_key: str
    portable: tuple[str, ...]


_libs: dict[str, torch.library.Library] = {}  # dispatch key -> our registrations there
_installed: dict[str, tuple[str, ...]] = {}  # dispatch key -> ops our kernels serve there
_native: dict[tuple[str, str], bool] = {}  # (op, key) -> a kernel was there before ours


def fbgemm_has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether FBGEMM has a kernel for `op` at `dispatch_key` (ours, if installed, do not count)."""
    if op in _installed.get(dispatch_key, ()):
        return _native[(op, dispatch_key)]
    return has_kernel(op, dispatch_key)


def missing_kernels(dispatch_key: str) -> list[str]:
    """Inventory ops with no FBGEMM kernel for `dispatch_key`."""
    return [name for name in SPARSE_OPS if not fbgemm_has_kernel(name, dispatch_key)]


def register(dispatch_key: str, ops: list[str] | tuple[str, ...]) -> None:
    """Serve exactly `ops` with the portable kernels on `dispatch_key` (others revert to FBGEMM)."""
    import fbgemm_gpu  # noqa: F401 - defines the fbgemm:: schemas (and its CPU kernels)

    unregister(dispatch_key)
    if not ops:
        return
    names = set(torch._C._dispatch_get_all_op_names())
    unknown = [op for op in ops if op not in SPARSE_OPS]
    if unknown:
        raise ValueError(f"no portable kernel for {', '.join(unknown)}")
    undefined = [op for op in ops if op not in names]
    if undefined:
        raise ValueError(f"the installed fbgemm_gpu does not define {', '.join(undefined)} "
                         "(no schema to implement)")
    for op in ops:
        _native[(op, dispatch_key)] = torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key)
    lib = torch.library.Library("fbgemm", "IMPL")
    with warnings.catch_warnings():
        # torch warns when a kernel replaces FBGEMM's; `install` logs which ops it replaced.
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for op in ops:
            spec = SPARSE_OPS[op]
            short = op.split("::")[1]
            lib.impl(short, spec.kernel, dispatch_key)
            if spec.autograd:
                lib.impl(short, spec.kernel, f"Autograd{dispatch_key}")  # CPU -> AutogradCPU
    _libs[dispatch_key] = lib
    _installed[dispatch_key] = tuple(ops)


def unregister(dispatch_key: str) -> None:
    """Remove our kernels from `dispatch_key`; FBGEMM's (if any) serve again."""
    lib = _libs.pop(dispatch_key, None)
    if lib is not None:
        lib._destroy()  # the dispatcher falls back to the kernels registered before ours
    _installed.pop(dispatch_key, None)


def installed(dispatch_key: str) -> tuple[str, ...]:
    """The ops our kernels serve on `dispatch_key` now."""
    return _installed.get(dispatch_key, ())


_logged: set[tuple[str, str, tuple[str, ...]]] = set()


def probe_fbgemm(backend: Backend) -> str | None:
    """The `sparse_ops` op's fbgemm probe: fbgemm_gpu loads and has a kernel for the device for every op."""
    reason = fbgemm_load_error()
    if reason is not None:
        return reason
    key = dispatch_key(backend.device_type)
    missing = missing_kernels(key)
    if missing:
        return (f"fbgemm_gpu has no {key} kernel for {len(missing)} of {len(SPARSE_OPS)} sparse ops "
                f"({', '.join(missing)})")
    return None


def install(backend: Backend, mode: str = "auto") -> SparseOpsChoice:
    """Make every inventory op runnable on the backend's device, as `backend.sparse_ops` says (chosen by
    the op dispatch, logged once): `auto`: FBGEMM where it has a kernel, portable kernels for the rest;
    `portable`: portable kernels for all; `fbgemm`: FBGEMM only (fails if it lacks a kernel)."""
    if mode not in MODES:
        raise ValueError(f"backend.sparse_ops must be one of {', '.join(MODES)}, got {mode!r}")
    key = dispatch_key(backend.device_type)
    impl = select(backend, "sparse_ops", mode).name
    if impl == "fbgemm":
        ops: list[str] = []
    elif mode == "portable":
        ops = list(SPARSE_OPS)
    else:
        ops = missing_kernels(key)
    register(key, ops)
    choice = SparseOpsChoice(impl, key, tuple(ops))
    if (key, impl, choice.portable) not in _logged:
        _logged.add((key, impl, choice.portable))
        if ops:
            kept = [op for op in SPARSE_OPS if op not in ops]
            logger.info("sparse ops on %s: portable kernels for %s; FBGEMM kernels for %s", key,
                        ", ".join(ops), ", ".join(kept) or "none")
        else:
            logger.info("sparse ops on %s: FBGEMM kernels for all %d", key, len(SPARSE_OPS))
    return choice


def uninstall(backend: Backend) -> None:
    """Remove the portable kernels from the backend's dispatch key (FBGEMM's serve again)."""
    unregister(dispatch_key(backend.device_type))
