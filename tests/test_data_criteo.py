"""Criteo files: preprocessing identical to torchrec's tsv_to_npys, gzip, and the input contracts
(labels, finite dense values, ids, shapes, overflow, unreadable files) named by file and row."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import BinaryCriteoUtils

from anyrec.config import DataConfig, ModelConfig
from anyrec.data.criteo import CriteoSource, read_tsv, tsv_path
from anyrec.data.preprocess import main as preprocess_main

from .conftest import torchrun
from .test_data import _row, write_tsv

MODEL = ModelConfig(name="m", table_rows=[97] * 26, bottom_mlp=[16], top_mlp=[1], embedding_dim=16)


def _tsv(tmp_path, n=40):
    """A TSV with negative, missing and large dense values (the cases the transform must match)."""
    p = write_tsv(tmp_path / "day_0", n)
    with p.open("a") as f:
        f.write(_row(1, [-7, 2**31 - 100, ""] + [3] * 10, ["ffffffff", "", *["1a"] * 24]) + "\n")
    return p


def _npy_source(directory, **data):
    return CriteoSource(MODEL, DataConfig(name="criteo_npy", path=str(directory), train_files=["day_0"],
                                          batch_size=8, **data))


def test_preprocess_writes_what_torchrec_writes(tmp_path):
    src = _tsv(tmp_path)
    ref = tmp_path / "ref"
    ref.mkdir()
    BinaryCriteoUtils.tsv_to_npys(str(src), str(ref / "day_0_dense.npy"), str(ref / "day_0_sparse.npy"),
                                  str(ref / "day_0_labels.npy"))
    assert preprocess_main([str(src), "--out-dir", str(tmp_path / "ours")]) == 0
    for part in ("dense", "sparse", "labels"):
        theirs = np.load(ref / f"day_0_{part}.npy")
        ours = np.load(tmp_path / "ours" / f"day_0_{part}.npy")
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, part
        assert ours.tobytes() == theirs.tobytes(), part
    # The TSV reader's on-the-fly transform is the same.
    tsv = CriteoSource(MODEL, DataConfig(name="criteo_tsv", path=str(tmp_path), train_files=["day_0"],
                                         batch_size=41))
    assert torch.equal(tsv.batch(0).dense_features, torch.from_numpy(np.load(ref / "day_0_dense.npy")))


def test_log1p_is_an_explicit_option(tmp_path):
    src = _tsv(tmp_path)
    assert preprocess_main([str(src), "--out-dir", str(tmp_path / "l"), "--dense-transform", "log1p"]) == 0
    raw = np.asarray([[int(x or 0) for x in line.split("\t")[1:14]] for line in src.read_text().splitlines()])
    expected = np.log1p(np.maximum(raw, 0).astype(np.float64)).astype(np.float32)
    assert np.array_equal(np.load(tmp_path / "l" / "day_0_dense.npy"), expected)
    assert not np.array_equal(read_tsv(src).dense_NI, expected)  # the default is torchrec's rule


def test_gzipped_tsv_reads_like_the_plain_file(tmp_path):
    src = _tsv(tmp_path)
    gz = tmp_path / "gz" / "day_0.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(src.read_bytes()))
    assert tsv_path(gz.parent, "day_0") == gz
    plain, zipped = read_tsv(src), read_tsv(gz)
    for a, b in ((plain.dense_NI, zipped.dense_NI), (plain.sparse_NF, zipped.sparse_NF),
                 (plain.labels_N1, zipped.labels_N1)):
        assert np.array_equal(a, b)
    cut = tmp_path / "gz" / "day_1.gz"
    cut.write_bytes(gz.read_bytes()[: len(gz.read_bytes()) // 2])
    with pytest.raises(ValueError, match=rf"criteo: {cut}: unreadable after line \d+"):
        read_tsv(cut)


@pytest.mark.parametrize("field, value, message", [
    (39, "f" * 24, r"line 3: malformed row: categorical id 0xf+ does not fit in 63 bits"),
    (2, str(10**30), r"line 3: malformed row: dense value 10+ does not fit in 32 bits"),
    (0, "7", r"line 3: malformed row: label must be 0 or 1, got '7'"),
])
def test_tsv_overflow_and_bad_labels_name_the_line(tmp_path, field, value, message):
    p = write_tsv(tmp_path / "day_0", 4)
    lines = p.read_text().splitlines()
    fields = lines[2].split("\t")
    fields[field] = value
    lines[2] = "\t".join(fields)
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"criteo: {p} {message}"):
        read_tsv(p)


def _write_npy_day(directory, n=32, labels=None, dense=None, sparse=None):
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    arrays = {
        "dense": rng.random((n, 13), dtype=np.float32) if dense is None else dense,
        "sparse": rng.integers(0, 2**31, (n, 26)) if sparse is None else sparse,
        "labels": (np.arange(n, dtype=np.int32) % 2).reshape(-1, 1) if labels is None else labels,
    }
    for part, arr in arrays.items():
        np.save(directory / f"day_0_{part}.npy", arr)
    return directory


def test_npy_labels_must_be_zero_or_one(tmp_path):
    d = _write_npy_day(tmp_path, labels=np.full((32, 1), 7, dtype=np.int32))
    with pytest.raises(ValueError, match=rf"criteo: {d}/day_0_labels.npy row 0: label 7 is not 0 or 1"):
        _npy_source(d).batch(0)
    labels = (np.arange(32, dtype=np.int32) % 2).reshape(-1, 1)
    labels[19] = -1  # in the third batch of 8
    d = _write_npy_day(tmp_path / "b", labels=labels)
    src = _npy_source(d)
    src.batch(0), src.batch(1)
    with pytest.raises(ValueError, match=r"day_0_labels.npy row 19: label -1 is not 0 or 1"):
        src.batch(2)


def test_npy_dense_must_be_finite(tmp_path):
    dense = np.ones((32, 13), dtype=np.float32)
    dense[5, 3] = np.inf
    d = _write_npy_day(tmp_path, dense=dense)
    with pytest.raises(ValueError, match=r"day_0_dense.npy row 5: dense feature 3 is inf"):
        _npy_source(d).batch(0)


def test_npy_ids_dtype_and_range(tmp_path):
    d = _write_npy_day(tmp_path, sparse=np.zeros((32, 26), dtype=np.float32))
    with pytest.raises(ValueError, match=r"day_0_sparse.npy holds float32, expected integer ids"):
        _npy_source(d)
    sparse = np.zeros((32, 26), dtype=np.int64)
    sparse[9, 4] = 97  # one past table 4's last row
    d = _write_npy_day(tmp_path / "r", sparse=sparse)
    _npy_source(d).batch(1)  # hashed: 97 % 97 = 0
    with pytest.raises(ValueError, match=r"sparse.npy row 9: feature 4 id 97 is outside its table \[0, 97\)"):
        _npy_source(d, hash_ids=False).batch(1)


def test_npy_shapes_are_checked(tmp_path):
    d = _write_npy_day(tmp_path, dense=np.ones(32, dtype=np.float32))
    with pytest.raises(ValueError, match=r"day_0_dense.npy must be 2-D"):
        _npy_source(d)
    d = _write_npy_day(tmp_path / "b", labels=np.zeros((30, 1), dtype=np.int32))
    with pytest.raises(ValueError, match=r"day_0_labels.npy has 30 rows, .*day_0_dense.npy has 32"):
        _npy_source(d)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_unreadable_npy_is_named(tmp_path, damage):
    d = _write_npy_day(tmp_path)
    p = d / "day_0_sparse.npy"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not an npy file at all" * 10)
    with pytest.raises(ValueError, match=rf"criteo: {p} is not a readable .npy file"):
        _npy_source(d)


def test_training_on_labels_of_7_fails_with_one_line(tmp_path, train_here):
    """One process: the one line, exit 2, and the run's process group closed (a process alone has no peer
    left waiting in a collective; conftest fails a test that leaves the group up)."""
    d = _write_npy_day(tmp_path / "npy", n=64, labels=np.full((64, 1), 7, dtype=np.int32))
    proc = train_here(["model=dlrm_tiny", "data=criteo_npy", f"data.path={d}", "data.batch_size=16",
                       "trainer.steps=4", "trainer.eval_steps=0", "trainer.progress=false",
                       "trainer.tensorboard=false", f"hydra.run.dir={tmp_path}/h"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("anyrec-train: error:")]
    assert lines == [f"anyrec-train: error: criteo: {d}/day_0_labels.npy row 0: label 7 is not 0 or 1"], \
        proc.stderr[-3000:]


@pytest.mark.integration
def test_a_bad_row_only_one_rank_reads_stops_the_job(tmp_path):
    labels = (np.arange(256, dtype=np.int32) % 2).reshape(-1, 1)
    labels[84] = 7  # global batch 5 of 16 rows: rank 1's step 2; rank 0 never reads it
    d = _write_npy_day(tmp_path / "npy", n=256, labels=labels)
    proc = torchrun(["-m", "anyrec.train", "model=dlrm_tiny", "data=criteo_npy", f"data.path={d}",
                     "data.batch_size=16", "trainer.steps=6", "trainer.eval_steps=0",
                     "trainer.progress=false", "trainer.tensorboard=false", f"hydra.run.dir={tmp_path}/h"],
                    cwd=tmp_path, timeout=150)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("anyrec-train: error:")]
    assert lines == [f"anyrec-train: error: criteo: {d}/day_0_labels.npy row 84: label 7 is not 0 or 1"], \
        proc.stderr[-3000:]
