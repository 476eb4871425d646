"""Data sources: Criteo TSV and npy (with torchrec's reader), preprocessing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from anyrec.config import DataConfig, ModelConfig
from anyrec.data import build_source
from anyrec.data.criteo import CriteoSource, read_tsv
from anyrec.data.preprocess import main as preprocess_main

ROWS = [50, 7, 300, 1, 64, 129]
TINY = ModelConfig(name="t", embedding_dim=8, table_rows=ROWS, multi_hot=[1, 3, 2, 1, 5, 2],
                   bottom_mlp=[16, 8], top_mlp=[16, 1])


def _row(label, dense, sparse):
    return "\t".join([str(label), *map(str, dense), *sparse])


def write_tsv(path, n, bad_lines=()):
    """n good Criteo rows (deterministic), and malformed rows after the given line numbers."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        dense = [int(x) for x in rng.integers(-2, 1000, 13)]
        dense[3] = ""  # missing values are 0
        sparse = [format(int(x), "08x") for x in rng.integers(0, 2**32, 26)]
        sparse[5] = ""
        lines.append(_row(i % 2, dense, sparse))
        if i in bad_lines:
            lines.append("1\t2\t3")  # too few fields
            lines.append(_row(1, ["x"] * 13, ["0"] * 26))  # non-integer dense
    path.write_text("\n".join(lines) + "\n")
    return path


def test_tsv_malformed_rows_error_or_counted(tmp_path):
    p = write_tsv(tmp_path / "day_0", 10, bad_lines=(4,))
    with p.open("a") as f:  # the file's smallest dense value: write_tsv draws from [-2, 1000)
        f.write(_row(0, [-3] + [1] * 12, ["0"] * 26) + "\n")
    with pytest.raises(ValueError, match=r"line 6: malformed row: expected 40 tab-separated fields"):
        read_tsv(p, "error")
    arrays = read_tsv(p, "skip")
    assert len(arrays) == 11 and arrays.malformed_rows == 2
    # torchrec's rule: log(x - min + 2), so the file's smallest value maps to log 2 and a missing
    # value (0) to log(2 - min).
    raw_min = -3
    assert arrays.dense_NI.dtype == np.float32 and float(arrays.dense_NI.min()) == pytest.approx(np.log(2))
    assert arrays.dense_NI[0, 3] == np.float32(np.log(np.float32(2 - raw_min)))
    assert arrays.sparse_NF[0, 5] == 0


def test_preprocess_npy_matches_tsv_and_torchrec_reads_it(tmp_path, capsys):
    write_tsv(tmp_path / "day_0", 37, bad_lines=(2,))
    assert preprocess_main([str(tmp_path / "day_0"), "--out-dir", str(tmp_path / "npy"),
                            "--on-malformed", "skip"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report == {"file": str(tmp_path / "day_0"), "prefix": "day_0", "rows": 37, "malformed_rows": 2}
    model = ModelConfig(name="m", table_rows=[97] * 26, bottom_mlp=[16], top_mlp=[1], embedding_dim=16)
    tsv = CriteoSource(model, DataConfig(name="criteo_tsv", path=str(tmp_path), train_files=["day_0"],
                                         batch_size=8, on_malformed="skip"), rank=1, world_size=2)
    npy = build_source(model, DataConfig(name="criteo_npy", path=str(tmp_path / "npy"),
                                         train_files=["day_0"], batch_size=8), 0, 1, 2, "train")
    assert tsv.malformed_rows == 2
    for step in (0, 1, 2, 5):  # 5 wraps around the 37 rows
        a, b = tsv.batch(step), npy.batch(step)
        assert torch.equal(a.dense_features, b.dense_features) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
        assert int(a.sparse_features.values().max()) < 97
    # Rank r reads global batch step * world + r: rows 8..15 for rank 1, step 0.
    raw = read_tsv(tmp_path / "day_0", "skip")
    assert torch.equal(tsv.batch(0).dense_features, torch.from_numpy(raw.dense_NI[8:16]))
    # The same files load in torchrec's own npy reader.
    from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe

    d = str(tmp_path / "npy" / "day_0")
    pipe = InMemoryBinaryCriteoIterDataPipe("train", [d + "_dense.npy"], [d + "_sparse.npy"],
                                            [d + "_labels.npy"], batch_size=8, rank=0, world_size=1,
                                            hashes=[97] * 26)
    first = next(iter(pipe))
    assert torch.equal(first.dense_features, torch.from_numpy(raw.dense_NI[:8]))


def test_criteo_needs_a_path():
    with pytest.raises(ValueError, match="data.path"):
        CriteoSource(TINY, DataConfig(name="criteo_npy", train_files=["day_0"]))
