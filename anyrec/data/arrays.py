"""Reading and checking the numpy arrays of Criteo's file layouts (npy and the multi-hot npz), shared
by the readers of both (`criteo`, `multihot`) and the materialiser."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def load_npy(path: Path) -> np.ndarray:
    """Memory-map one .npy file; a missing, truncated or foreign file is a ValueError naming it."""
    if not path.is_file():
        raise ValueError(f"criteo: missing {path} (make it with `python -m anyrec.data.preprocess`)")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"criteo: {path} is not a readable .npy file ({e})") from None
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"criteo: {path} is not an .npy file (it holds {type(arr).__name__})")
    return arr


def check_layout(dense_path, dense: np.ndarray, labels_path, labels: np.ndarray) -> np.ndarray:
    """Check the dense and label arrays' dtypes and shapes; return labels as [N, 1]."""
    if dense.ndim != 2:
        raise ValueError(f"criteo: {dense_path} must be 2-D (rows x dense features), has shape {dense.shape}")
    if dense.dtype.kind != "f":
        raise ValueError(f"criteo: {dense_path} holds {dense.dtype}, expected float32 dense features")
    if labels.dtype.kind not in "iubf":
        raise ValueError(f"criteo: {labels_path} holds {labels.dtype}, expected int32 labels")
    if labels.ndim not in (1, 2) or (labels.ndim == 2 and labels.shape[1] != 1):
        raise ValueError(f"criteo: {labels_path} must have one label per row, has shape {labels.shape}")
    if len(labels) != len(dense):
        raise ValueError(f"criteo: {labels_path} has {len(labels)} rows, {dense_path} has {len(dense)}")
    return labels.reshape(len(labels), 1)


def check_ids_dtype(path, arr: np.ndarray) -> None:
    """Ids must be integers (any width up to 64 bits)."""
    if arr.dtype.kind not in "iu" or arr.dtype.itemsize > 8 or arr.dtype == np.uint64:
        raise ValueError(f"criteo: {path} holds {arr.dtype}, expected integer ids (int32 or int64)")
