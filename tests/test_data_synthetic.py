"""Synthetic data: determinism, global-position keying, power law, learnability, device identity."""

from __future__ import annotations

import hashlib

import pytest
import torch

from anyrec.config import DataConfig, ModelConfig
from anyrec.data import build_source, resolve_batch_size, synthetic
from anyrec.data.synthetic import SyntheticCriteo

from .conftest import OpRecorder, compose_config

ROWS = [50, 7, 300, 1, 64, 129]
TINY = ModelConfig(name="t", embedding_dim=8, table_rows=ROWS, multi_hot=[1, 3, 2, 1, 5, 2],
                   bottom_mlp=[16, 8], top_mlp=[16, 1])


def _per_feature(kjt):
    return dict(zip(kjt.keys(), torch.split(kjt.values(), kjt.length_per_key()), strict=True))


def _digest(batch) -> str:
    h = hashlib.sha256()
    for t in (batch.sparse_features.values(), batch.sparse_features.lengths(), batch.dense_features,
              batch.labels):
        h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def test_multi_hot_deterministic_and_in_range():
    src = SyntheticCriteo(TINY, DataConfig(batch_size=16), seed=1, rank=0, world_size=2)
    b = src.batch(3)
    assert b.dense_features.shape == (16, 13) and b.labels.shape == (16,)
    assert b.sparse_features.values().dtype == torch.int64
    lengths = b.sparse_features.lengths().view(len(ROWS), 16)
    assert lengths[:, 0].tolist() == [1, 3, 2, 1, 5, 2] and bool((lengths == lengths[:, :1]).all())
    for rows, ids in zip(ROWS, _per_feature(b.sparse_features).values(), strict=True):
        assert 0 <= int(ids.min()) and int(ids.max()) < rows
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0} and bool(torch.isfinite(b.dense_features).all())
    again = SyntheticCriteo(TINY, DataConfig(batch_size=16), seed=1, rank=0, world_size=2).batch(3)
    assert _digest(again) == _digest(b)
    differs = [SyntheticCriteo(TINY, DataConfig(batch_size=16), seed=1, rank=1, world_size=2).batch(3),
               SyntheticCriteo(TINY, DataConfig(batch_size=16), seed=2, rank=0, world_size=2).batch(3),
               SyntheticCriteo(TINY, DataConfig(batch_size=16), seed=1, rank=0, world_size=2,
                               split="eval").batch(3),
               src.batch(4)]
    for other in differs:
        assert not torch.equal(other.dense_features, b.dense_features)
        assert not torch.equal(other.sparse_features.values(), b.sparse_features.values())


@pytest.mark.parametrize("pass_ids", [1, 8, 24, 10**9])
def test_any_split_of_the_slot_columns_makes_the_same_batch(monkeypatch, pass_ids):
    """CPU batches go through the [B, S] pass a few columns at a time (a feature's slots may straddle
    two passes; runs of whole features are written by one op): the ids are those of one pass."""
    data = DataConfig(batch_size=8)
    one_pass = SyntheticCriteo(TINY, data, seed=3)
    monkeypatch.setattr(synthetic, "_CPU_PASS_IDS", pass_ids)
    split = SyntheticCriteo(TINY, data, seed=3)
    assert len(one_pass._passes) == 1
    assert len(split._passes) == {1: 14, 8: 14, 24: 6, 10**9: 1}[pass_ids]
    for step in (0, 5):
        assert _digest(split.batch(step)) == _digest(one_pass.batch(step))


def test_packed_lookup_table_makes_the_same_batch(monkeypatch):
    """Small id ranges pack (first id, width, teacher weight) into one lookup; the two-table layout
    (ranges above 2^21) gives the same batch."""
    packed = SyntheticCriteo(TINY, DataConfig(batch_size=300), seed=3)
    monkeypatch.setattr(synthetic, "_PACKED_BITS", 0)
    two_tables = SyntheticCriteo(TINY, DataConfig(batch_size=300), seed=3)
    assert packed._id_bits is not None and two_tables._id_bits is None
    for step in (0, 5):
        assert _digest(packed.batch(step)) == _digest(two_tables.batch(step))


