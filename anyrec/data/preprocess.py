"""`python -m anyrec.data.preprocess`: convert Criteo TSV day files to torchrec's npy layout.

    python -m anyrec.data.preprocess /data/criteo/day_0 /data/criteo/day_1 --out-dir /data/npy

writes `day_0_dense.npy` (float32 log(x+1)), `day_0_sparse.npy` (raw 32-bit ids; training hashes
them modulo the table sizes), `day_0_labels.npy`, ... and prints one JSON line per file with the
row and malformed-row counts. Malformed rows stop the conversion unless `--on-malformed skip`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from anyrec.data.criteo import MALFORMED, read_tsv, write_npy
from anyrec.io_checks import writable_dir


def convert(src: str | Path, out_dir: str | Path, on_malformed: str = "error") -> dict:
    """Convert one TSV file; the npy prefix is the file name without its extension."""
    src = Path(src)
    arrays = read_tsv(src, on_malformed)
    prefix = src.name.split(".")[0]
    write_npy(arrays, out_dir, prefix)
    return {"file": str(src), "prefix": prefix, "rows": len(arrays), "malformed_rows": arrays.malformed_rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m anyrec.data.preprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="Criteo TSV day files")
    parser.add_argument("--out-dir", required=True, help="where the npy files go")
    parser.add_argument("--on-malformed", choices=MALFORMED, default="error",
                        help="error: stop at the first malformed row; skip: count and drop them")
    args = parser.parse_args(argv)
    try:
        writable_dir(args.out_dir, "--out-dir")
        for src in args.inputs:
            print(json.dumps(convert(src, args.out_dir, args.on_malformed)), flush=True)
    except ValueError as e:
        print(f"anyrec-preprocess: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
