"""MLPerf DLRMv2's materialised multi-hot Criteo layout, memory-mapped.

One day is `<prefix>_dense.npy` (float32, N x 13), `<prefix>_labels.npy` (int32, N x 1) and
`<prefix>_sparse_multi_hot.npz`: an uncompressed zip with one member `<f>.npy` per feature f, an int32
array of shape [N, L_f] (L_f ids per sample). Members are memory-mapped straight out of the zip (as the
MLPerf reference's reader does), so a day is never loaded whole.
Legend: N rows, F sparse features, L ids per sample of one feature.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anyrec.data.arrays import check_ids_dtype, check_layout, load_npy
from anyrec.io_checks import atomic_write

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip local file header's fixed 30 bytes


def multihot_paths(directory: str | Path, prefix: str) -> tuple[Path, Path, Path]:
    """The (dense, multi-hot sparse, labels) files of one materialised day."""
    d = Path(directory)
    return d / f"{prefix}_dense.npy", d / f"{prefix}_sparse_multi_hot.npz", d / f"{prefix}_labels.npy"


def _member_memmap(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
    """Memory-map one stored (uncompressed) .npy member of an open zip."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"criteo: {path}: member {info.filename} is compressed and cannot be memory-mapped "
                         "(write it with np.savez or anyrec.data.materialize, not np.savez_compressed)")
    fp = zf.fp
    assert fp is not None
    fp.seek(info.header_offset)
    fields = _LOCAL_HEADER.unpack(fp.read(_LOCAL_HEADER.size))
    if fields[0] != b"PK\x03\x04":
        raise ValueError(f"criteo: {path}: member {info.filename} has no local header (corrupt zip)")
    start = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
    fp.seek(start)
    version = np.lib.format.read_magic(fp)
    shape, fortran, dtype = (np.lib.format.read_array_header_1_0(fp) if version == (1, 0)
                             else np.lib.format.read_array_header_2_0(fp))
    offset = fp.tell()
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if offset - start + need > info.file_size or offset + need > path.stat().st_size:
        raise ValueError(f"criteo: {path}: member {info.filename} is truncated "
                         f"({info.file_size} bytes for a {dtype} array of shape {shape})")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


def load_npz_members(path: Path) -> list[np.ndarray]:
    """Members `0.npy`, `1.npy`, ... of a multi-hot npz, each memory-mapped."""
    if not path.is_file():
        raise ValueError(f"criteo: missing {path} (make it with `python -m anyrec.data.materialize`)")
    try:
        with zipfile.ZipFile(path) as zf:
            names = {i.filename: i for i in zf.infolist()}
            n = sum(1 for k in names if k.removesuffix(".npy").isdigit())
            if n == 0:
                raise ValueError(f"criteo: {path} holds no per-feature arrays (0.npy, 1.npy, ...)")
            missing = [f"{f}.npy" for f in range(n) if f"{f}.npy" not in names]
            if missing:
                raise ValueError(f"criteo: {path} lacks member {missing[0]}")
            return [_member_memmap(path, zf, names[f"{f}.npy"]) for f in range(n)]
    except (zipfile.BadZipFile, OSError, EOFError, struct.error) as e:
        raise ValueError(f"criteo: {path} is not a readable .npz file ({e})") from None
    except ValueError as e:
        if str(e).startswith("criteo:"):
            raise
        raise ValueError(f"criteo: {path} is not a readable .npz file ({e})") from None


@dataclass
class MultiHotArrays:
    """One materialised day: dense (float32), one [N, L_f] id array per feature and labels."""

    dense_NI: np.ndarray
    sparse_F: list[np.ndarray]
    labels_N1: np.ndarray
    source: str = ""
    files: tuple[str, str, str] = ("", "", "")

    def __len__(self) -> int:
        return len(self.labels_N1)

    def hot_sizes(self) -> list[int]:
        """Ids per sample of each feature."""
        return [a.shape[1] for a in self.sparse_F]

    def sparse_rows(self, lo: int, n: int) -> list[np.ndarray]:
        """Rows [lo, lo + n) of every feature."""
        return [np.asarray(a[lo:lo + n]) for a in self.sparse_F]


def read_multihot(directory: str | Path, prefix: str) -> MultiHotArrays:
    """Memory-map one materialised day, checking dtypes and shapes (rows are read per batch)."""
    dense_p, sparse_p, labels_p = multihot_paths(directory, prefix)
    dense, labels = load_npy(dense_p), load_npy(labels_p)
    labels = check_layout(dense_p, dense, labels_p, labels)
    sparse = load_npz_members(sparse_p)
    for f, a in enumerate(sparse):
        check_ids_dtype(f"{sparse_p} member {f}.npy", a)
        if a.ndim != 2 or len(a) != len(dense):
            raise ValueError(f"criteo: {sparse_p} member {f}.npy has shape {a.shape}, expected "
                             f"({len(dense)}, ids per sample) like {dense_p}")
    return MultiHotArrays(dense, sparse, labels, source=str(Path(directory) / f"{prefix}_*"),
                          files=(str(dense_p), str(sparse_p), str(labels_p)))


def write_npz_members(path: Path, members: Iterable[tuple[tuple[int, ...], np.dtype, Iterable[np.ndarray]]]
                      ) -> None:
    """Write an uncompressed npz whose member f (`f.npy`) has the given shape and dtype and the rows the
    chunks iterator yields, without holding a whole member in memory. The container is what np.savez
    writes (zip64 .npy members); it appears only when complete."""
    with atomic_write(path, "wb") as out_file, zipfile.ZipFile(
            out_file, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for f, (shape, dtype, chunks) in enumerate(members):
            with zf.open(f"{f}.npy", "w", force_zip64=True) as out:
                header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                          "fortran_order": False, "shape": tuple(shape)}
                np.lib.format.write_array_header_1_0(out, header)
                rows = 0
                for chunk in chunks:
                    chunk = np.ascontiguousarray(chunk, dtype=dtype)
                    out.write(memoryview(chunk).cast("B"))
                    rows += len(chunk)
                assert rows == shape[0], f"member {f}: wrote {rows} rows, header says {shape[0]}"
