"""`python -m anyrec.data.preprocess`: convert Criteo TSV day files to torchrec's npy layout.

    python -m anyrec.data.preprocess /data/criteo/day_0.gz /data/criteo/day_1 --out-dir /data/npy

writes `day_0_dense.npy`, `day_0_sparse.npy`, `day_0_labels.npy`, ... exactly as torchrec's
`BinaryCriteoUtils.tsv_to_npys` does for the same file: dense float32 log(x - min + 2) with `min` the file's
smallest dense value, sparse int64 raw ids (training hashes them modulo the table sizes), labels int32 N x 1.
`--dense-transform log1p` writes log(1 + max(x, 0)) instead (not torchrec's). Gzipped days are read as they
are. Prints one JSON line per file with the row and malformed-row counts. Malformed rows stop the conversion
unless `--on-malformed skip` (torchrec has no such check: it would fail or write the bad values).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from anyrec.data.criteo import DENSE_TRANSFORMS, MALFORMED, read_tsv, write_npy
from anyrec.io_checks import writable_dir


def convert(src: str | Path, out_dir: str | Path, on_malformed: str = "error",
            dense_transform: str = "torchrec") -> dict:
    """Convert one TSV file; the npy prefix is the file name without its extension(s)."""
    src = Path(src)
    arrays = read_tsv(src, on_malformed, dense_transform)
    prefix = src.name.split(".")[0]
    write_npy(arrays, out_dir, prefix)
    return {"file": str(src), "prefix": prefix, "rows": len(arrays), "malformed_rows": arrays.malformed_rows}


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
