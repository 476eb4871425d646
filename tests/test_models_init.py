"""Plan-invariant initialisation: values are a pure function of (seed, table, global row, column)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from anyrec.models.init import cpu_copy, fill_table_block, init_dense, init_tables


def _full(seed=7, table="t", rows=50, cols=6, **kw) -> torch.Tensor:
    out = torch.empty(rows, cols)
    fill_table_block(out, seed, table, rows, **kw)
    return out


def test_any_block_of_a_table_equals_the_same_block_of_the_whole_table():
    full = _full(rows=50, cols=6)
    blocks = [(0, 0, 50, 3), (0, 3, 50, 3), (17, 0, 20, 6), (49, 2, 1, 4), (10, 4, 7, 2)]
    for row0, col0, rows, cols in blocks:
        block = torch.empty(rows, cols)
        fill_table_block(block, 7, "t", 50, row0, col0)
        assert torch.equal(block, full[row0:row0 + rows, col0:col0 + cols]), (row0, col0)


def test_values_follow_torchrecs_default_range_and_depend_on_seed_and_table():
    full = _full(rows=400, cols=64)
    bound = 1 / math.sqrt(400)
    assert float(full.abs().max()) <= bound
    assert float(full.max()) > 0.99 * bound and float(full.min()) < -0.99 * bound
    assert abs(float(full.mean())) < 0.01 * bound  # 25,600 uniform draws
    assert abs(float(full.var()) - bound**2 / 3) < 0.03 * bound**2 / 3
    assert not torch.equal(full, _full(seed=8, rows=400, cols=64))
    assert not torch.equal(full, _full(table="u", rows=400, cols=64))
    assert torch.equal(full, _full(rows=400, cols=64))


def test_values_are_pinned():
    """The draw itself is part of the numerics contract: changing it moves every trajectory."""
    full = _full(seed=0, table="t_cat_0", rows=97, cols=8)
    pinned = torch.tensor([0.03116016648709774, -0.03155120462179184, -0.04027454927563667])
    torch.testing.assert_close(full[0, :3], pinned, rtol=0, atol=0)


def test_rows_beyond_32_bits_hash_their_high_half():
    a, b = torch.empty(1, 4), torch.empty(1, 4)
    fill_table_block(a, 0, "t", 1 << 34, row0=5)
    fill_table_block(b, 0, "t", 1 << 34, row0=5 + (1 << 32))
    assert not torch.equal(a, b)


def test_init_fn_tables_are_drawn_whole_and_sliced():
    def init_fn(w: torch.Tensor) -> None:
        torch.nn.init.normal_(w, std=3.0)

    full = _full(rows=30, cols=4, init_fn=init_fn, num_cols=4)
    assert float(full.std()) > 1.0  # the table's own distribution, not the default +-1/sqrt(30)
    block = torch.empty(10, 2)
    fill_table_block(block, 7, "t", 30, 12, 2, init_fn=init_fn, num_cols=4)
    assert torch.equal(block, full[12:22, 2:4])
    rng = torch.get_rng_state()
    _full(rows=30, cols=4, init_fn=init_fn, num_cols=4)
    assert torch.equal(rng, torch.get_rng_state())  # the global generator is left as it was


def test_init_tables_fills_whole_tables_by_state_dict_key():
    cfgs = [EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=r, feature_names=[n])
            for n, r in (("a", 9), ("b", 5))]
    state = {f"ebc.{c.name}.weight": torch.zeros(c.num_embeddings, 4) for c in cfgs}
    assert init_tables(state, cfgs, 3, "ebc.") == 2
    assert torch.equal(state["ebc.b.weight"], _full(seed=3, table="b", rows=5, cols=4))
    # torchrec's own default init_fn (a uniform_ partial) is drawn by the hash, with its range
    ranged = EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=6, feature_names=["c"],
                                weight_init_min=0.5, weight_init_max=2.0)
    state["ebc.c.weight"] = torch.zeros(6, 4)
    assert init_tables(state, [ranged], 3, "ebc.") == 1
    got = state["ebc.c.weight"]
    assert 0.5 <= float(got.min()) and float(got.max()) <= 2.0
    torch.testing.assert_close(got, _full(seed=3, table="c", rows=6, cols=4) * (0.75 * 6**0.5) + 1.25)
    with pytest.raises(KeyError, match="ebc.a.weight"):
        init_tables({}, cfgs, 3, "ebc.")


def test_dense_layers_do_not_depend_on_construction_order():
    def model(first_draws: int) -> nn.Module:
        torch.randn(first_draws)  # e.g. tables built before the MLP on one path and not the other
        return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))

    a, b = model(0), model(100)
    assert not torch.equal(a[0].weight, b[0].weight)
    assert init_dense(a, 7) == init_dense(b, 7) == 2
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    c = model(0)
    init_dense(c, 8)
    assert not torch.equal(a[0].weight, c[0].weight)


def test_dense_module_without_reset_is_refused():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.ones(2))

    with pytest.raises(ValueError, match="reset_parameters"):
        init_dense(nn.Sequential(Scale()), 0)


def test_trainer_starts_from_the_same_weights_on_every_kernel_and_plan(monkeypatch):
    """FBGEMM under DistributedModelParallel (table-wise, column-wise) and anyrec's unsharded torch TBE."""
    from anyrec.parity import full_weights
    from anyrec.trainer.trainer import Trainer

    from .conftest import compose_config

    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    weights = []
    column_wise = ["planner.name=simple", "planner.sharding=column_wise"]
    for variant in (["backend.embedding_kernel=torch"], ["backend.embedding_kernel=fbgemm"],
                    ["backend.embedding_kernel=fbgemm", *column_wise]):
        _, cfg = compose_config(["model=dlrm_tiny", "trainer.steps=0", "trainer.eval_steps=0",
                                 "trainer.progress=false", "trainer.seed=7", *variant])
        trainer = Trainer(cfg)
        try:
            weights.append(full_weights(trainer.model, trainer.dist))
        finally:
            trainer.close()
    assert len(weights[0]) == 26 + 8  # tables, and the weight and bias of 4 linear layers
    for other in weights[1:]:
        assert other.keys() == weights[0].keys()
        for name, w in weights[0].items():
            assert torch.equal(w, other[name]), name


def test_the_cpu_copy_clones_no_device_storage(monkeypatch):
    """init_dense re-draws a CPU copy of each module: its buffers are copied to the host directly, never by
    a storage clone on their device (a device without a storage allocator of its own crashes on that)."""
    m = nn.Linear(2, 2)
    m.register_buffer("bits", torch.tensor([1, 2, 4]))
    monkeypatch.setattr(torch.UntypedStorage, "clone", lambda self: pytest.fail("a storage was cloned"))
    c = cpu_copy(m)
    assert c.bits is not m.bits and torch.equal(c.bits, m.bits)
    assert isinstance(c.weight, nn.Parameter) and c.weight is not m.weight and torch.equal(c.weight, m.weight)
