"""Deterministic synthetic Criteo-shaped data, generated on the device that consumes it.

Sample `n` of a split is a pure function of (seed, split, n, feature, slot), where n is the sample's
global position: global step s is one global batch of G = batch x world size samples, rank r takes
samples s*G + r*B .. s*G + r*B + B - 1. So 1 rank x 512 and 2 ranks x 256 train on the same samples,
and resumes and reruns see the same data.

How a batch is made (a fixed number of vectorised ops, whatever the number of features):
  - each sample's index is hashed to 32 bits (murmur3 finaliser, int64 tensors holding 32-bit values);
  - every (sample, slot) gets h = sample_hash * slot_multiplier (a 63-bit product: exact in int64);
    bits 18..31 of h pick one of 2^14 popularity buckets of the feature, bits 32..49 a uniform offset
    inside the bucket's block of ids;
  - the buckets come from the power law's inverse CDF, P(rank k) ~ 1/(k+1)^zipf_exponent, computed
    once on the host in float64: bucket b covers the quantiles [b/2^14, (b+1)/2^14), so the law holds to
    1/2^14 of probability mass per bucket, and uniformly within a bucket's block of ranks (at most 2^18
    distinct offsets in a block). Blocks of ranks are scattered over the id range by a seeded shuffle,
    so popular ids are not the small ones;
  - labels come from a hidden logistic teacher: a fixed-point weight per (feature, block of ids) (each
    id's weight is its block's) plus a linear term on the dense features; the fixed-point logit indexes a
    table of click probabilities, compared with a 32-bit hash of the sample. A model can learn it;
    `signal_scale` is the logit's standard deviation.
  - dense features are a normal quantile table of 2^12 levels (float32, built on the host), indexed by
    hashed bits; the teacher's dense term uses the same levels in fixed point.

Exactness across devices: ids, lengths, labels and dense values are bit-identical on every device
(CPU, CUDA, ROCm) for the same seed: the per-batch maths is int64 arithmetic on values below 2^63
(multiply, shift, mask, add, gather, integer sums) and dense values are gathered from a float32 table.
The host-side tables (inverse CDF, normal quantiles, sigmoid) are computed in float64 with the host's
libm and rounded; they are statistically identical everywhere and bit-identical across hosts whose libm
agrees on those values (floor/round boundaries would have to fall within 1 ulp to differ).
Legend: B batch per rank, S id slots per sample (sum of multi_hot), F sparse features, I dense features,
K buckets per feature.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec.config import DataConfig, ModelConfig
from anyrec.schema import feature_names, ids_per_sample

_SPLITS = {"train": 0, "eval": 1}
_MASK32 = 0xFFFFFFFF
_BUCKET_BITS = 14  # popularity buckets per feature
_OFFSET_BITS = 18  # uniform offset of an id inside its bucket's block
_DENSE_BITS = 12  # levels of the dense features' normal quantile table
_Z_FRAC_BITS = 16  # fixed-point fraction bits of the hidden logit
_P_FRAC_BITS = 10  # logit resolution of the click-probability table
_Z_MAX = 8  # the probability table spans logits in [-8, 8) (|z| has unit variance)
# A teacher weight is at most sqrt(3) * 2^16 / sqrt(2) (one feature, one slot) < 2^17 in magnitude;
# it shares a lookup entry with its block's width (< 2^40): width << 20 | (teacher + 2^19).
_TEACHER_BITS = 20
# On a CPU the [B, S] pass goes through slot columns about this many ids at a time, which bounds its
# four scratch buffers (2 MB each here; a DLRMv2 batch of 16384 x 214 ids would need 28 MB each).
# Smaller pieces measured slower (more ops per batch, no faster per id); accelerators take every
# column in one pass.
_CPU_PASS_IDS = 1 << 18
_PACKED_BITS = 63  # first id, width and teacher weight share one int64 entry when they fit these bits


def _mix32(h):
    """A 32-bit integer hash (murmur3 finaliser) on ints or int64 tensors holding values < 2^32."""
    h = h & _MASK32
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & _MASK32  # constants < 2^31 keep the product inside int64
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & _MASK32
    return h ^ (h >> 16)


def _key(*parts: int) -> int:
    """A 32-bit key from any number of integers (each folded in 32 bits at a time)."""
    h = 0x2545F491
    for p in parts:
        p &= (1 << 64) - 1
        h = _mix32(h ^ (p & _MASK32))
        h = _mix32(h ^ (p >> 32))
    return h


def _multiplier(key: int) -> int:
    """An odd multiplier in [2^30, 2^31): its product with a 32-bit hash stays below 2^63."""
    return (key & 0x3FFFFFFF) | 0x40000001


def _unit(key: torch.Tensor) -> torch.Tensor:
    """32-bit hashes as float64 quantiles in (0, 1)."""
    return (key.double() + 0.5) / 2.0**32


def _power_law_blocks(n: int, zipf: float, key: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per bucket: first id of its block, block width, block number (host, int64, K entries each). Bucket b
    holds the ranks whose inverse-CDF quantile lies in [b/K, (b+1)/K). Non-empty buckets are disjoint blocks
    tiling [0, n); an empty bucket (a rank more popular than 1/K) shares the block of the next non-empty
    bucket, which starts at that rank."""
    K = 1 << _BUCKET_BITS
    u = torch.arange(K + 1, dtype=torch.float64) / K
    if zipf == 0:
        x = u * n + 1
    elif abs(zipf - 1.0) < 1e-9:
        x = torch.exp(u * math.log(n + 1))
    else:
        a = 1.0 - zipf
        x = ((math.pow(n + 1, a) - 1.0) * u + 1.0).pow(1.0 / a)
    edge = (x.floor().long() - 1).clamp_(0, n)
    edge[0], edge[K] = 0, n
    edge = torch.cummax(edge, 0).values
    nonempty = edge[1:] > edge[:-1]
    block_of_nonempty = torch.cumsum(nonempty.long(), 0) - 1
    first = torch.where(nonempty, torch.arange(K), torch.full((K,), K))
    owner = torch.flip(torch.cummin(torch.flip(first, [0]), 0).values, [0])  # next non-empty bucket
    starts = torch.nonzero(nonempty).squeeze(1)
    sizes = edge[starts + 1] - edge[starts]
    # Scatter whole blocks over the id range: a seeded shuffle of their order.
    order = torch.argsort(_mix32(torch.arange(len(starts)) ^ key), stable=True)
    first_id = torch.empty_like(sizes)
    first_id[order] = torch.cumsum(sizes[order], 0) - sizes[order]
    block = block_of_nonempty[owner]
    return first_id[block], sizes[block], block


