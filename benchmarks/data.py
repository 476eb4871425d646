"""Data-source throughput: samples/s of each source alone, at DLRMv2 shape (26 features, 214 ids/sample).

    python benchmarks/data.py                          # batch 16384, every available source
    python benchmarks/data.py --batch-size 1024 --batches 2 --json out.json

Rows: synthetic on the CPU, synthetic on the accelerator (when there is one), criteo_npy (one-hot
npy files written to a temporary directory first), criteo_multihot (materialised from those files,
when the source is available in this checkout). Each row times `iter_from` of one rank's source
(what the trainer consumes), after `--warmup` batches; accelerator rows synchronise before the clock
stops. File sources use the DLRMv2 multi-hot sizes with tables capped at `--file-table-rows` rows
(table size only changes the ids' modulo, not the bytes read).
Reported per row: wall-clock samples/s and samples per CPU-second of this process (process_time:
what an unshared core would give a single-threaded source; the machine's load average is printed,
since wall-clock rates on a shared machine fall with it). Prints a table; `--json` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from anyrec.config import DataConfig, ModelConfig
from anyrec.data import SOURCES, build_source

DLRMV2_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
               11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
DLRMV2_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]


def dlrmv2(rows: list[int], one_hot: bool = False) -> ModelConfig:
    """DLRMv2's feature layout (the dense layers do not matter here)."""
    return ModelConfig(name="dlrmv2_data", embedding_dim=128, table_rows=rows,
                       multi_hot=[1] * len(rows) if one_hot else DLRMV2_HOT,
                       bottom_mlp=[512, 256, 128], top_mlp=[1])


def time_source(source, batches: int, warmup: int, sync) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) for `batches` batches after `warmup` untimed ones."""
    it = source.iter_from(0, warmup + batches)
    for _ in range(warmup):
        next(it)
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(batches):
        batch = next(it)
    sync()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert batch.labels.numel() == source.batch_size
    return wall, cpu


def write_one_hot_npy(directory: Path, rows: int, table_rows: list[int]) -> None:
    """A day of torchrec-layout one-hot npy files (random, Criteo-shaped) as `day_0_*.npy`."""
    rng = np.random.default_rng(0)
    np.save(directory / "day_0_dense.npy", rng.random((rows, 13), dtype=np.float32))
    np.save(directory / "day_0_sparse.npy",
            (rng.integers(0, 2**31 - 1, (rows, len(table_rows))) % np.asarray(table_rows)).astype(np.int32))
    np.save(directory / "day_0_labels.npy", rng.integers(0, 2, (rows, 1), dtype=np.int32))


def file_rows(args, work: Path) -> list[tuple[str, object]]:
    """(name, source) for the file-backed sources, their files made under `work`."""
    table_rows = [min(r, args.file_table_rows) for r in DLRMV2_ROWS]
    write_one_hot_npy(work, args.batch_size * args.file_batches, table_rows)
    npy = DataConfig(name="criteo_npy", path=str(work), train_files=["day_0"], batch_size=args.batch_size)
    out = [("criteo_npy", build_source(dlrmv2(table_rows, one_hot=True), npy, 0, 0, 1, "train"))]
    if "criteo_multihot" in SOURCES:
        from anyrec.data.materialize import materialize

        materialize([work / "day_0"], work / "multihot", table_rows, DLRMV2_HOT)
        out.append(("criteo_multihot", build_source(dlrmv2(table_rows), DataConfig(
            name="criteo_multihot", path=str(work / "multihot"), train_files=["day_0"],
            batch_size=args.batch_size), 0, 0, 1, "train")))
    else:
        print("criteo_multihot: not in this checkout's data sources (row skipped)")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument("--batches", type=int, default=5, help="timed batches per source")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--file-batches", type=int, default=4, help="batches of rows in the npy files")
    parser.add_argument("--file-table-rows", type=int, default=100_000, help="table cap for file sources")
    parser.add_argument("--no-files", action="store_true", help="synthetic rows only")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    from anyrec.backends import get_backend

    backend = get_backend("auto")
    data = DataConfig(batch_size=args.batch_size)
    cpu = torch.device("cpu")
    rows: list[tuple[str, object, object]] = [
        ("synthetic cpu", build_source(dlrmv2(DLRMV2_ROWS), data, 0, 0, 1, "train", device=cpu),
         lambda: None)]
    if backend.device_type != "cpu":
        rows.append((f"synthetic {backend.device_type}", build_source(
            dlrmv2(DLRMV2_ROWS), data, 0, 0, 1, "train", device=backend.device(0)), backend.synchronize))
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="anyrec-bench-data-") as work:
        if not args.no_files:
            rows += [(name, src, lambda: None) for name, src in file_rows(args, Path(work))]
        for name, source, sync in rows:
            wall, cpu = time_source(source, args.batches, args.warmup, sync)
            samples = args.batches * args.batch_size
            results[name] = {"samples_per_s": samples / wall, "samples_per_cpu_s": samples / max(cpu, 1e-9)}
            close = getattr(source, "close", None)
            if close is not None:
                close()
    load = os.getloadavg()[0]
    print(f"data sources, DLRMv2 shape ({sum(DLRMV2_HOT)} ids/sample), batch {args.batch_size}, "
          f"{args.batches} batches, {torch.get_num_threads()} threads, load average {load:.1f}")
    print(f"{'source':<20}{'samples/s':>14}{'samples/cpu-s':>16}")
    for name, r in results.items():
        print(f"{name:<20}{r['samples_per_s']:>14,.0f}{r['samples_per_cpu_s']:>16,.0f}")
    out = {"batch_size": args.batch_size, "batches": args.batches, "threads": torch.get_num_threads(),
           "load_average": load, "device": backend.describe(), "sources": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