def test_pinned_batch_digest():
    """The integer stream is part of the numerics contract: changing it is a deliberate act."""
    b = SyntheticCriteo(TINY, DataConfig(batch_size=8), seed=7).batch(2)
    assert _digest(b) == "cc148ad656892a51"


@pytest.mark.parametrize("world", [2, 4])
def test_same_global_batch_at_any_world_size(world):
    """1 rank x 512 and N ranks x 512/N see the same samples: rank slices of one global batch."""
    one = SyntheticCriteo(TINY, resolve_batch_size(DataConfig(global_batch_size=512), 1), seed=5)
    data = resolve_batch_size(DataConfig(global_batch_size=512), world)
    parts = [build_source(TINY, data, 5, r, world, "train") for r in range(world)]
    for step in (0, 3):
        whole = one.batch(step)
        slices = [p.batch(step) for p in parts]
        assert torch.equal(torch.cat([s.dense_features for s in slices]), whole.dense_features)
        assert torch.equal(torch.cat([s.labels for s in slices]), whole.labels)
        for key, ids in _per_feature(whole.sparse_features).items():
            assert torch.equal(torch.cat([_per_feature(s.sparse_features)[key] for s in slices]), ids)


def test_global_batch_size_must_divide():
    assert resolve_batch_size(DataConfig(global_batch_size=512), 2).batch_size == 256
    assert resolve_batch_size(DataConfig(batch_size=64), 4).batch_size == 64  # per-rank configs unchanged
    with pytest.raises(ValueError, match="multiple of the world size"):
        resolve_batch_size(DataConfig(global_batch_size=513), 2)


def test_id_range_scale_makes_out_of_range_ids():
    src = SyntheticCriteo(TINY, DataConfig(batch_size=256, id_range_scale=2.0), seed=0)
    ids = _per_feature(src.batch(0).sparse_features)
    assert any(int(v.max()) >= rows for rows, v in zip(ROWS, ids.values(), strict=True))
    assert all(int(v.max()) < 2 * rows for rows, v in zip(ROWS, ids.values(), strict=True))


