"""DLRMv4 (models/hstu.py, hstu_layers.py, stu.py) at tiny sizes, over an inline padded-dense attention."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from anyrec.models.hstu import (
    CONTEXTUAL_FEATURES,
    SEQUENCE_FEATURES,
    DLRMv4,
    DLRMv4Config,
    build_dlrmv4,
    dlrmv4_flops_per_sample,
    masked_bce,
    table_configs,
)
from anyrec.models.hstu_layers import PositionalEncoder, positions
from anyrec.models.init import init_model

C = len(CONTEXTUAL_FEATURES)
ROWS = 50
HOUR = 3600


def dense_attention(q_NHA, k_NHA, v_NHV, offsets_B1, max_len, num_heads, num_targets_B, num_contextual):
    """generative-recommenders' pytorch HSTU attention: padded to [B, max_len], silu(q.k / sqrt(A)) / max_len,
    its causal, target-aware mask with contextual tokens, back to jagged."""
    B = offsets_B1.numel() - 1
    lengths_B = offsets_B1.diff()
    row_N = torch.repeat_interleave(torch.arange(B), lengths_B)
    col_N = torch.arange(q_NHA.shape[0]) - offsets_B1[:-1][row_N]

    def pad(x):
        out = x.new_zeros(B, max_len, *x.shape[1:])
        out[row_N, col_N] = x
        return out

    scores = torch.einsum("bihd,bjhd->bhij", pad(q_NHA), pad(k_NHA)) / math.sqrt(q_NHA.shape[-1])
    scores = F.silu(scores) / max_len
    ids = torch.arange(max_len).view(1, -1)
    max_ids = lengths_B.view(-1, 1)
    if num_contextual > 0:
        ids = (ids - num_contextual + 1).clamp(min=0)
        max_ids = max_ids - num_contextual + 1
    if num_targets_B is not None:
        max_ids = max_ids - num_targets_B.view(-1, 1)
        ids = torch.minimum(ids.expand(B, -1), max_ids)
    ids = ids.expand(B, -1)
    row, col = ids.unsqueeze(2), ids.unsqueeze(1)
    mask = torch.eye(max_len, dtype=torch.bool).unsqueeze(0) | (row - col > 0)
    if num_contextual > 0:
        mask = mask | ((row == 0) & (col < max_ids.unsqueeze(2)))
    out = torch.einsum("bhij,bjhd->bihd", scores * mask.unsqueeze(1).to(scores.dtype), pad(v_NHV))
    return out[row_N, col_N]


def tiny_config(**overrides) -> DLRMv4Config:
    rows = {f: ROWS for f in SEQUENCE_FEATURES + CONTEXTUAL_FEATURES}
    cfg = DLRMv4Config(name="tiny", table_rows=rows, table_dim=8, model_dim=16, preprocessor_hidden_dim=8,
                       action_dim=2, num_layers=2, num_heads=2, qk_dim=4, v_dim=4, position_buckets=64,
                       time_buckets=16, item_hidden_dim=8, head_hidden_dim=8, max_seq_len=64)
    return dataclasses.replace(cfg, **overrides)


@dataclasses.dataclass
class Batch:
    sparse_features: KeyedJaggedTensor
    actions: torch.Tensor
    timestamps: torch.Tensor
    num_targets: torch.Tensor
    labels: torch.Tensor


def make_batch(history: list[int], targets: list[int], seed: int = 0, ids: dict | None = None,
               actions: torch.Tensor | None = None) -> Batch:
    """A ragged batch: sample b has history[b] events then targets[b] candidates (at the anchor time).
    `ids`: per feature, values to use instead of random ones."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(history) + torch.tensor(targets)
    T, B = int(lengths.sum()), len(history)
    ids = ids or {}
    values = {f: ids.get(f, torch.randint(0, ROWS, (T,), generator=g)) for f in SEQUENCE_FEATURES}
    values |= {f: ids.get(f, torch.randint(0, ROWS, (B,), generator=g)) for f in CONTEXTUAL_FEATURES}
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(SEQUENCE_FEATURES + CONTEXTUAL_FEATURES),
        values=torch.cat([values[f] for f in SEQUENCE_FEATURES + CONTEXTUAL_FEATURES]),
        lengths=torch.cat([lengths] * len(SEQUENCE_FEATURES) + [torch.ones(B, dtype=torch.int64)] * C))
    stamps = []
    for h, t in zip(history, targets, strict=True):
        anchor = 1_700_000_000 + int(torch.randint(0, 7 * 24 * HOUR, (1,), generator=g))
        past = torch.sort(torch.randint(60, 30 * 24 * HOUR, (h,), generator=g), descending=True).values
        stamps.append(torch.cat([anchor - past, torch.full((t,), anchor)]))
    if actions is None:
        actions = torch.randint(0, 8, (T,), generator=g)
    labels = torch.randint(0, 2, (sum(targets),), generator=g).float()
    return Batch(kjt, actions, torch.cat(stamps), torch.tensor(targets), labels)


