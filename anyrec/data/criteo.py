"""Criteo click logs: the raw TSV day files and torchrec's preprocessed npy layout.

TSV rows are `label \\t 13 integer dense \\t 26 hex categorical` (empty = missing = 0); `.gz` days (as
Criteo ships them) are read transparently. The npy layout is the one
`torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys` writes and `InMemoryBinaryCriteoIterDataPipe`
reads: `<prefix>_dense.npy` (float32, N x 13, already transformed), `<prefix>_sparse.npy` (raw ids,
int64, N x 26), `<prefix>_labels.npy` (int32, N x 1). Dense values follow torchrec's rule, log(x - min +
2) with `min` the smallest dense value of the whole file (see `dense_transform`). Ids are hashed modulo
each table's size when batches are made (as torchrec does with `hashes`).

Every file is checked where it is read, and errors name the file and the line (TSV, from 1) or row (npy,
from 0): labels in {0, 1}, finite dense values, integer ids that fit 64 bits (and, without hashing, fall
in their table), dense integers that fit torchrec's int32, shapes and dtypes.

Batch `step` of rank `r` is global batch `g = step * world_size + r`: rows `[g * B, (g + 1) * B)` modulo
the dataset size, so every rank reads its own deterministic slice, a resume at step n sees exactly the
batches an uninterrupted run would, and a run longer than the data wraps around.
Legend: N rows, B batch per rank, I dense features (13), F sparse features (26), L ids per sample.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec.config import DataConfig, ModelConfig
from anyrec.data.arrays import check_ids_dtype, check_layout, load_npy
from anyrec.data.multihot import MultiHotArrays, read_multihot
from anyrec.data.tsv import INT32, iter_tsv
from anyrec.io_checks import atomic_write
from anyrec.schema import feature_names

logger = logging.getLogger(__name__)

# torchrec: log(x - min + 2) with the file's min; log1p: log(1 + max(x, 0)) (the DLRM scripts' rule).
DENSE_TRANSFORMS = ("torchrec", "log1p")
FILE_SOURCES = ("criteo_tsv", "criteo_npy", "criteo_multihot")


class BadRowError(ValueError):
    """A bad value where one rank read it (file and row named). Only that rank knows: its peers are
    inside a collective, so the entry point exits at once (`rank_local`) rather than wait for them."""

    rank_local = True


@dataclass
class CriteoArrays:
    """One file's rows: dense (transformed, float32), raw sparse ids (int64) and labels (int32). Like
    `MultiHotArrays`, it names its day (`source`) and its (dense, sparse, labels) files (`files`) in
    errors, and reads memory-mapped rows lazily."""

    dense_NI: np.ndarray
    sparse_NF: np.ndarray
    labels_N1: np.ndarray
    malformed_rows: int = 0
    source: str = ""
    files: tuple[str, str, str] = ("", "", "")

    def __len__(self) -> int:
        return len(self.labels_N1)

    def hot_sizes(self) -> list[int]:
        """One id per sample for every feature."""
        return [1] * self.sparse_NF.shape[1]

    def sparse_rows(self, lo: int, n: int) -> list[np.ndarray]:
        """Rows [lo, lo + n) as one [n, 1] array per feature."""
        block = np.asarray(self.sparse_NF[lo:lo + n])
        return [block[:, f:f + 1] for f in range(block.shape[1])]


# ---- TSV ---------------------------------------------------------------------------------------------


def dense_transform(dense_NI: np.ndarray, rule: str = "torchrec", lo: int | None = None,
                    hi: int | None = None) -> np.ndarray:
    """Raw dense integers to model inputs, as float32. `torchrec` is `BinaryCriteoUtils.tsv_to_npys`: subtract
    (min over the file) - 2 from every value, then log in float32, so the smallest value maps to log 2 and a
    file's transform depends on its own minimum: `lo`/`hi` are the file's extremes when `dense_NI` is part of
    it (default: its own). `log1p` is log(1 + max(x, 0)) per value (the older DLRM rule)."""
    if rule == "log1p":
        return np.log1p(np.maximum(dense_NI, 0).astype(np.float64)).astype(np.float32)
    if rule != "torchrec":
        raise ValueError(f"data.dense_transform must be one of {DENSE_TRANSFORMS}, got {rule!r}")
    if dense_NI.size == 0:
        return np.zeros(dense_NI.shape, dtype=np.float32)
    lo = int(dense_NI.min()) if lo is None else lo
    hi = int(dense_NI.max()) if hi is None else hi
    if hi - (lo - 2) > INT32[1]:
        # torchrec does this subtraction in int32, where it would wrap to negative numbers (NaN logs).
        raise ValueError(f"dense values span {lo}..{hi}: x - min + 2 overflows torchrec's int32 "
                         "(use data.dense_transform=log1p)")
    shifted = np.asarray(dense_NI, dtype=np.int64) - (lo - 2)
    return np.log(shifted.astype(np.int32), dtype=np.float32)


def read_tsv(path: str | Path, on_malformed: str = "error", transform: str = "torchrec") -> CriteoArrays:
    """Parse a Criteo TSV file (plain or gzipped). Malformed rows raise ValueError (`error`) or are
    counted (`skip`)."""
    if transform not in DENSE_TRANSFORMS:
        raise ValueError(f"data.dense_transform must be one of {DENSE_TRANSFORMS}, got {transform!r}")
    path = Path(path)
    chunks = list(iter_tsv(path, on_malformed))
    bad = sum(c.malformed_rows for c in chunks)
    try:
        dense_NI = dense_transform(np.concatenate([c.dense_nI for c in chunks]), transform)
    except ValueError as e:
        raise ValueError(f"criteo: {path}: {e}") from None
    labels_N1 = np.concatenate([c.labels_n for c in chunks]).reshape(-1, 1)
    sparse_NF = np.concatenate([c.sparse_nF for c in chunks])
    return CriteoArrays(dense_NI, sparse_NF, labels_N1, malformed_rows=bad, source=str(path),
                        files=(str(path),) * 3)


def tsv_path(directory: str | Path, name: str) -> Path:
    """`directory/name`, or with the first of .tsv, .txt, .gz, .tsv.gz that exists when name has none."""
    p = Path(directory) / name
    if p.exists() or p.suffix:
        return p
    return next((q for q in (p.with_name(p.name + s) for s in (".tsv", ".txt", ".gz", ".tsv.gz"))
                 if q.exists()), p)


# ---- npy ---------------------------------------------------------------------------------------------


def npy_paths(directory: str | Path, prefix: str) -> tuple[Path, Path, Path]:
    """The (dense, sparse, labels) files of one preprocessed day."""
    d = Path(directory)
    return d / f"{prefix}_dense.npy", d / f"{prefix}_sparse.npy", d / f"{prefix}_labels.npy"


def write_npy(arrays: CriteoArrays, directory: str | Path, prefix: str) -> None:
    """Save in torchrec's layout (readable by `InMemoryBinaryCriteoIterDataPipe` as well); each
    file appears whole or not at all."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    for p, arr in zip(npy_paths(directory, prefix), (arrays.dense_NI, arrays.sparse_NF, arrays.labels_N1),
                      strict=True):
        with atomic_write(p, "wb") as f:
            np.save(f, arr)


