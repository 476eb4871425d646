"""TritonEmbeddingBagCollection against torchrec's EmbeddingBagCollection (torch execution, CPU).

A tiny DLRM-like model (collection + Linear) trained 3 steps must match torchrec's EBC with dense
gradients, the reference fused optimizer for the tables and SGD for the Linear. The KJTs are built
from lengths with their keys out of table order and one extra key, the case where torchrec's own
`offsets()`/`permute` would call FBGEMM ops; a dispatch-mode recorder proves none is called.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim.optimizers import in_backward_optimizer_filter

from anyrec.kernels import reference as R
from anyrec.kernels.ebc import TritonEmbeddingBagCollection, dense_named_parameters
from anyrec.kernels.optimizers import OptimizerConfig

from .conftest import OpRecorder

ROWS = {"t0": 10, "t1": 7}
OPTS = [OptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6), OptimizerConfig("adam", lr=0.05, eps=1e-6)]


def tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f2"]),
            EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=7, feature_names=["f1"])]


def make_kjt(seed: int, batch: int = 3) -> KeyedJaggedTensor:
    """Keys f1, extra, f0, f2 (not table order), lengths only, repeated ids."""
    g = torch.Generator().manual_seed(seed)
    keys, rows = ["f1", "extra", "f0", "f2"], [7, 5, 10, 10]
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=g)
    values = torch.cat([torch.randint(0, min(r, 4), (int(n),), generator=g)
                        for r, n in zip([r for r in rows for _ in range(batch)], lengths, strict=True)])
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


class TinyDLRM(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.top = nn.Linear(16, 1)

    def forward(self, kjt):
        return self.top(self.ebc(kjt).values()).squeeze(1)


def models(opt: OptimizerConfig):
    torch.manual_seed(0)
    ours = TinyDLRM(TritonEmbeddingBagCollection(tables(), opt, execution="torch"))
    theirs = TinyDLRM(EmbeddingBagCollection(tables()))
    theirs.load_state_dict(ours.state_dict(), strict=False)
    return ours, theirs


def touched_rows(kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    d = kjt.to_dict()
    out = {t: torch.zeros(r, dtype=torch.bool) for t, r in ROWS.items()}
    for f, t in (("f0", "t0"), ("f2", "t0"), ("f1", "t1")):
        out[t][d[f].values()] = True
    return out


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o.kind.value)
def test_three_steps_match_torchrec_ebc_and_reference_optimizer(opt):
    ours, theirs = models(opt)
    sgd_ours = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(ours.named_parameters())], lr=0.1)
    sgd_theirs = torch.optim.SGD(theirs.top.parameters(), lr=0.1)
    states = {t: R.init_state_ref(opt.kind, r, 4 if t == "t0" else 8) for t, r in ROWS.items()}
    for step in range(1, 4):
        kjt, y = make_kjt(seed=step), torch.randn(3)
        loss_ours = ((ours(kjt) - y) ** 2).mean()
        loss_theirs = ((theirs(kjt) - y) ** 2).mean()
        torch.testing.assert_close(loss_ours, loss_theirs, rtol=1e-6, atol=1e-6)
        sgd_ours.zero_grad()
        sgd_theirs.zero_grad()
        loss_ours.backward()
        loss_theirs.backward()
        sgd_ours.step()
        sgd_theirs.step()
        touched = touched_rows(kjt)
        with torch.no_grad():
            for t, bag in theirs.ebc.embedding_bags.items():
                bag.weight.copy_(R.apply_optimizer_ref(bag.weight, states[t], bag.weight.grad, touched[t],
                                                       opt, step))
                bag.weight.grad = None
    sd_ours, sd_theirs = ours.state_dict(), theirs.state_dict()
    for k, v in sd_theirs.items():
        torch.testing.assert_close(sd_ours[k], v, rtol=1e-5, atol=1e-6, msg=k)
    for t, state in states.items():
        for i, v in enumerate(state.values(), start=1):
            key = f"ebc.embedding_bags.{t}.momentum{i}"
            torch.testing.assert_close(sd_ours[key], v, rtol=1e-5, atol=1e-7, msg=key)


def test_dense_optimizer_filters_exclude_fused_weights():
    ours, _ = models(OPTS[0])
    dense = [n for n, _ in in_backward_optimizer_filter(ours.named_parameters())]
    assert dense == ["top.weight", "top.bias"]
    assert [n for n, _ in dense_named_parameters(ours)] == dense
    fused = [n for n, _ in in_backward_optimizer_filter(ours.named_parameters(), include=True)]
    assert fused == ["ebc.embedding_bags.t0.weight", "ebc.embedding_bags.t1.weight"]


def test_state_dict_layout_and_round_trip():
    ebc = TritonEmbeddingBagCollection(tables(), OPTS[0], execution="torch")
    ref = EmbeddingBagCollection(tables())
    sd = ebc.state_dict()
    assert set(ref.state_dict()) <= set(sd)
    assert set(sd) - set(ref.state_dict()) == {"tbe.step", "embedding_bags.t0.momentum1",
                                                "embedding_bags.t1.momentum1"}
    ebc.load_state_dict(ref.state_dict(), strict=False)  # torchrec weights load in place
    torch.testing.assert_close(ebc.tbe.split_embedding_weights()[1], ref.embedding_bags["t1"].weight)
    assert [c.name for c in ebc.embedding_bag_configs()] == ["t0", "t1"]


def test_views_follow_the_flat_buffers_after_apply():
    ebc = TritonEmbeddingBagCollection(tables(), OPTS[0], execution="torch")
    ebc._apply(lambda t: t.clone())  # what .to(device) does: new flat buffers
    w = ebc.embedding_bags["t1"].weight
    assert w.untyped_storage().data_ptr() == ebc.tbe.weight.untyped_storage().data_ptr()
    assert ebc.embedding_bags["t0"].momentum1.untyped_storage().data_ptr() == \
        ebc.tbe.momentum1.untyped_storage().data_ptr()


def test_output_layout_matches_torchrec():
    ours, theirs = models(OPTS[0])
    kjt = make_kjt(seed=5)
    kt_ours, kt_theirs = ours.ebc(kjt), theirs.ebc(kjt)
    assert kt_ours.keys() == kt_theirs.keys() == ["f0", "f2", "f1"]
    assert kt_ours.length_per_key() == kt_theirs.length_per_key()
    torch.testing.assert_close(kt_ours.values(), kt_theirs.values())


def test_out_of_range_id_names_the_feature():
    ebc = TritonEmbeddingBagCollection(tables(), OPTS[0], execution="torch")
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.tensor([1, 99, 2]),
                            lengths=torch.tensor([1, 0, 1, 0, 1, 0]))
    with pytest.raises(ValueError, match=r"f1 \(table 1, 7 rows\): id 99"):
        ebc(kjt)


def test_rejects_mixed_pooling_and_missing_features():
    from torchrec.modules.embedding_configs import PoolingType

    t = tables()
    t[1].pooling = PoolingType.MEAN
    with pytest.raises(ValueError, match="same pooling"):
        TritonEmbeddingBagCollection(t, execution="torch")
    ebc = TritonEmbeddingBagCollection(tables(), execution="torch")
    with pytest.raises(ValueError, match="lacks features"):
        ebc(KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1]), lengths=torch.tensor([1])))


def test_no_fbgemm_op_in_forward_or_backward():
    """torchrec cannot import without fbgemm_gpu, so prove no fbgemm op is *called* instead."""
    ours, _ = models(OPTS[0])
    kjt = make_kjt(seed=7)
    with OpRecorder() as control:
        make_kjt(seed=7).offsets()  # the recorder does see FBGEMM ops: torchrec's offsets() calls one
    assert any(op.startswith("fbgemm") for op in control.ops)
    with OpRecorder() as rec:
        ours(kjt).sum().backward()
    assert "aten.index_add_.default" in rec.ops  # the fused update ran under the recorder
    assert not [op for op in rec.ops if op.startswith("fbgemm")], sorted(set(rec.ops))
