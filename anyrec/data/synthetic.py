"""Deterministic synthetic Criteo-shaped data: power-law ids and a hidden, learnable click model.

Every batch is a pure function of (seed, split, step, rank): ranks read disjoint slices, reruns and
resumes see the same samples. Labels come from a fixed logistic "teacher": a hashed weight per
(feature, id) plus a linear term on the dense features, so a model can learn it and reach a real AUC.
Legend: B batch per rank, I dense features, F sparse features, L ids per sample of one feature.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec.config import DataConfig, ModelConfig
from anyrec.schema import feature_names, ids_per_sample

_SPLITS = {"train": 0, "eval": 1}
_MASK32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (murmur3 finaliser) on int64 tensors holding values < 2^32."""
    h = h & _MASK32
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & _MASK32  # constants < 2^31 keep the product inside int64
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & _MASK32
    return h ^ (h >> 16)


def _coprime_multiplier(n: int, start: int = 1_000_003) -> int:
    """A multiplier coprime to n: `rank * m mod n` is then a permutation of [0, n)."""
    m = start
    while math.gcd(m, n) != 1:
        m += 2
    return m % n if n > 1 else 1


class SyntheticCriteo:
    """Criteo-shaped batches (13 dense, 26 sparse by default) for one rank of a data-parallel job.

    One-hot or multi-hot following `model.multi_hot`; each feature draws ids from its own range,
    `data.id_range_scale` x its table's rows (above 1.0 some ids are out of range, on purpose).
    """

    def __init__(self, model: ModelConfig, data: DataConfig, seed: int, rank: int = 0,
                 world_size: int = 1, split: str = "train") -> None:
        if split not in _SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {list(_SPLITS)}")
        if data.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {data.batch_size}")
        if data.id_range_scale <= 0:
            raise ValueError(f"data.id_range_scale must be > 0, got {data.id_range_scale}")
        self.rows = list(model.table_rows)
        self.multi_hot = ids_per_sample(model)
        self.keys = feature_names(len(self.rows))
        self.num_dense = model.num_dense_features
        self.batch_size = data.batch_size
        self.zipf = data.zipf_exponent
        self.signal = data.signal_scale
        self.seed, self.rank, self.world_size, self.split = seed, rank, world_size, split
        # Ids are drawn from [0, ranges) then scattered by a per-feature permutation.
        self.ranges = [max(1, math.ceil(r * data.id_range_scale)) for r in self.rows]
        self.mults = [_coprime_multiplier(n) for n in self.ranges]
        g = torch.Generator().manual_seed(seed * 7919 + 17)
        self.offsets = [int(torch.randint(0, n, (1,), generator=g)) for n in self.ranges]
        self.dense_w_I = torch.randn(self.num_dense, generator=g) / math.sqrt(self.num_dense)
        self.feature_salt = [int(x) for x in torch.randint(0, 2**31 - 1, (len(self.rows),), generator=g)]
        # Test-only: one rank's dense features go NaN at this step (the others stay finite).
        self.nan_step = data.inject_nan_at_step if split == "train" and rank == 0 else None

    def _generator(self, step: int) -> torch.Generator:
        key = ((self.seed * 1_000_003 + _SPLITS[self.split]) * 1_000_033 + step) * 4099 + self.rank
        return torch.Generator().manual_seed(key & ((1 << 63) - 1))

    def _power_law_ranks(self, n: int, count: int, g: torch.Generator) -> torch.Tensor:
        """Popularity ranks in [0, n) with P(k) ~ 1/(k+1)^s (continuous inverse CDF)."""
        u = torch.rand(count, generator=g, dtype=torch.float64)
        s = self.zipf
        if s == 0:
            x = u * n + 1
        elif abs(s - 1.0) < 1e-9:
            x = torch.exp(u * math.log(n + 1))
        else:
            a = 1.0 - s
            x = ((math.pow(n + 1, a) - 1.0) * u + 1.0).pow(1.0 / a)
        return (x.floor().long() - 1).clamp_(0, n - 1)

    def _teacher(self, f: int, ids: torch.Tensor) -> torch.Tensor:
        """The hidden per-(feature, id) weight, uniform in [-sqrt 3, sqrt 3] (unit variance)."""
        h = _mix32(ids * 0x9E3779B1 + self.feature_salt[f])
        return (h.double() / float(_MASK32) * 2.0 - 1.0) * math.sqrt(3.0)

    def batch(self, step: int) -> Batch:
        """Batch number `step` of this rank's slice."""
        g = self._generator(step)
        B = self.batch_size
        dense_BI = torch.randn(B, self.num_dense, generator=g)
        values, lengths = [], []
        sparse_logit_B = torch.zeros(B, dtype=torch.float64)
        for f, (n, L) in enumerate(zip(self.ranges, self.multi_hot, strict=True)):
            ranks_BL = self._power_law_ranks(n, B * L, g)
            ids_BL = (ranks_BL * self.mults[f] + self.offsets[f]) % n
            sparse_logit_B += self._teacher(f, ids_BL).view(B, L).mean(dim=1)
            values.append(ids_BL)
            lengths.append(torch.full((B,), L, dtype=torch.int32))
        # Both parts have unit variance; their mean keeps the logit's scale at `signal`.
        dense_logit_B = dense_BI.double() @ self.dense_w_I.double()
        z_B = (sparse_logit_B / math.sqrt(len(self.ranges)) + dense_logit_B) / math.sqrt(2.0)
        p_B = torch.sigmoid(self.signal * z_B - 1.0)
        labels_B = torch.bernoulli(p_B, generator=g).float()
        if step == self.nan_step:
            dense_BI[0, 0] = math.nan
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys, values=torch.cat(values), lengths=torch.cat(lengths)
        )
        return Batch(dense_features=dense_BI, sparse_features=sparse, labels=labels_B)

    def iter_from(self, step: int = 0, num_steps: int | None = None) -> Iterator[Batch]:
        """Batches `step`, `step + 1`, ... (forever when num_steps is None)."""
        i = step
        while num_steps is None or i < step + num_steps:
            yield self.batch(i)
            i += 1