def _counts(zipf: float, rows: int, samples: int) -> torch.Tensor:
    model = ModelConfig(name="one", table_rows=[rows], multi_hot=[4], bottom_mlp=[8], top_mlp=[1])
    src = SyntheticCriteo(model, DataConfig(batch_size=samples // 4, zipf_exponent=zipf), seed=3)
    ids = src.batch(0).sparse_features.values()
    return torch.bincount(ids, minlength=rows)


def test_power_law_popularity():
    """Sorted id counts fall as rank^-s (fit over the head), and popular ids are not the small ids."""
    rows, samples = 100_000, 400_000
    for s in (0.8, 1.05, 1.3):
        counts = _counts(s, rows, samples)
        ranked = counts.sort(descending=True).values.double()
        k = torch.arange(1, 201, dtype=torch.float64)
        slope = torch.linalg.lstsq(torch.stack([k.log(), torch.ones_like(k)], 1),
                                   ranked[:200].log().unsqueeze(1)).solution[0, 0]
        assert abs(float(slope) + s) < 0.08, (s, float(slope))
        # The most popular id has the power law's share of the mass (continuous approximation).
        a = 1.0 - s
        p0 = ((2.0**a - 1.0) / ((rows + 1) ** a - 1.0))
        assert float(ranked[0]) / samples == pytest.approx(p0, rel=0.08)
        assert int(counts.argmax()) != 0
    uniform = _counts(0.0, 1000, samples).double()
    assert float(uniform.std() / uniform.mean()) < 0.1  # Poisson noise at 400 per id is 0.05


def test_labels_are_learnable():
    """Per-id click rates learned on train predict eval labels (AUC well above 0.5); no signal, no AUC."""
    model = ModelConfig(name="m", table_rows=[40] * 8, bottom_mlp=[8], top_mlp=[1], num_dense_features=4)

    def auc(signal: float) -> float:
        data = DataConfig(batch_size=20_000, signal_scale=signal)
        train = SyntheticCriteo(model, data, seed=11).batch(0)
        test = SyntheticCriteo(model, data, seed=11, split="eval").batch(0)
        ids_tr = train.sparse_features.values().view(8, -1)
        ids_te = test.sparse_features.values().view(8, -1)
        score = torch.zeros(ids_te.shape[1], dtype=torch.float64)
        for f in range(8):
            pos = torch.bincount(ids_tr[f], weights=train.labels.double(), minlength=40) + 1
            tot = torch.bincount(ids_tr[f], minlength=40).double() + 2
            score += torch.logit(pos / tot)[ids_te[f]]
        w = torch.linalg.lstsq(train.dense_features.double(), train.labels.double().unsqueeze(1)).solution
        score += 4 * (test.dense_features.double() @ w).squeeze(1)
        order = score.argsort()
        ranks = torch.empty_like(order, dtype=torch.float64)
        ranks[order] = torch.arange(1, len(order) + 1, dtype=torch.float64)
        y = test.labels.bool()
        npos = int(y.sum())
        return float((ranks[y].sum() - npos * (npos + 1) / 2) / (npos * (len(y) - npos)))

    assert auc(2.5) > 0.75
    assert abs(auc(0.0) - 0.5) < 0.03


def test_one_feature_one_slot():
    """The largest teacher weight (one feature, one slot) still fits its lookup entry, and its ids
    carry the click signal: per-id click rates on train rank eval labels (AUC above 0.6)."""
    model = ModelConfig(name="one", table_rows=[40], bottom_mlp=[8], top_mlp=[1], num_dense_features=1)
    data = DataConfig(batch_size=20_000, signal_scale=2.5)
    train, test = (SyntheticCriteo(model, data, seed=3, split=s).batch(0) for s in ("train", "eval"))
    ids_tr, ids_te = train.sparse_features.values(), test.sparse_features.values()
    assert 0 <= int(ids_tr.min()) and int(ids_tr.max()) < 40
    rate = (torch.bincount(ids_tr, weights=train.labels.double(), minlength=40) + 1) / (
        torch.bincount(ids_tr, minlength=40).double() + 2)
    score, y = rate[ids_te], test.labels.bool()
    pairs = (score[y][:, None] > score[~y][None, :2000]).double().mean()
    assert pairs > 0.6


def test_dense_features_standard_normal():
    b = SyntheticCriteo(TINY, DataConfig(batch_size=4096), seed=0).batch(0)
    d = b.dense_features
    assert d.dtype == torch.float32
    assert abs(float(d.mean())) < 0.03 and abs(float(d.std()) - 1.0) < 0.03
    assert float(d.abs().max()) > 3.0  # tails are there, not a clipped toy
    assert abs(float(torch.corrcoef(d.T)[0, 1])) < 0.05


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="rank 2 is outside the world of 2 ranks"):
        SyntheticCriteo(TINY, DataConfig(batch_size=4), seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="unknown split"):
        SyntheticCriteo(TINY, DataConfig(batch_size=4), seed=0, split="test")
    with pytest.raises(ValueError, match="data.id_range_scale must be > 0, got 0.0"):
        compose_config(["data.id_range_scale=0"])  # the typed config refuses it, for every source


def _accelerator() -> torch.device | None:
    from anyrec.backends import get_backend

    backend = get_backend("auto")
    return None if backend.device_type == "cpu" else backend.device(0)


@pytest.mark.skipif(_accelerator() is None, reason="needs an accelerator (GPU-only test)")
def test_identical_on_the_accelerator():
    device = _accelerator()
    cpu = SyntheticCriteo(TINY, DataConfig(batch_size=1024), seed=4)
    acc = SyntheticCriteo(TINY, DataConfig(batch_size=1024), seed=4, device=device)
    for step in (0, 9):
        b = acc.batch(step)
        assert b.sparse_features.values().device.type == device.type
        assert _digest(b) == _digest(cpu.batch(step))


def test_no_host_sync_while_generating():
    """A batch is made from device ops only: no tensor value is read back to the host."""
    src = SyntheticCriteo(TINY, DataConfig(batch_size=64), seed=0)
    src.batch(0)
    with OpRecorder() as rec:
        b = src.batch(1)
    assert len(rec.ops) > 10 and not any("_local_scalar_dense" in op for op in rec.ops)
    assert b.dense_features.shape[0] == 64
