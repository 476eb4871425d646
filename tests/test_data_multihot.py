"""MLPerf multi-hot Criteo: anyrec.data.materialize against the reference's uniform rule, the
memory-mapped reader, damaged npz files, and 2 ranks training end to end on materialised files."""

from __future__ import annotations

import logging
import zipfile

import numpy as np
import pytest
import torch

from anyrec.config import DataConfig, ModelConfig
from anyrec.data import build_source
from anyrec.data.criteo import CriteoSource
from anyrec.data.materialize import lookup_tables, materialize_day
from anyrec.data.materialize import main as materialize_main
from anyrec.data.preprocess import main as preprocess_main

from .conftest import last_json_line, torchrun
from .test_data import write_tsv

TINY_ROWS = [97, 200, 50, 300, 64, 128, 12, 256, 400, 33, 150, 80, 20, 500, 70, 99, 9, 120, 45, 230, 310, 66,
             140, 88, 17, 256]  # configs/model/dlrm_tiny.yaml
HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 10, 7, 10, 3, 1, 1]


def reference_multi_hot(one_hot_NF: np.ndarray, rows: list[int], hot: list[int]) -> list[np.ndarray]:
    """The reference's Multihot(dist_type="uniform") tables and lookup, restated in one shot."""
    np.random.seed(0)
    tables = [np.concatenate((np.arange(E)[:, None], np.random.randint(0, E, size=(E, L - 1))), axis=-1)
              for E, L in zip(rows, hot, strict=True)]
    tables = [torch.from_numpy(t).int() for t in tables]
    return [torch.nn.functional.embedding(torch.from_numpy(one_hot_NF[:, f] % E), tables[f]).numpy()
            for f, E in enumerate(rows)]


def _npy_day(tmp_path, n=100):
    (tmp_path / "tsv").mkdir()
    write_tsv(tmp_path / "tsv" / "day_0", n)
    assert preprocess_main([str(tmp_path / "tsv" / "day_0"), "--out-dir", str(tmp_path / "npy")]) == 0
    return tmp_path / "npy" / "day_0"


def test_materialize_matches_the_reference_rule(tmp_path):
    prefix = _npy_day(tmp_path)
    one_hot = np.load(f"{prefix}_sparse.npy")
    expected = reference_multi_hot(one_hot, TINY_ROWS, HOT)
    out = tmp_path / "mh"
    out.mkdir()
    # Small chunks: tables drawn and days gathered in many pieces must give the one-shot stream.
    tables = lookup_tables(TINY_ROWS, HOT, tmp_path, chunk_elems=7)
    report = materialize_day(prefix, out, tables, TINY_ROWS, chunk_elems=30)
    assert report["rows"] == 100 and report["ids_per_sample"] == sum(HOT)
    with np.load(out / "day_0_sparse_multi_hot.npz") as npz:  # a plain npz, as np.savez writes
        assert sorted(npz.files, key=lambda k: int(k.split(".")[0])) == [str(f) for f in range(26)]
        for f in range(26):
            assert npz[str(f)].dtype == np.int32 and npz[str(f)].shape == (100, HOT[f])
            assert np.array_equal(npz[str(f)], expected[f]), f
    for part in ("dense", "labels"):
        assert (out / f"day_0_{part}.npy").read_bytes() == open(f"{prefix}_{part}.npy", "rb").read()


