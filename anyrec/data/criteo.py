"""Criteo click logs: the raw TSV day files and torchrec's preprocessed npy layout.

TSV rows are `label \\t 13 integer dense \\t 26 hex categorical` (empty = missing = 0). The npy
layout is the one `torchrec.datasets.criteo.BinaryCriteoUtils` writes and
`InMemoryBinaryCriteoIterDataPipe` reads: `<prefix>_dense.npy` (float32, N x 13, already
log-transformed), `<prefix>_sparse.npy` (raw ids, N x 26), `<prefix>_labels.npy` (int32, N x 1).
Ids are hashed modulo each table's size when batches are made (as torchrec does with `hashes`).

Batch `step` of rank `r` is global batch `step * world_size + r`: rows `[g * B, (g + 1) * B)`
modulo the dataset size, so every rank reads its own deterministic slice, a resume at step n sees
exactly the batches an uninterrupted run would, and a run longer than the data wraps around.
Legend: N rows, B batch per rank, I dense features (13), F sparse features (26).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT, BinaryCriteoUtils
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec.config import DataConfig, ModelConfig
from anyrec.schema import feature_names

logger = logging.getLogger(__name__)

NUM_FIELDS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
MALFORMED = ("error", "skip")


@dataclass
class CriteoArrays:
    """One file's rows: dense (log1p, float32), raw sparse ids (int64) and labels (int32)."""

    dense_NI: np.ndarray
    sparse_NF: np.ndarray
    labels_N1: np.ndarray
    malformed_rows: int = 0

    def __len__(self) -> int:
        return len(self.labels_N1)


def _parse_row(fields: list[str]) -> tuple[list[int], list[int], int]:
    """(dense, sparse, label) of one split TSV row; ValueError says what is wrong with it."""
    if len(fields) != NUM_FIELDS:
        raise ValueError(f"expected {NUM_FIELDS} tab-separated fields, got {len(fields)}")
    label = fields[0]
    if label not in ("0", "1"):
        raise ValueError(f"label must be 0 or 1, got {label!r}")
    try:
        dense = [int(x) if x else 0 for x in fields[1:1 + INT_FEATURE_COUNT]]
    except ValueError as e:
        raise ValueError(f"non-integer dense feature ({e})") from None
    try:
        sparse = [int(x, 16) if x else 0 for x in fields[1 + INT_FEATURE_COUNT:]]
    except ValueError as e:
        raise ValueError(f"non-hex categorical feature ({e})") from None
    return dense, sparse, int(label)


def dense_transform(dense: np.ndarray) -> np.ndarray:
    """DLRM's dense preprocessing: negatives to 0, then log(x + 1), as float32."""
    return np.log1p(np.maximum(dense, 0).astype(np.float64)).astype(np.float32)