class SyntheticCriteo:
    """Criteo-shaped batches (13 dense, 26 sparse by default) for one rank of a data-parallel job. One-hot or
    multi-hot following `model.multi_hot`; each feature draws ids from its own range, `data.id_range_scale` x
    its table's rows (above 1.0 some ids are out of range, on purpose). Batches are made on `device` (default
    CPU)."""

    def __init__(self, model: ModelConfig, data: DataConfig, seed: int, rank: int = 0,
                 world_size: int = 1, split: str = "train", device: torch.device | str | None = None) -> None:
        if split not in _SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {list(_SPLITS)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
        rows = list(model.table_rows)
        self.multi_hot = ids_per_sample(model)
        self.keys = feature_names(len(rows))
        self.num_dense = model.num_dense_features
        self.batch_size = data.batch_size
        self.global_batch_size = data.batch_size * world_size
        self.seed, self.rank, self.world_size, self.split = seed, rank, world_size, split
        self.device = torch.device(device or "cpu")
        self.ranges = [max(1, math.ceil(r * data.id_range_scale)) for r in rows]
        if max(self.ranges) >= 1 << 40:
            raise ValueError(f"id range {max(self.ranges)} is too large (at most 2^40 ids per feature)")
        self._split_key = _key(seed, 0xDA7A, _SPLITS[split])
        self._build_tables(seed, data)

    def _build_tables(self, seed: int, data: DataConfig) -> None:
        """Host-side constants (computed once, in float64), then moved to the device."""
        num_f, K, num_i, dev = len(self.ranges), 1 << _BUCKET_BITS, self.num_dense, self.device
        zscale = 2.0**_Z_FRAC_BITS / math.sqrt(2.0)  # sparse and dense parts each have unit variance
        first_id, width, teacher = [], [], []
        for f, (n, L) in enumerate(zip(self.ranges, self.multi_hot, strict=True)):
            fid, w, block = _power_law_blocks(n, data.zipf_exponent, _key(seed, 1, f))
            first_id.append(fid)
            width.append(w)
            # The teacher's weight per block, uniform in [-sqrt 3, sqrt 3] (unit variance); a sample's
            # sparse logit is the mean over its slots, summed over features / sqrt(F).
            t = (_unit(_mix32(block ^ _key(seed, 2, f))) * 2.0 - 1.0) * math.sqrt(3.0)
            teacher.append(torch.round(t * zscale / (L * math.sqrt(num_f))).long())
        teacher_all = torch.cat(teacher)
        assert int(teacher_all.abs().max()) < 1 << (_TEACHER_BITS - 1), "teacher weights must fit"
        # Width and teacher weight share one entry: width << 20 | (teacher + 2^19). Where every id and
        # width fits `_id_bits` bits with 2 * _id_bits + 20 <= 63 (ranges up to 2^21 ids), the block's
        # first id joins them above and a slot takes one table lookup instead of two: the lookups'
        # random reads of tables larger than the caches are most of a batch's cost. Same values.
        width_teacher = (torch.cat(width) << _TEACHER_BITS) | (teacher_all + (1 << (_TEACHER_BITS - 1)))
        id_bits = max(self.ranges).bit_length()
        self._id_bits = id_bits if 2 * id_bits + _TEACHER_BITS <= _PACKED_BITS else None
        if self._id_bits is None:
            self._first_id = torch.cat(first_id).to(dev)
            self._width_teacher = width_teacher.to(dev)
        else:
            self._first_id = None
            self._width_teacher = ((torch.cat(first_id) << (_TEACHER_BITS + id_bits)) | width_teacher).to(dev)
        levels = 1 << _DENSE_BITS
        q = torch.special.ndtri((torch.arange(levels, dtype=torch.float64) + 0.5) / levels)
        w_I = torch.special.ndtri(_unit(torch.tensor([_key(seed, 4, i) for i in range(num_i)])))
        w_I /= math.sqrt(max(num_i, 1))
        self._dense_levels = q.float().to(dev)
        self._dense_teacher = torch.round(w_I[:, None] * q[None, :] * zscale).long().reshape(-1).to(dev)
        self._dense_mult_I = torch.tensor([_multiplier(_key(seed, 5, i)) for i in range(num_i)],
                                          dtype=torch.int64, device=dev)
        self._dense_base_I = torch.arange(num_i, dtype=torch.int64, device=dev) * levels
        z = (torch.arange(2 * _Z_MAX << _P_FRAC_BITS, dtype=torch.float64) + 0.5) / (1 << _P_FRAC_BITS)
        p = torch.sigmoid(data.signal_scale * (z - _Z_MAX) - 1.0)
        self._click_threshold = torch.floor(p * 2.0**32).long().to(dev)
        B = self.batch_size
        self._length_per_key = [B * L for L in self.multi_hot]
        self._offset_per_key = [0, *torch.cumsum(torch.tensor(self._length_per_key), 0).tolist()]
        self._lengths = torch.cat([torch.full((B,), L, dtype=torch.int32) for L in self.multi_hot]).to(dev)
        self._arange_B = torch.arange(B, dtype=torch.int64, device=dev)
        self._salt_21 = torch.tensor([[0x68E31DA4], [0x1B56C4E9]], dtype=torch.int64, device=dev)
        # The same multipliers and table offsets as one row of all slots, feature after feature.
        self._mult_S = torch.tensor([_multiplier(_key(seed, 3, f, j)) for f, L in enumerate(self.multi_hot)
                                     for j in range(L)], device=dev)
        self._base_S = torch.tensor([f * K for f, L in enumerate(self.multi_hot) for _ in range(L)],
                                    device=dev)
        self._passes = self._plan_passes(B * len(self._mult_S) if dev.type != "cpu" else _CPU_PASS_IDS)
        self._scratch: list[torch.Tensor] = []  # sized by the first pass that needs them

    def _plan_passes(self, max_ids: int) -> list[tuple[int, int, list[tuple[int, int, int, int, int, int]]]]:
        """Column ranges [c0, c1) of the [B, S] pass, each about `max_ids` ids (at least one column),
        with the pieces of features they hold: (first column in the range, first value of the
        feature's ids, k features in a row with L slots each, slots j0 .. j1 of each). Consecutive
        whole features with the same L form one piece: one op writes them all."""
        B, passes, col = self.batch_size, [], 0
        cols = max(1, max_ids // B)
        c0, pieces = 0, []
        for f, L in enumerate(self.multi_hot):
            for j0 in range(0, L, cols):
                j1 = min(L, j0 + cols)
                if col + j0 - c0 + (j1 - j0) > cols and pieces:  # this range is full: start the next
                    passes.append((c0, col + j0, pieces))
                    c0, pieces = col + j0, []
                last = pieces[-1] if pieces else None
                if (last is not None and j0 == 0 and j1 == L and last[3] == L and last[4] == 0
                        and last[5] == L and last[0] + last[2] * L == col - c0):
                    pieces[-1] = (last[0], last[1], last[2] + 1, L, 0, L)
                else:
                    pieces.append((col + j0 - c0, self._offset_per_key[f], 1, L, j0, j1))
            col += L
        passes.append((c0, col, pieces))
        return passes

    def _sample_hashes(self, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Three independent 32-bit hashes of samples first .. first + B - 1: sparse, dense, click."""
        n_B = self._arange_B + first
        h_B = _mix32(_mix32((n_B & _MASK32) ^ self._split_key) ^ (n_B >> 32))
        hd_B, hc_B = _mix32(h_B ^ self._salt_21).unbind(0)  # both in one pass
        return h_B, hd_B, hc_B

    def _ids(self, h_B: torch.Tensor, mult: torch.Tensor, base: torch.Tensor):
        """(first id of the block, offset in it, teacher weight) of every slot in h_B * mult. Scratch buffers
        are reused across batches: fresh large tensors cost more (page faults) than the maths."""
        shape = torch.broadcast_shapes(h_B.shape, mult.shape)
        n = math.prod(shape)
        if not self._scratch or self._scratch[0].numel() < n:
            self._scratch = [torch.empty(n, dtype=torch.int64, device=self.device) for _ in range(4)]
        h, bucket, looked_up, teacher = (t[:n] for t in self._scratch)
        h = torch.mul(h_B, mult, out=h.view(shape))  # < 2^63
        torch.bitwise_right_shift(h.view(-1), 32 - _BUCKET_BITS, out=bucket)
        bucket.view(shape).bitwise_and_((1 << _BUCKET_BITS) - 1).add_(base)
        offset = h.bitwise_right_shift_(32).bitwise_and_((1 << _OFFSET_BITS) - 1)
        torch.gather(self._width_teacher, 0, bucket, out=looked_up)
        torch.bitwise_and(looked_up, (1 << _TEACHER_BITS) - 1, out=teacher).sub_(1 << (_TEACHER_BITS - 1))
        if self._id_bits is None:  # first id in a table of its own
            offset.mul_(looked_up.bitwise_right_shift_(_TEACHER_BITS).view(shape)).bitwise_right_shift_(_OFFSET_BITS)
            torch.gather(self._first_id, 0, bucket, out=looked_up)
        else:  # first id << (20 + id_bits) | width << 20 | teacher
            width = torch.bitwise_right_shift(looked_up, _TEACHER_BITS, out=bucket).bitwise_and_(
                (1 << self._id_bits) - 1)
            offset.mul_(width.view(shape)).bitwise_right_shift_(_OFFSET_BITS)
            looked_up.bitwise_right_shift_(_TEACHER_BITS + self._id_bits)
        return looked_up.view(shape), offset, teacher.view(shape)

    def batch(self, step: int) -> Batch:
        """Batch number `step` of this rank's slice of the global batch."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        B = self.batch_size
        h_B, hd_B, hc_B = self._sample_hashes(step * self.global_batch_size + self.rank * B)
        values = torch.empty(self._offset_per_key[-1], dtype=torch.int64, device=self.device)
        z_B = torch.zeros(B, dtype=torch.int64, device=self.device)
        for c0, c1, pieces in self._passes:  # [B, c1 - c0] slot columns at a time
            first_id_BC, offset_BC, teacher_BC = self._ids(h_B.view(B, 1), self._mult_S[c0:c1],
                                                           self._base_S[c0:c1])
            for c, start, k, L, j0, j1 in pieces:  # k features' slots j0 .. j1: [B, k, w] -> [k, B, w]
                w = j1 - j0
                torch.add(first_id_BC[:, c:c + k * w].view(B, k, w).transpose(0, 1),
                          offset_BC[:, c:c + k * w].view(B, k, w).transpose(0, 1),
                          out=values[start:start + k * B * L].view(k, B, L)[:, :, j0:j1])
            z_B += teacher_BC.sum(1)
        level_BI = ((hd_B[:, None] * self._dense_mult_I) >> (32 - _DENSE_BITS)) & ((1 << _DENSE_BITS) - 1)
        dense_BI = torch.take(self._dense_levels, level_BI)
        z_B += torch.take(self._dense_teacher, level_BI + self._dense_base_I).sum(1)
        zi_B = ((z_B >> (_Z_FRAC_BITS - _P_FRAC_BITS)) + (_Z_MAX << _P_FRAC_BITS)).clamp_(
            0, self._click_threshold.numel() - 1)
        labels_B = (hc_B < torch.take(self._click_threshold, zi_B)).float()
        sparse = KeyedJaggedTensor(keys=self.keys, values=values, lengths=self._lengths.clone(), stride=B,
                                   length_per_key=self._length_per_key,
                                   offset_per_key=self._offset_per_key)
        return Batch(dense_features=dense_BI, sparse_features=sparse, labels=labels_B)

    def iter_from(self, step: int = 0, num_steps: int | None = None) -> Iterator[Batch]:
        """Batches `step`, `step + 1`, ... (forever when num_steps is None)."""
        return map(self.batch, itertools.count(step) if num_steps is None else range(step, step + num_steps))