def test_materialize_cli_and_reader(tmp_path, capsys, caplog):
    prefix = _npy_day(tmp_path, n=37)
    out = tmp_path / "mh"
    assert materialize_main([str(prefix), "--out-dir", str(out), "--model", "dlrm_tiny",
                             "--multi-hot-sizes", ",".join(map(str, HOT))]) == 0
    assert '"rows": 37' in capsys.readouterr().out
    assert not list(out.glob(".tables-*")) and not list(out.glob("*.tmp"))
    expected = reference_multi_hot(np.load(f"{prefix}_sparse.npy"), TINY_ROWS, HOT)
    model = ModelConfig(name="t", table_rows=TINY_ROWS, multi_hot=HOT, embedding_dim=8, bottom_mlp=[8],
                        top_mlp=[1])
    data = DataConfig(name="criteo_multihot", path=str(out), train_files=["day_0"], batch_size=8)
    src = CriteoSource(model, data, rank=1, world_size=2)
    b = src.batch(2)  # global batch 5: rows 40..47 wrap to 3..10
    rows = np.arange(40, 48) % 37
    kjt = b.sparse_features
    assert kjt.lengths().view(26, 8)[:, 0].tolist() == HOT
    per_feature = dict(zip(kjt.keys(), torch.split(kjt.values(), kjt.length_per_key()), strict=True))
    for f, ids in enumerate(per_feature.values()):
        assert torch.equal(ids, torch.from_numpy(expected[f][rows].reshape(-1).astype(np.int64))), f
    assert torch.equal(b.dense_features, torch.from_numpy(np.load(f"{prefix}_dense.npy")[rows]))
    # Prefetching (the default for file sources) yields the same batches.
    pre = build_source(model, data, 0, 1, 2, "train")
    for a, c in zip(pre.iter_from(0, 6), (src.batch(s) for s in range(6)), strict=True):
        assert torch.equal(a.sparse_features.values(), c.sparse_features.values())
    # A model whose multi_hot disagrees with the files trains on the files' ids, with a warning.
    with caplog.at_level(logging.WARNING, logger="anyrec.data.criteo"):
        other = CriteoSource(ModelConfig(name="t", table_rows=TINY_ROWS, multi_hot=[1] * 26), data, 1, 2)
    assert "model.multi_hot says [1, 1" in caplog.text
    assert torch.equal(other.batch(2).sparse_features.values(), kjt.values())


@pytest.mark.parametrize("damage", ["truncate", "compressed", "garbage"])
def test_damaged_npz_is_named(tmp_path, damage):
    prefix = _npy_day(tmp_path, n=20)
    out = tmp_path / "mh"
    assert materialize_main([str(prefix), "--out-dir", str(out), "--model", "dlrm_tiny"]) == 0
    p = out / "day_0_sparse_multi_hot.npz"
    if damage == "truncate":
        p.write_bytes(p.read_bytes()[:3000])
        match = rf"criteo: {p} is not a readable .npz file"
    elif damage == "garbage":
        p.write_bytes(b"garbage" * 100)
        match = rf"criteo: {p} is not a readable .npz file"
    else:
        with np.load(p) as npz:
            arrays = {k: npz[k] for k in npz.files}
        p.unlink()
        np.savez_compressed(p, **arrays)
        match = r"member 0.npy is compressed and cannot be memory-mapped"
    model = ModelConfig(name="t", table_rows=TINY_ROWS)
    with pytest.raises(ValueError, match=match):
        CriteoSource(model, DataConfig(name="criteo_multihot", path=str(out), train_files=["day_0"]))


def test_npz_member_truncated_inside_the_zip_is_named(tmp_path):
    out = tmp_path / "mh"
    out.mkdir()
    np.save(out / "day_0_dense.npy", np.zeros((10, 13), np.float32))
    np.save(out / "day_0_labels.npy", np.zeros((10, 1), np.int32))
    with zipfile.ZipFile(out / "day_0_sparse_multi_hot.npz", "w") as zf:
        with zf.open("0.npy", "w") as f:
            np.lib.format.write_array_header_1_0(
                f, {"descr": "<i4", "fortran_order": False, "shape": (10, 3)})
            f.write(np.zeros(12, np.int32).tobytes())  # 12 of the 30 ids the header promises
    with pytest.raises(ValueError, match=r"member 0.npy is truncated"):
        CriteoSource(ModelConfig(name="t", table_rows=[5]),
                     DataConfig(name="criteo_multihot", path=str(out), train_files=["day_0"]))


@pytest.mark.integration
def test_two_ranks_train_on_materialised_multi_hot(tmp_path):
    prefix = _npy_day(tmp_path, n=300)
    out = tmp_path / "mh"
    assert materialize_main([str(prefix), "--out-dir", str(out), "--model", "dlrm_tiny",
                             "--multi-hot-sizes", ",".join(map(str, HOT))]) == 0
    proc = torchrun(["-m", "anyrec.train", "model=dlrm_tiny", f"model.multi_hot=[{','.join(map(str, HOT))}]",
                     "data=criteo_multihot", f"data.path={out}", "data.batch_size=16", "trainer.steps=6",
                     "trainer.eval_steps=2", "trainer.progress=false", "trainer.tensorboard=false",
                     f"hydra.run.dir={tmp_path}/h"], cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = last_json_line(proc.stdout)
    assert s["steps"] == 6 and np.isfinite(s["final_loss"])
