"""The memory model's per-token bytes of DLRMv4's dense part (anyrec.planner.sequence) against what autograd
actually saves of anyrec's layers (torch.autograd.graph.saved_tensors_hooks), on the CPU in fp32 and under
bf16 autocast, with the STU layers' selective recompute and without; and dlrmv4_small's planned sequence
lengths against its synthetic stream."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from anyrec.config import DataConfig, STURecompute
from anyrec.data.yambda_synthetic import SyntheticYambda
from anyrec.models import hstu
from anyrec.models.dlrmv4 import batch_schema, dlrmv4_config, workload_facts
from anyrec.planner import sequence
from anyrec.sequence_schema import NUM_CONTEXTUAL, SequenceDataConfig, SequenceSchema
from tests.conftest import compose_config
from tests.test_hstu_model import make_batch

# The model's bytes per token equal the measurement's (every term is counted): within a byte per token, so
# that the smallest tensor left out (a layer norm's statistics, 8 bytes a token) fails.
TOLERANCE_BYTES = 1.0


class KeepsInputs(torch.autograd.Function):
    """Stands in for the Triton attention: it saves q, k, v and the offsets, as that kernel does."""

    @staticmethod
    def forward(ctx, q, k, v, offsets):
        ctx.save_for_backward(q, k, v, offsets)
        return v * 1.0

    @staticmethod
    def backward(ctx, grad):
        return None, None, grad, None


def _attention(q, k, v, offsets, max_len, num_heads, num_targets, num_contextual):
    return KeepsInputs.apply(q, k, v, offsets)


@pytest.fixture(scope="module")
def small():
    """(config, HSTU shape, model) of dlrmv4_small, its STU layers recomputing (the default)."""
    _, cfg = compose_config(["model=dlrmv4_small"])
    m = dlrmv4_config(cfg.model)
    torch.manual_seed(0)
    return cfg, workload_facts(cfg.model).hstu, hstu.build_dlrmv4(m, torch.device("cpu"), _attention).train()


def _saved_bytes(model, history: list[int], half: bool) -> dict[str, int]:
    """Bytes of the distinct storages autograd saves in one forward of the dense part, by the module that
    saved them (preprocessor, each STU layer, the rest), parameters (and their casts' constant size) aside."""
    dense = model.dense_arch
    batch = make_batch(history, [1] * len(history))
    part, seen, by_part = ["input"], set(), {}
    parts = [("preprocessor", dense.preprocessor)] + [(f"layer{i}", m) for i, m in enumerate(dense.layers)]
    hooks = [h for name, m in parts for h in (
        m.register_forward_pre_hook(lambda *_, n=name: part.__setitem__(0, n)),
        m.register_forward_hook(lambda *_: part.__setitem__(0, "input")))]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            by_part[part[0]] = by_part.get(part[0], 0) + s.nbytes()
        return t

    embeddings = model.sparse_arch(batch.sparse_features)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
        dense(embeddings, batch.actions, batch.timestamps, batch.num_targets)
    for h in hooks:
        h.remove()
    return by_part


@pytest.mark.parametrize("recompute", [STURecompute.selective, STURecompute.none])
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16-autocast"])
def test_kept_bytes_per_token_match_what_autograd_saves(small, half, recompute):
    _, shape, model = small
    shape = dataclasses.replace(shape, stu_recompute=recompute)
    for layer in model.dense_arch.layers:
        layer.selective_recompute = recompute == STURecompute.selective
    # per token: the difference between two batches of the same samples, 160 positions longer each
    short, long = _saved_bytes(model, [10] * 4, half), _saved_bytes(model, [50] * 4, half)
    per_token = {k: (long[k] - short.get(k, 0)) / 160 for k in long}
    ab = sequence.activation_dtypes(cpu=True, half=half)
    modelled = {"preprocessor": sequence.preprocessor_bytes_per_position(shape, ab),
                "input": sequence.input_bytes_per_token(shape, ab)}
    modelled |= {f"layer{i}": sequence.stu_layer_kept_bytes_per_token(shape, ab, i)
                 for i in range(shape.num_layers)}
    assert set(per_token) == set(modelled)
    for k, measured in per_token.items():
        assert modelled[k] == pytest.approx(measured, abs=TOLERANCE_BYTES), k
    stu = sum(per_token[f"layer{i}"] for i in range(shape.num_layers))
    if recompute == STURecompute.none:  # the STU layers' share dominates what the stack keeps
        assert stu > 0.3 * sum(per_token.values())
    else:  # the input, U and the attention output: a fifth of what the layers keep without recompute
        assert stu < 0.25 * shape.num_layers * sequence.stu_kept_bytes_per_token(shape, ab)


def test_dlrmv4_small_lengths_are_its_streams(small):
    cfg, shape, _ = small
    fields = {**DataConfig().sequence, **cfg.data.sequence, "batch_size": cfg.data.batch_size}
    data = SequenceDataConfig(**fields)
    schema = batch_schema(cfg.model)  # the job's tables (model.hstu.table_scale), as its stream reads them
    stream = SyntheticYambda(SequenceSchema(dict(zip(schema.features, schema.table_rows, strict=True))), data,
                             seed=0)
    lengths = []
    for window in range(stream.num_windows() - 1):  # the windows the job trains on
        for i, batch in enumerate(stream.train_batches(window, 0)):
            lengths.append(batch.sequence_lengths().numpy())
            if i == 3:
                break
    tokens = np.concatenate(lengths).astype(float) + NUM_CONTEXTUAL
    assert tokens.mean() == pytest.approx(shape.mean_tokens, rel=0.03)
    assert np.sqrt((tokens ** 2).mean()) == pytest.approx(shape.rms_tokens, rel=0.03)
    assert tokens.max() == shape.longest_tokens <= shape.seq_len  # what a padding attention pads to