def build(seed: int = 0, **overrides) -> DLRMv4:
    torch.manual_seed(seed)
    return build_dlrmv4(tiny_config(**overrides), torch.device("cpu"), dense_attention)


HISTORY, TARGETS = [0, 1, 5, 7], [1, 1, 3, 1]  # empty history, length 2, several targets, plain


def stack_output(model: DLRMv4, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, the STU stack's output [N, D]) of an eval-mode forward."""
    seen = []
    handle = model.dense_arch.layers[-1].register_forward_hook(lambda m, args, out: seen.append(out))
    with torch.no_grad():
        _, (logits, _) = model(batch)
    handle.remove()
    return logits, seen[0]


def token(sample: int, position: int) -> int:
    """Index in the stack's output of sequence position `position` of `sample` (contextual tokens first)."""
    lengths = [h + t for h, t in zip(HISTORY, TARGETS, strict=True)]
    return sum(lengths[:sample]) + C * sample + C + position


def test_shapes_loss_and_backward_reach_every_parameter():
    model = build().train()
    batch = make_batch(HISTORY, TARGETS)
    loss, (logits, labels) = model(batch)
    assert logits.shape == (sum(TARGETS),) and logits.dtype == torch.float32 and labels is batch.labels
    assert torch.isfinite(loss) and loss.item() > 0
    assert loss.item() == pytest.approx(0.2 * F.binary_cross_entropy_with_logits(logits, labels).item(),
                                        rel=1e-6)
    loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert no_grad == []
    assert sum(1 for _ in model.named_parameters()) > 40


def test_reference_sizes():
    """The reference's shapes: UVQK 512 -> 4 x (2 x 128 + 2 x 128), output 3 x 4 x 128 -> 512, the
    postprocessor 516 -> 512, item MLP 1536 -> 512 -> 512, head 512 -> 512 -> 1, tables as listed."""
    model = build_dlrmv4(DLRMv4Config(), torch.device("meta"), dense_attention)
    dense = model.dense_arch
    assert len(dense.layers) == 3
    assert dense.layers[0].uvqk_weight.shape == (512, 2048)
    assert dense.layers[0].output_weight.shape == (1536, 512)
    assert dense.postprocessor.combine.weight.shape == (512, 516)
    assert [m.weight.shape for m in dense.item_mlp if isinstance(m, torch.nn.Linear)] == [(512, 1536),
                                                                                          (512, 512)]
    assert [m.weight.shape for m in dense.head if isinstance(m, torch.nn.Linear)] == [(512, 512), (1, 512)]
    assert dense.positional.position_table.shape == (8192, 512)
    assert dense.positional.time_table.shape == (2049, 512)
    assert dense.preprocessor.action_encoder.out_features == 24
    assert (dense.input_dropout, dense.layers[0].dropout) == (0.2, 0.1)
    assert sum(t.num_embeddings for t in table_configs(DLRMv4Config())) == 293_051_712


def test_attention_gets_the_jagged_layout():
    calls = []

    def recording(q, k, v, offsets, max_len, num_heads, num_targets, num_contextual):
        calls.append((q.shape, v.shape, offsets.tolist(), max_len, num_heads, num_targets.tolist(),
                      num_contextual))
        return dense_attention(q, k, v, offsets, max_len, num_heads, num_targets, num_contextual)

    torch.manual_seed(0)
    model = build_dlrmv4(tiny_config(), torch.device("cpu"), recording).eval()
    model(make_batch(HISTORY, TARGETS))
    lengths = [h + t + C for h, t in zip(HISTORY, TARGETS, strict=True)]
    offsets = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    # scores are divided by the configured longest sequence, whatever the batch's longest
    cfg = tiny_config()
    assert max(lengths) < cfg.max_seq_len
    assert calls == [((offsets[-1], 2, 4), (offsets[-1], 2, 4), offsets, cfg.max_seq_len, 2, TARGETS, 0)] * 2


def test_a_sample_scores_the_same_whatever_else_is_in_its_batch():
    """The same sample alone and beside longer ones gives the same logits (world sizes and serving
    batches split samples differently)."""
    model = build().eval()
    both = make_batch([3, 7, 0], [2, 1, 1])  # sample 0 (5 positions) beside a longer one
    kjt = both.sparse_features
    first = {f: kjt[f].values()[:5 if f in SEQUENCE_FEATURES else 1] for f in kjt.keys()}
    alone = make_batch([3], [2], ids=first, actions=both.actions[:5])
    alone.timestamps.copy_(both.timestamps[:5])
    with torch.no_grad():
        logits_alone, logits_both = model(alone)[1][0], model(both)[1][0]
    torch.testing.assert_close(logits_alone, logits_both[:2], rtol=1e-5, atol=1e-6)


def test_causal_and_target_aware():
    """A later history event changes no earlier position; a target changes no other target and no
    history; nothing crosses samples."""
    model = build().eval()
    base = make_batch(HISTORY, TARGETS)
    logits0, out0 = stack_output(model, base)
    item = base.sparse_features["item_id"].values().clone()
    j = sum(h + t for h, t in zip(HISTORY[:3], TARGETS[:3], strict=True)) + 4  # sample 3, history 4
    item[j] = (item[j] + 1) % ROWS
    logits1, out1 = stack_output(model, make_batch(HISTORY, TARGETS, ids={"item_id": item}))
    before, at = token(3, 0), token(3, 4)
    assert torch.equal(out0[:before - C], out1[:before - C])  # the other samples
    assert torch.equal(out0[before - C:at], out1[before - C:at])  # its contextual tokens and history 0..3
    assert (out0[at:token(3, 8)] != out1[at:token(3, 8)]).any(dim=1).all()  # history 4.., its target
    assert torch.equal(logits0[:-1], logits1[:-1]) and logits0[-1] != logits1[-1]

    item = base.sparse_features["item_id"].values().clone()
    j = sum(h + t for h, t in zip(HISTORY[:2], TARGETS[:2], strict=True)) + 5 + 1  # sample 2, target 1
    item[j] = (item[j] + 1) % ROWS
    logits2, out2 = stack_output(model, make_batch(HISTORY, TARGETS, ids={"item_id": item}))
    assert torch.equal(out0[:token(2, 6)], out2[:token(2, 6)])
    assert torch.equal(out0[token(2, 7):], out2[token(2, 7):])
    assert (out0[token(2, 6)] != out2[token(2, 6)]).any()
    changed = (logits0 != logits2).nonzero().flatten().tolist()
    assert changed == [3]  # targets: sample 0, 1, then sample 2's three (2, 3, 4), then sample 3


def test_contextual_tokens_reach_every_position():
    model = build().eval()
    base = make_batch(HISTORY, TARGETS)
    _, out0 = stack_output(model, base)
    uid = base.sparse_features["uid"].values().clone()
    uid[2] = (uid[2] + 1) % ROWS
    _, out1 = stack_output(model, make_batch(HISTORY, TARGETS, ids={"uid": uid}))
    assert (out0[token(2, 0):token(2, 8)] != out1[token(2, 0):token(2, 8)]).any(dim=1).all()
    assert torch.equal(out0[:token(2, 0) - C], out1[:token(2, 0) - C])
    assert torch.equal(out0[token(3, 0) - C:], out1[token(3, 0) - C:])


@pytest.mark.parametrize("sees_history", [False, True])
def test_contextual_tokens_see_the_history_only_when_asked(sees_history):
    model = build(contextual_sees_history=sees_history).eval()
    base = make_batch(HISTORY, TARGETS)
    _, out0 = stack_output(model, base)
    item = base.sparse_features["item_id"].values().clone()
    item[-2] = (item[-2] + 1) % ROWS  # sample 3's last history event
    _, out1 = stack_output(model, make_batch(HISTORY, TARGETS, ids={"item_id": item}))
    contextual = slice(token(3, 0) - C, token(3, 0))
    assert torch.equal(out0[contextual], out1[contextual]) != sees_history


def test_targets_action_bits_are_not_read():
    model = build().eval()
    base = make_batch(HISTORY, TARGETS)
    logits0, _ = stack_output(model, base)
    ends = torch.tensor(HISTORY) + torch.tensor(TARGETS)
    last = torch.cumsum(ends, 0) - 1  # each sample's last target
    actions = base.actions.clone()
    actions[last] = actions[last] ^ 7
    logits1, _ = stack_output(model, make_batch(HISTORY, TARGETS, actions=actions))
    assert torch.equal(logits0, logits1)
    actions = base.actions.clone()
    actions[last[-1] - 1] ^= 1  # sample 3's last history event
    logits2, _ = stack_output(model, make_batch(HISTORY, TARGETS, actions=actions))
    assert torch.equal(logits0[:-1], logits2[:-1]) and logits0[-1] != logits2[-1]


def test_heads_read_the_targets():
    """The postprocessor gets the stack's output at each target, the item MLP the target's three ids'
    embeddings, in order."""
    model = build().eval()
    batch = make_batch(HISTORY, TARGETS)
    seen = {}
    hooks = [model.dense_arch.postprocessor.register_forward_hook(lambda m, a, o: seen.update(user=a[0])),
             model.dense_arch.item_mlp.register_forward_hook(lambda m, a, o: seen.update(item=a[0]))]
    _, out = stack_output(model, batch)
    for h in hooks:
        h.remove()
    at = [token(b, h + k) for b, (h, t) in enumerate(zip(HISTORY, TARGETS, strict=True)) for k in range(t)]
    assert torch.equal(seen["user"], out[at])
    ends = torch.cumsum(torch.tensor(HISTORY) + torch.tensor(TARGETS), 0)
    rows = [int(e) - t + k for e, t in zip(ends, TARGETS, strict=True) for k in range(t)]
    ids = {f: batch.sparse_features[f].values()[rows] for f in SEQUENCE_FEATURES}
    tables = model.sparse_arch.embeddings
    want = torch.cat([tables[f].weight[ids[f]] for f in SEQUENCE_FEATURES], dim=-1)
    assert torch.equal(seen["item"], want)


def test_candidate_time_of_day_reaches_its_logit():
    """Shifting a sample's clock by an hour keeps every time difference (positions and time buckets), so
    only the postprocessor's hour-of-day feature sees it."""
    model = build().eval()
    batch = make_batch(HISTORY, TARGETS)
    logits0, out0 = stack_output(model, batch)
    first = sum(h + t for h, t in zip(HISTORY[:3], TARGETS[:3], strict=True))
    batch.timestamps = batch.timestamps.clone()
    batch.timestamps[first:] += HOUR
    logits1, out1 = stack_output(model, batch)
    assert torch.equal(out0, out1)
    assert torch.equal(logits0[:-1], logits1[:-1]) and logits0[-1] != logits1[-1]


def test_positions_and_time_buckets():
    # one sample: 2 contextual, 3 history, 2 targets
    pos = positions(torch.arange(7), torch.full((7,), 7), torch.full((7,), 2), 2)
    assert pos.tolist() == [0, 1, 5, 4, 3, 2, 2]
    enc = PositionalEncoder(position_buckets=4, time_buckets=3, dim=2)
    with torch.no_grad():
        enc.position_table.zero_()
        enc.time_table.copy_(torch.arange(4.0).view(4, 1).expand(4, 2))
    minutes = torch.tensor([0, 1, 4, 9, 10_000])
    out = enc(torch.zeros(5, 2), torch.tensor([0, 1, 2, 3, 9]), 1000 - minutes * 60, torch.full((5,), 1000))
    assert out[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 3.0]  # floor(sqrt(minutes)), capped


def test_determinism_and_plan_invariant_init():
    a, b = build(seed=0), build(seed=0)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    batch = make_batch(HISTORY, TARGETS)
    torch.manual_seed(5)
    loss_a, _ = a.train()(batch)
    torch.manual_seed(5)
    loss_b, _ = b.train()(batch)
    assert torch.equal(loss_a, loss_b)
    c, d = build(seed=1), build(seed=2)
    tables = table_configs(tiny_config())
    for m in (c, d):
        init_model(m, tables, seed=7, ebc_path="sparse_arch", collection="embeddings")
    sc, sd = c.state_dict(), d.state_dict()
    assert all(torch.equal(sc[k], sd[k]) for k in sc)
    assert "sparse_arch.embeddings.item_id.weight" in sc
    init_model(d, tables, seed=8, ebc_path="sparse_arch", collection="embeddings")
    sd = d.state_dict()
    assert not torch.equal(sc["sparse_arch.embeddings.uid.weight"], sd["sparse_arch.embeddings.uid.weight"])
    assert not torch.equal(sc["dense_arch.layers.1.uvqk_weight"], sd["dense_arch.layers.1.uvqk_weight"])


def test_dropout_only_in_training():
    model = build()
    batch = make_batch(HISTORY, TARGETS)
    model.eval()
    assert torch.equal(model(batch)[0], model(batch)[0])
    model.train()
    assert not torch.equal(model(batch)[0], model(batch)[0])
    model.train()
    model.dense_arch.input_dropout = 0.0
    for layer in model.dense_arch.layers:
        layer.dropout = 0.0
    assert torch.equal(model(batch)[0], model(batch)[0])


def test_bf16_autocast_on_cpu():
    model = build().train()
    batch = make_batch(HISTORY, TARGETS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, (logits, _) = model(batch)
    assert logits.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()


def test_flops_match_the_reference():
    """315.7 GFLOP per sample at S = 4,096: attention 180.4, UVQK 77.3, output 58.0 (the STU stack)."""
    f = dlrmv4_flops_per_sample(DLRMv4Config(), 4096)
    for got, want in ((f.attention, 180.4e9), (f.uvqk, 77.3e9), (f.output, 58.0e9), (f.stu, 315.7e9)):
        assert got == pytest.approx(want, rel=0.01)
    assert 0 < f.other < 0.1 * f.stu and f.total == f.stu + f.other
    assert dlrmv4_flops_per_sample(DLRMv4Config(), 2048).attention == pytest.approx(f.attention / 4)


def test_masked_bce():
    logits, labels = torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0])
    want = 0.2 * (math.log(2) + math.log(1 + math.e ** 2)) / 2
    assert masked_bce(logits, labels, 0.2).item() == pytest.approx(want)
    assert masked_bce(torch.zeros(0), torch.zeros(0), 0.2).item() == 0.0


