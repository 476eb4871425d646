"""`python -m anyrec.data.materialize`: MLPerf DLRMv2's synthetic multi-hot Criteo from one-hot npy.

    python -m anyrec.data.materialize /data/npy/day_0 /data/npy/day_1 --out-dir /data/multihot

reads `day_0_sparse.npy` (torchrec's one-hot layout, N x 26 ids) and writes `day_0_sparse_multi_hot.npz`
(member `f.npy`: int32 [N, L_f]) beside copies of `day_0_dense.npy` and `day_0_labels.npy`, the layout
`data=criteo_multihot` reads. Table sizes and ids per feature come from `--model` (default dlrmv2) or are
given explicitly. Prints one JSON line per day.

The rule is the MLPerf reference's `materialize_synthetic_multihot_dataset.py` with
`--multi_hot_distribution_type uniform` (its `Multihot` class): seed numpy's legacy global generator with
0; for each feature f in order draw a lookup table whose row r is [r, then L_f - 1 ids drawn by
`np.random.randint(0, E_f)`] (E_f the table's rows); then sample n's ids of feature f are row
(one_hot[n, f] mod E_f) of that table, as int32.

Bit-identical to the reference (every array's values, dtype and shape, given the same one-hot input,
table sizes and multi-hot sizes): the tables are drawn from the same generator (RandomState(0)) with the
same calls in the same order; drawing a table in row chunks yields the same stream (each legacy bounded
draw consumes whole 32-bit words; checked by the tests), which keeps memory bounded where the reference
holds every table (~32 GB at DLRMv2 sizes) in RAM: the tables go to a temporary directory under
--out-dir instead (~24 GB of disk at DLRMv2 sizes), removed at the end.
Not identical: the npz container bytes (zip timestamps; the reference's np.savez also writes its members
in one piece), the dense/label copies are made always (the reference only with `--copy_labels_and_dense`),
days are named by the inputs rather than `day_0..day_23`, and only `uniform` is offered (not `pareto`).
Legend: N rows, E rows of a table, L ids per sample of one feature.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from anyrec.config import config_dir
from anyrec.data.arrays import check_ids_dtype, load_npy
from anyrec.data.criteo import npy_paths
from anyrec.data.multihot import multihot_paths, write_npz_members
from anyrec.data.preprocess import print_reports
from anyrec.io_checks import atomic_write

DISTRIBUTIONS = ("uniform",)
SEED = 0  # the reference's np.random.seed(0)
_TABLE_CHUNK_ELEMS = 1 << 24  # random ids drawn per call while building a table (bounds memory)
_ROW_CHUNK_ELEMS = 1 << 24  # output ids gathered per chunk of samples


def lookup_tables(table_rows: list[int], hot_sizes: list[int], work_dir: Path,
                  chunk_elems: int = _TABLE_CHUNK_ELEMS) -> list[np.ndarray]:
    """The reference's one-hot -> multi-hot tables ([E_f, L_f] int32), in files under work_dir."""
    if len(table_rows) != len(hot_sizes):
        raise ValueError(f"{len(table_rows)} table sizes but {len(hot_sizes)} multi-hot sizes")
    if min(table_rows, default=1) < 1 or min(hot_sizes, default=1) < 1:
        raise ValueError("table sizes and multi-hot sizes must be >= 1")
    rs = np.random.RandomState(SEED)
    tables = []
    for f, (E, L) in enumerate(zip(table_rows, hot_sizes, strict=True)):
        table_EL = np.lib.format.open_memmap(work_dir / f"table_{f}.npy", mode="w+", dtype=np.int32,
                                             shape=(E, L))
        step = max(1, chunk_elems // max(1, L - 1))
        for lo in range(0, E, step):
            hi = min(E, lo + step)
            table_EL[lo:hi, 0] = np.arange(lo, hi)
            # int64 draws as the reference makes them (same stream), stored as int32 like its .int().
            table_EL[lo:hi, 1:] = rs.randint(0, E, size=(hi - lo, L - 1))
        table_EL.flush()
        tables.append(table_EL)
    return tables


def materialize_day(prefix: Path, out_dir: Path, tables: list[np.ndarray], table_rows: list[int],
                    chunk_elems: int = _ROW_CHUNK_ELEMS) -> dict:
    """Write one day's multi-hot npz (and copy its dense and label files) into out_dir."""
    dense_p, sparse_p, labels_p = npy_paths(prefix.parent, prefix.name)
    one_hot_NF = load_npy(sparse_p)
    check_ids_dtype(sparse_p, one_hot_NF)
    if one_hot_NF.ndim != 2 or one_hot_NF.shape[1] != len(tables):
        raise ValueError(f"criteo: {sparse_p} has shape {one_hot_NF.shape}, expected (rows, {len(tables)}) "
                         "(one column per table)")
    N = len(one_hot_NF)
    out_dense, out_sparse, out_labels = multihot_paths(out_dir, prefix.name)
    for src in (dense_p, labels_p):
        load_npy(src)  # readable, before anything is written

    def member(f: int):
        table_EL, E = tables[f], table_rows[f]
        step = max(1, chunk_elems // table_EL.shape[1])
        for lo in range(0, N, step):
            ids_n = np.asarray(one_hot_NF[lo:lo + step, f]) % E
            yield table_EL[ids_n]

    write_npz_members(out_sparse, (((N, t.shape[1]), np.int32, member(f)) for f, t in enumerate(tables)))
    for src, dst in ((dense_p, out_dense), (labels_p, out_labels)):
        if src.resolve() != dst.resolve():
            with src.open("rb") as f_in, atomic_write(dst, "wb") as f_out:
                shutil.copyfileobj(f_in, f_out)
    return {"prefix": prefix.name, "rows": N, "out": str(out_sparse),
            "ids_per_sample": int(sum(t.shape[1] for t in tables))}


def materialize(inputs: list[str | Path], out_dir: str | Path, table_rows: list[int], hot_sizes: list[int],
                distribution: str = "uniform") -> list[dict]:
    """Materialise every one-hot day `inputs` (npy prefixes) into out_dir; one report per day."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"multi-hot distribution {distribution!r} is not offered; "
                         f"choose one of {DISTRIBUTIONS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".tables-") as work:
        tables = lookup_tables(table_rows, hot_sizes, Path(work))
        reports = [materialize_day(Path(p), out_dir, tables, table_rows) for p in inputs]
        del tables
    return reports


def _model_sizes(name: str) -> tuple[list[int], list[int]]:
    path = config_dir() / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"no model config {path}")
    cfg = OmegaConf.load(path)
    return list(cfg.table_rows), list(cfg.get("multi_hot") or [])


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m anyrec.data.materialize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="one-hot npy day prefixes, e.g. /data/npy/day_0")
    parser.add_argument("--out-dir", required=True, help="where the multi-hot layout goes")
    parser.add_argument("--model", default="dlrmv2", help="model config giving table rows and multi_hot")
    parser.add_argument("--num-embeddings-per-feature", type=_int_list, default=None,
                        help="comma-separated table rows (overrides --model)")
    parser.add_argument("--multi-hot-sizes", type=_int_list, default=None,
                        help="comma-separated ids per sample per feature (overrides --model)")
    parser.add_argument("--multi-hot-distribution-type", choices=DISTRIBUTIONS, default="uniform")
    args = parser.parse_args(argv)

    def reports() -> list[dict]:
        rows, hot = (None, None)
        if args.num_embeddings_per_feature is None or args.multi_hot_sizes is None:
            rows, hot = _model_sizes(args.model)
        rows = args.num_embeddings_per_feature or rows
        hot = args.multi_hot_sizes or hot or [1] * len(rows)
        return materialize(args.inputs, args.out_dir, rows, hot, args.multi_hot_distribution_type)

    return print_reports("anyrec-materialize", reports)


if __name__ == "__main__":
    sys.exit(main())