def read_npy(directory: str | Path, prefix: str) -> CriteoArrays:
    """Memory-map one preprocessed day (rows are read only when a batch needs them)."""
    dense_p, sparse_p, labels_p = npy_paths(directory, prefix)
    dense, sparse, labels = (load_npy(p) for p in (dense_p, sparse_p, labels_p))
    labels = check_layout(dense_p, dense, labels_p, labels)
    if sparse.ndim != 2:
        raise ValueError(f"criteo: {sparse_p} must be 2-D (rows x sparse features), has shape {sparse.shape}")
    check_ids_dtype(sparse_p, sparse)
    if len(sparse) != len(dense):
        raise ValueError(f"criteo: {sparse_p} has {len(sparse)} rows, {dense_p} has {len(dense)}")
    return CriteoArrays(dense, sparse, labels, source=str(Path(directory) / f"{prefix}_*.npy"),
                        files=(str(dense_p), str(sparse_p), str(labels_p)))


# ---- batches -----------------------------------------------------------------------------------------


def check_rows(files: tuple[str, str, str], lo: int, dense_nI: np.ndarray, labels_n: np.ndarray,
               ids: list[np.ndarray], table_rows: list[int] | None, finite_dense: bool = True) -> None:
    """Raise BadRowError naming the (dense, sparse, labels) file and row (lo + i) of the first bad value.

    `finite_dense=False` (trainer.skip_nonfinite on the training split) lets NaN/inf dense values through: the
    trainer skips the step whose loss they make non-finite."""
    bad = np.flatnonzero((labels_n != 0) & (labels_n != 1))
    if bad.size:
        i = int(bad[0])
        raise BadRowError(f"criteo: {files[2]} row {lo + i}: label {labels_n[i].item()} is not 0 or 1")
    finite = np.isfinite(dense_nI) if finite_dense else True
    if not np.all(finite):
        i, j = (int(x) for x in np.argwhere(~finite)[0])
        raise BadRowError(f"criteo: {files[0]} row {lo + i}: dense feature {j} is {dense_nI[i, j]}")
    if table_rows is None:
        return
    for f, (ids_nL, rows) in enumerate(zip(ids, table_rows, strict=True)):
        wrong = (ids_nL < 0) | (ids_nL >= rows)
        if wrong.any():
            i, k = (int(x) for x in np.argwhere(wrong)[0])
            raise BadRowError(f"criteo: {files[1]} row {lo + i}: feature {f} id {ids_nL[i, k]} is "
                              f"outside its table [0, {rows}) (data.hash_ids=false)")