def test_padding_samples_add_no_logits_and_change_none():
    """Samples with no positions and no target (an eval window's last batch is padded with them) give no
    logit and leave the others' logits, loss and gradients as they are, wherever they sit."""
    model = build().eval()
    plain = make_batch([3, 7], [1, 1], seed=4)
    kjt = plain.sparse_features
    ids = {f: kjt[f].values() for f in SEQUENCE_FEATURES}
    zero = torch.zeros(1, dtype=torch.int64)
    ids |= {f: torch.cat([zero, kjt[f].values()[:1], zero, kjt[f].values()[1:], zero])
            for f in CONTEXTUAL_FEATURES}
    padded = make_batch([0, 3, 0, 7, 0], [0, 1, 0, 1, 0], ids=ids, actions=plain.actions)
    padded.timestamps.copy_(plain.timestamps)
    padded.labels = plain.labels
    with torch.no_grad():
        loss_plain, (logits_plain, _) = model(plain)
        loss_padded, (logits_padded, _) = model(padded)
    assert logits_padded.shape == (2,)
    torch.testing.assert_close(logits_padded, logits_plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_padded, loss_plain, rtol=1e-5, atol=1e-7)
    model.train()
    only_padding = make_batch([0, 0], [0, 0])
    loss, (logits, labels) = model(only_padding)
    assert logits.shape == labels.shape == (0,) and loss.item() == 0.0
    loss.backward()  # a rank whose whole batch is padding still takes part in the step


@pytest.mark.parametrize("history, targets, match", [
    ([2, 3], [1, 1], "between 0 \\(a padding sample\\) and"),
    ([2, 3], [1, 1], "labels have shape"),
    ([60, 1], [1, 1], "exceeds max_seq_len"),
])
def test_bad_batches_fail_in_one_line(history, targets, match):
    model = build().eval()
    batch = make_batch(history, targets)
    if match == "labels have shape":
        batch.labels = batch.labels[:1]
    if match.startswith("between"):
        batch.num_targets = torch.tensor([1, 5])  # more targets than sample 1's 4 positions
    with pytest.raises(ValueError, match=match):
        model(batch)


def test_bad_batch_shapes_and_configs():
    model = build().eval()
    batch = make_batch(HISTORY, TARGETS)
    batch.actions = batch.actions[:-1]
    with pytest.raises(ValueError, match="actions has shape"):
        model(batch)
    with pytest.raises(ValueError, match="table_rows must name exactly"):
        build(table_rows={"item_id": 5})
    with pytest.raises(ValueError, match="stu_dropout"):
        build(stu_dropout=1.0)
