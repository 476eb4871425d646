"""Table-batched embedding layout: where each table lives in the flat weight buffer, and id checks.

Table t occupies elements [weight_offsets[t], weight_offsets[t] + rows[t] * dims[t]) of the flat buffer,
row-major, and its rows are numbered globally from row_starts[t] (to dedupe ids across tables). Feature f
reads table feature_table_map[f] and writes output columns [col_offsets[f], col_offsets[f] + dims[table]).
Legend (shape suffixes): T tables, F features, N lookups, B batch size.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from itertools import accumulate

import torch


class BoundsCheckMode(enum.StrEnum):
    """What to do with ids outside [0, rows): raise (default) or skip them (they add nothing)."""

    ERROR = "error"  # checked with torch ops before the kernels run; names the feature and id
    SKIP = "skip"  # no check, no host sync; the kernels mask such lookups out (never an OOB read)

    @classmethod
    def _missing_(cls, value):
        return cls.SKIP if value in ("off", "none") else None  # aliases of the fast path


@dataclass(frozen=True)
class TBELayout:
    """Rows and dims of each table and the feature-to-table map of one table batch."""

    rows: tuple[int, ...]
    dims: tuple[int, ...]
    feature_table_map: tuple[int, ...]
    feature_names: tuple[str, ...] = ()
    weight_offsets: tuple[int, ...] = field(init=False)
    row_starts: tuple[int, ...] = field(init=False)
    col_offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.dims) or not self.rows:
            raise ValueError(f"need one (rows, dim) per table, got rows={self.rows} dims={self.dims}")
        if any(r < 1 for r in self.rows) or any(d < 1 for d in self.dims):
            raise ValueError(f"tables need rows >= 1 and dim >= 1, got rows={self.rows} dims={self.dims}")
        if not self.feature_table_map or any(not 0 <= t < len(self.rows) for t in self.feature_table_map):
            tables = len(self.rows)
            raise ValueError(f"feature_table_map {self.feature_table_map} must name tables 0..{tables - 1}")
        if self.feature_names and len(self.feature_names) != len(self.feature_table_map):
            raise ValueError("feature_names must have one name per feature")
        sizes = (r * d for r, d in zip(self.rows, self.dims, strict=True))
        feature_dims = (self.dims[t] for t in self.feature_table_map)
        object.__setattr__(self, "weight_offsets", tuple(accumulate(sizes, initial=0)))
        object.__setattr__(self, "row_starts", tuple(accumulate(self.rows, initial=0)))
        object.__setattr__(self, "col_offsets", tuple(accumulate(feature_dims, initial=0)))

    @property
    def num_features(self) -> int:
        return len(self.feature_table_map)

    @property
    def total_elements(self) -> int:
        return self.weight_offsets[-1]

    @property
    def total_rows(self) -> int:
        return self.row_starts[-1]

    @property
    def output_dim(self) -> int:
        return self.col_offsets[-1]

    @property
    def max_dim(self) -> int:
        return max(self.dims)

    def permuted(self, order: tuple[int, ...]) -> TBELayout:
        """The same tables with the features arriving in `order` (feature i of the result is feature order[i]
        of this layout); output columns stay where this layout puts them, so such a KJT needs no permute."""
        if sorted(order) != list(range(self.num_features)):
            raise ValueError(f"order {order} is not a permutation of {self.num_features} features")
        out = TBELayout(self.rows, self.dims, tuple(self.feature_table_map[f] for f in order),
                        tuple(self.feature_names[f] for f in order) if self.feature_names else ())
        cols = tuple(self.col_offsets[f] for f in order) + (self.col_offsets[-1],)
        object.__setattr__(out, "col_offsets", cols)
        return out

    @property
    def dim_alignment(self) -> int:
        """Largest power of two (<= 16) dividing every dim: row starts and output columns are multiples of
        it, which lets the kernels issue vector loads (passed as a constexpr hint)."""
        g = 0
        for d in self.dims:
            g = math.gcd(g, d)
        return min(16, g & -g)

    def tensors(self, device: torch.device | str | None = None) -> LayoutTensors:
        """The layout as int64 device tensors, as the kernels read it."""

        def t(v: tuple[int, ...]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64, device=device)

        return LayoutTensors(
            weight_offsets_T=t(self.weight_offsets[:-1]), row_starts_T=t(self.row_starts[:-1]),
            rows_T=t(self.rows), dims_T=t(self.dims), feature_table_map_F=t(self.feature_table_map),
            col_offsets_F=t(self.col_offsets[:-1]))


@dataclass(frozen=True)
class LayoutTensors:
    """Device copies of a `TBELayout` (all int64)."""

    weight_offsets_T: torch.Tensor
    row_starts_T: torch.Tensor
    rows_T: torch.Tensor
    dims_T: torch.Tensor
    feature_table_map_F: torch.Tensor
    col_offsets_F: torch.Tensor


def batch_size(layout: TBELayout, offsets_FB1: torch.Tensor) -> int:
    """B from a KJT offsets vector of F*B+1 entries; raises when the length does not fit."""
    n_bags = offsets_FB1.numel() - 1
    if n_bags < 0 or n_bags % layout.num_features:
        raise ValueError(f"offsets has {n_bags + 1} entries; expected F*B+1 with F={layout.num_features}")
    return n_bags // layout.num_features


def lookup_tables_N(lt: LayoutTensors, offsets_FB1: torch.Tensor, B: int, n: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per lookup: its bag index (f*B+b) and the table it reads."""
    lengths_FB = (offsets_FB1[1:] - offsets_FB1[:-1]).long()
    bag_N = torch.repeat_interleave(torch.arange(lengths_FB.numel(), device=offsets_FB1.device), lengths_FB,
                                    output_size=n)
    return bag_N, lt.feature_table_map_F[bag_N // max(B, 1)]


def check_ids(layout: TBELayout, lt: LayoutTensors, indices_N: torch.Tensor, offsets_FB1: torch.Tensor,
              B: int) -> None:
    """Raise ValueError naming the feature and the id of the first id outside its table."""
    n = indices_N.numel()
    if offsets_FB1.numel() and (int(offsets_FB1[0]) != 0 or int(offsets_FB1[-1]) != n):
        raise ValueError(f"offsets must start at 0 and end at len(indices)={n}")
    if n == 0:
        return
    bag_N, table_N = lookup_tables_N(lt, offsets_FB1, B, n)
    ids_N = indices_N.long()
    bad_N = (ids_N < 0) | (ids_N >= lt.rows_T[table_N])
    if bool(bad_N.any()):
        i = int(bad_N.nonzero()[0, 0])
        f, b = divmod(int(bag_N[i]), B)
        t = layout.feature_table_map[f]
        name = layout.feature_names[f] if layout.feature_names else f"feature {f}"
        raise ValueError(
            f"{name} (table {t}, {layout.rows[t]} rows): id {int(ids_N[i])} at "
            f"sample {b} is out of range [0, {layout.rows[t]}) ({int(bad_N.sum())} bad ids in the batch)"
        )
