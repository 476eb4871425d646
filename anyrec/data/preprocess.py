"""`python -m anyrec.data.preprocess`: convert Criteo TSV day files to torchrec's npy layout.

    python -m anyrec.data.preprocess /data/criteo/day_0.gz /data/criteo/day_1 --out-dir /data/npy

writes `day_0_dense.npy`, `day_0_sparse.npy`, `day_0_labels.npy`, ... exactly as torchrec's
`BinaryCriteoUtils.tsv_to_npys` does for the same file: dense float32 log(x - min + 2) with `min` the file's
smallest dense value, sparse int64 raw ids (training hashes them modulo the table sizes), labels int32 N x 1.
`--dense-transform log1p` writes log(1 + max(x, 0)) instead (not torchrec's). Gzipped days are read as they
are. Streams: a block of rows at a time (memory does not grow with the file; the raw dense values wait
in an unnamed temporary file in --out-dir until the file's minimum is known, as much disk as the dense
output). Prints one JSON line per file with the row and malformed-row counts. Malformed rows stop the
conversion unless `--on-malformed skip` (torchrec has no such check: it would fail or write the bad values).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import numpy as np
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT

from anyrec.data import tsv
from anyrec.data.criteo import DENSE_TRANSFORMS, npy_paths
from anyrec.data.criteo import dense_transform as transform
from anyrec.data.tsv import INT32, MALFORMED, iter_tsv
from anyrec.io_checks import atomic_write, writable_dir


class NpyStream:
    """An .npy file written a block of rows at a time: the bytes `np.save` writes for the whole array. The
    header is written first with 0 rows, then rewritten with the count; numpy pads the header so the row
    count may grow to 21 digits without changing its length."""

    def __init__(self, f: BinaryIO, dtype: type, columns: int) -> None:
        self._f, self._dtype, self._columns, self.rows = f, np.dtype(dtype), columns, 0
        self._header_bytes = self._header()

    def _header(self) -> int:
        self._f.seek(0)
        np.lib.format.write_array_header_1_0(self._f, {"descr": np.lib.format.dtype_to_descr(self._dtype),
                                                       "fortran_order": False,
                                                       "shape": (self.rows, self._columns)})
        return self._f.tell()

    def write(self, block: np.ndarray) -> None:
        self._f.write(np.ascontiguousarray(block, dtype=self._dtype).tobytes())
        self.rows += len(block)

    def close(self) -> None:
        end = self._f.tell()
        assert self._header() == self._header_bytes, "the npy header changed length"
        self._f.seek(end)


def convert(src: str | Path, out_dir: str | Path, on_malformed: str = "error",
            dense_transform: str = "torchrec") -> dict:
    """Convert one TSV file in bounded memory; the npy prefix is the file name without its extension(s).
    Raw dense values wait in an unnamed temporary file until the file's minimum is known."""
    src, out_dir = Path(src), Path(out_dir)
    if dense_transform not in DENSE_TRANSFORMS:
        raise ValueError(f"data.dense_transform must be one of {DENSE_TRANSFORMS}, got {dense_transform!r}")
    prefix = src.name.split(".")[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    dense_p, sparse_p, labels_p = npy_paths(out_dir, prefix)
    lo, hi, bad = INT32[1], INT32[0], 0
    with (tempfile.TemporaryFile(dir=out_dir) as raw, atomic_write(sparse_p, "wb") as f_sparse,
          atomic_write(labels_p, "wb") as f_labels, atomic_write(dense_p, "wb") as f_dense):
        sparse, labels = NpyStream(f_sparse, np.int64, CAT_FEATURE_COUNT), NpyStream(f_labels, np.int32, 1)
        for chunk in iter_tsv(src, on_malformed):
            bad += chunk.malformed_rows
            if len(chunk.labels_n):
                raw.write(chunk.dense_nI.tobytes())
                lo, hi = min(lo, int(chunk.dense_nI.min())), max(hi, int(chunk.dense_nI.max()))
                sparse.write(chunk.sparse_nF)
                labels.write(chunk.labels_n)
        dense = NpyStream(f_dense, np.float32, INT_FEATURE_COUNT)
        raw.seek(0)
        row_bytes = INT_FEATURE_COUNT * 4
        while block := raw.read(row_bytes * (tsv.BLOCK_BYTES // row_bytes)):
            raw_nI = np.frombuffer(block, dtype=np.int32).reshape(-1, INT_FEATURE_COUNT)
            try:
                dense.write(transform(raw_nI, dense_transform, lo, hi))
            except ValueError as e:
                raise ValueError(f"criteo: {src}: {e}") from None
        for stream in (sparse, labels, dense):
            stream.close()
    return {"file": str(src), "prefix": prefix, "rows": labels.rows, "malformed_rows": bad}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m anyrec.data.preprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="Criteo TSV day files (plain or .gz)")
    parser.add_argument("--out-dir", required=True, help="where the npy files go")
    parser.add_argument("--on-malformed", choices=MALFORMED, default="error",
                        help="error: stop at the first malformed row; skip: count and drop them")
    parser.add_argument("--dense-transform", choices=DENSE_TRANSFORMS, default="torchrec",
                        help="torchrec: log(x - min + 2) as tsv_to_npys (default); log1p: log(1 + max(x, 0))")
    args = parser.parse_args(argv)

    def reports() -> Iterable[dict]:
        writable_dir(args.out_dir, "--out-dir")  # before converting anything
        return (convert(src, args.out_dir, args.on_malformed, args.dense_transform) for src in args.inputs)

    return print_reports("anyrec-preprocess", reports)


def print_reports(prog: str, reports: Callable[[], Iterable[dict]]) -> int:
    """A data tool's tail: one JSON line per report; a bad input is one error line and exit code 2."""
    try:
        for report in reports():
            print(json.dumps(report), flush=True)
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