def _hash(ids: np.ndarray, rows: int) -> np.ndarray:
    """ids mod rows (torchrec's `hashes`), skipped when every id is already in range: a min and a
    max cost a fraction of a modulo, and materialised multi-hot ids are in range by construction."""
    if ids.size == 0 or (int(ids.min()) >= 0 and int(ids.max()) < rows):
        return ids
    if rows > np.iinfo(ids.dtype).max:
        ids = ids.astype(np.int64)
    return ids % rows


class CriteoSource:
    """Batches of Criteo rows for one rank; `batch(step)` is a pure function of (step, rank)."""

    def __init__(self, model: ModelConfig, data: DataConfig, rank: int = 0, world_size: int = 1,
                 split: str = "train", skip_nonfinite: bool = False) -> None:
        if data.name not in FILE_SOURCES:
            raise ValueError(f"CriteoSource reads {', '.join(FILE_SOURCES)}, not {data.name!r}")
        if not data.path:
            raise ValueError(f"data={data.name} needs data.path (the directory holding the files)")
        files = list(data.eval_files if split == "eval" and data.eval_files else data.train_files)
        if not files:
            raise ValueError(f"data={data.name} needs data.train_files")
        if split == "eval" and not data.eval_files:
            logger.warning("criteo: data.eval_files is empty: evaluating on the training files")
        parts: list[CriteoArrays] | list[MultiHotArrays]
        if data.name == "criteo_tsv":
            parts = [read_tsv(tsv_path(data.path, f), data.on_malformed, data.dense_transform) for f in files]
        elif data.name == "criteo_npy":
            parts = [read_npy(data.path, f) for f in files]
        else:
            parts = [read_multihot(data.path, f) for f in files]
        self.parts = parts
        self.malformed_rows = sum(getattr(p, "malformed_rows", 0) for p in parts)
        self.cum_rows = np.cumsum([0] + [len(p) for p in parts])
        self.num_rows = int(self.cum_rows[-1])
        self.hot = parts[0].hot_sizes()
        for p in parts[1:]:
            if p.hot_sizes() != self.hot:
                raise ValueError(f"criteo: {p.source} has ids per feature {p.hot_sizes()}, "
                                 f"{parts[0].source} has {self.hot}")
            if p.dense_NI.shape[1] != parts[0].dense_NI.shape[1]:
                raise ValueError(f"criteo: {p.source} has {p.dense_NI.shape[1]} dense features, "
                                 f"{parts[0].source} has {parts[0].dense_NI.shape[1]}")
        if model.multi_hot and list(model.multi_hot) != self.hot:
            # Training works either way; only the planner's pooling estimates assume model.multi_hot.
            logger.warning("criteo: %s has %s ids per sample per feature, model.multi_hot says %s "
                           "(the sharding plan assumes the latter)", parts[0].source, self.hot,
                           list(model.multi_hot))
        self.keys = feature_names(len(self.hot))
        rows = list(model.table_rows)
        # Hash with the model's table sizes; a feature-count mismatch is left to input validation.
        matches = len(rows) == len(self.hot)
        self.modulo = rows if data.hash_ids and matches else None
        self.checked_rows = rows if not data.hash_ids and matches else None
        self.batch_size = data.batch_size
        self.rank, self.world_size = rank, world_size
        self.skip_nonfinite = skip_nonfinite and split == "train"  # see check_rows
        B = self.batch_size
        self._lengths = torch.cat([torch.full((B,), L, dtype=torch.int32) for L in self.hot])
        self._length_per_key = [B * L for L in self.hot]

    def _rows(self, start: int, count: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """`count` rows from global row `start` on (mod N), as contiguous slices of the files, each
        checked as it is read."""
        dense_p, labels_p, sparse_p = [], [], []
        pos, left = start % self.num_rows, count
        while left > 0:
            p = int(np.searchsorted(self.cum_rows, pos, side="right")) - 1
            part, lo = self.parts[p], pos - int(self.cum_rows[p])
            n = min(left, len(part) - lo)
            dense = np.asarray(part.dense_NI[lo:lo + n])
            labels = np.asarray(part.labels_N1[lo:lo + n]).reshape(-1)
            ids = part.sparse_rows(lo, n)
            check_rows(part.files, lo, dense, labels, ids, self.checked_rows, not self.skip_nonfinite)
            dense_p.append(dense)
            labels_p.append(labels)
            sparse_p.append(ids)
            pos, left = (pos + n) % self.num_rows, left - n
        if len(dense_p) == 1:
            return dense_p[0], sparse_p[0], labels_p[0]
        return (np.concatenate(dense_p), [np.concatenate(f) for f in zip(*sparse_p, strict=True)],
                np.concatenate(labels_p))

    def batch(self, step: int) -> Batch:
        """Batch number `step` of this rank's slice."""
        g = step * self.world_size + self.rank
        B = self.batch_size
        dense, ids, labels = self._rows(g * B, B)
        values = [ids_BL.reshape(-1) for ids_BL in ids]
        if self.modulo is not None:
            values = [_hash(v, rows) for v, rows in zip(values, self.modulo, strict=True)]
        values_N = np.concatenate(values, dtype=np.int64, casting="same_kind")
        kjt = KeyedJaggedTensor(keys=self.keys, values=torch.from_numpy(values_N),
                                lengths=self._lengths.clone(), stride=B,
                                length_per_key=list(self._length_per_key))
        return Batch(dense_features=torch.from_numpy(np.array(dense, dtype=np.float32)), sparse_features=kjt,
                     labels=torch.from_numpy(labels.astype(np.float32)))

    def iter_from(self, step: int = 0, num_steps: int | None = None) -> Iterator[Batch]:
        """Batches `step`, `step + 1`, ... (forever when num_steps is None)."""
        return map(self.batch, itertools.count(step) if num_steps is None else range(step, step + num_steps))