def read_tsv(path: str | Path, on_malformed: str = "error") -> CriteoArrays:
    """Parse a Criteo TSV file. Malformed rows raise ValueError (`error`) or are counted (`skip`)."""
    if on_malformed not in MALFORMED:
        raise ValueError(f"data.on_malformed must be one of {MALFORMED}, got {on_malformed!r}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"criteo: no such TSV file {path}")
    dense, sparse, labels = [], [], []
    bad = 0
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\n").rstrip("\r")
            if not line:
                continue
            try:
                d, s, y = _parse_row(line.split("\t"))
            except ValueError as e:
                if on_malformed == "error":
                    raise ValueError(f"criteo: {path} line {lineno}: malformed row: {e} "
                                     "(set data.on_malformed=skip to count and skip such rows)") from None
                bad += 1
                continue
            dense.append(d)
            sparse.append(s)
            labels.append(y)
    if bad:
        logger.warning("criteo: %s: skipped %d malformed rows of %d", path, bad, bad + len(labels))
    if not labels:
        raise ValueError(f"criteo: {path} has no valid rows")
    return CriteoArrays(
        dense_NI=dense_transform(np.asarray(dense, dtype=np.int64)),
        sparse_NF=np.asarray(sparse, dtype=np.int64),
        labels_N1=np.asarray(labels, dtype=np.int32).reshape(-1, 1),
        malformed_rows=bad,
    )


def npy_paths(directory: str | Path, prefix: str) -> tuple[Path, Path, Path]:
    """The (dense, sparse, labels) files of one preprocessed day."""
    d = Path(directory)
    return d / f"{prefix}_dense.npy", d / f"{prefix}_sparse.npy", d / f"{prefix}_labels.npy"


def write_npy(arrays: CriteoArrays, directory: str | Path, prefix: str) -> None:
    """Save in torchrec's layout (readable by `InMemoryBinaryCriteoIterDataPipe` as well)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    for p, arr in zip(npy_paths(directory, prefix), (arrays.dense_NI, arrays.sparse_NF, arrays.labels_N1),
                      strict=True):
        np.save(p, arr)


def read_npy(directory: str | Path, prefix: str) -> CriteoArrays:
    """Memory-map one preprocessed day (rows are read only when a batch needs them)."""
    paths = npy_paths(directory, prefix)
    for p in paths:
        if not p.is_file():
            raise ValueError(f"criteo: missing {p} (make it with `python -m anyrec.data.preprocess`)")
    rows = {BinaryCriteoUtils.get_shape_from_npy(str(p))[0] for p in paths}
    if len(rows) != 1:
        raise ValueError(f"criteo: {directory}/{prefix}_*.npy disagree on the number of rows: {sorted(rows)}")
    dense, sparse, labels = (np.load(p, mmap_mode="r") for p in paths)
    if dense.ndim != 2 or sparse.ndim != 2:
        raise ValueError(f"criteo: {directory}/{prefix}: dense and sparse arrays must be 2-D")
    return CriteoArrays(dense, sparse, labels.reshape(len(labels), -1))


class CriteoSource:
    """Batches of Criteo rows for one rank; `batch(step)` is a pure function of (step, rank)."""

    def __init__(self, model: ModelConfig, data: DataConfig, rank: int = 0, world_size: int = 1,
                 split: str = "train") -> None:
        if data.name not in ("criteo_tsv", "criteo_npy"):
            raise ValueError(f"CriteoSource reads criteo_tsv or criteo_npy, not {data.name!r}")
        if not data.path:
            raise ValueError(f"data={data.name} needs data.path (the directory holding the files)")
        if data.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {data.batch_size}")
        files = list(data.eval_files if split == "eval" and data.eval_files else data.train_files)
        if not files:
            raise ValueError(f"data={data.name} needs data.train_files")
        if split == "eval" and not data.eval_files:
            logger.warning("criteo: data.eval_files is empty: evaluating on the training files")
        if data.name == "criteo_tsv":
            parts = [read_tsv(self._tsv_path(data.path, f), data.on_malformed) for f in files]
        else:
            parts = [read_npy(data.path, f) for f in files]
        self.parts = parts
        self.malformed_rows = sum(p.malformed_rows for p in parts)
        self.cum_rows = np.cumsum([0] + [len(p) for p in parts])
        self.num_rows = int(self.cum_rows[-1])
        num_sparse = parts[0].sparse_NF.shape[1]
        self.keys = feature_names(num_sparse)
        rows = list(model.table_rows)
        # Hash with the model's table sizes; a feature-count mismatch is left to input validation.
        self.modulo = (np.asarray(rows, dtype=np.int64).reshape(1, -1)
                       if data.hash_ids and len(rows) == num_sparse else None)
        self.batch_size = data.batch_size
        self.rank, self.world_size = rank, world_size

    @staticmethod
    def _tsv_path(directory: str, name: str) -> Path:
        p = Path(directory) / name
        return p if p.exists() or p.suffix else next(
            (q for q in (p.with_suffix(".tsv"), p.with_suffix(".txt")) if q.exists()), p)

    @property
    def batches_per_epoch(self) -> int:
        """Global steps until every row has been read once (all ranks together)."""
        return math.ceil(self.num_rows / (self.batch_size * self.world_size))

    def _rows(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`count` rows from global row `start` on (mod N), as contiguous slices of the files."""
        pieces: list[list[np.ndarray]] = [[], [], []]
        pos, left = start % self.num_rows, count
        while left > 0:
            p = int(np.searchsorted(self.cum_rows, pos, side="right")) - 1
            part, lo = self.parts[p], pos - int(self.cum_rows[p])
            n = min(left, len(part) - lo)
            for out, arr in zip(pieces, (part.dense_NI, part.sparse_NF, part.labels_N1), strict=True):
                out.append(np.asarray(arr[lo:lo + n]))
            pos, left = (pos + n) % self.num_rows, left - n
        dense, sparse, labels = (np.concatenate(x) if len(x) > 1 else x[0] for x in pieces)
        return dense, sparse, labels

    def batch(self, step: int) -> Batch:
        """Batch number `step` of this rank's slice."""
        g = step * self.world_size + self.rank
        B = self.batch_size
        dense, sparse, labels = self._rows(g * B, B)
        sparse = sparse.astype(np.int64, copy=False)
        if self.modulo is not None:
            sparse = sparse % self.modulo
        F = sparse.shape[1]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys,
            values=torch.from_numpy(np.ascontiguousarray(sparse.T).reshape(-1)),
            lengths=torch.ones(F * B, dtype=torch.int32),
        )
        return Batch(dense_features=torch.from_numpy(np.array(dense, dtype=np.float32)),
                     sparse_features=kjt,
                     labels=torch.from_numpy(np.asarray(labels, dtype=np.float32).reshape(-1)))

    def iter_from(self, step: int = 0, num_steps: int | None = None) -> Iterator[Batch]:
        """Batches `step`, `step + 1`, ... (forever when num_steps is None)."""
        i = step
        while num_steps is None or i < step + num_steps:
            yield self.batch(i)
            i += 1
