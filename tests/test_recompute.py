"""The STU layer's selective recompute (anyrec.models.recompute): the same loss and gradients as the layer
that keeps everything, bit for bit on the CPU, dropout included, while keeping less; and its config switch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from anyrec.config import STURecompute, parse_stu_recompute
from anyrec.kernels.hstu import hstu_attention_torch
from anyrec.models.dlrmv4 import dlrmv4_config
from anyrec.models.hstu import DLRMv4Config
from anyrec.models.recompute import recompute_saved, recomputed
from tests.conftest import compose_config
from tests.test_hstu_model import HISTORY, TARGETS, build, dense_attention, make_batch


def _step(recompute: STURecompute, attention, half: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, every parameter's gradient) of one training step of the tiny model, dropout on."""
    model = build(seed=3, stu_recompute=recompute, stu_dropout=0.3, input_dropout=0.2)
    for layer in model.dense_arch.layers:
        layer.attention = attention
    batch = make_batch(HISTORY, TARGETS, seed=1)
    torch.manual_seed(11)  # the dropout masks
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
        loss, _ = model.train()(batch)
    torch.manual_seed(99)  # the backward must replay the forward's masks, not draw from here
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(("attention", "half"), [(hstu_attention_torch, False), (dense_attention, True)],
                         ids=["torch-fp32", "dense-bf16-autocast"])
def test_selective_recompute_gives_the_plain_layers_loss_and_gradients_bit_for_bit(attention, half):
    plain_loss, plain = _step(STURecompute.none, attention, half)
    loss, grads = _step(STURecompute.selective, attention, half)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain.keys()
    stu = [n for n in grads if ".layers." in n]
    assert len(stu) == 14 and all(plain[n] is not None and plain[n].abs().sum() > 0 for n in stu)
    for name, grad in grads.items():
        assert grad is not None and torch.equal(grad, plain[name]), name


def test_a_recomputed_output_is_saved_as_a_note_and_run_once_more():
    """What later ops save of a recomputed output is not kept; the backward runs the function once more
    (once, for the notes and its own gradient), and the gradients are the plain ones."""
    calls = []

    def fn(x, w):
        calls.append(1)
        return torch.tanh(x) * w

    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = recomputed(fn, x, w)
    with recompute_saved(y):
        loss = (y[:, :2] * y[:, 2:]).sum()  # mul saves both views of y
    assert {t.data_ptr() for t in saved} == {x.data_ptr(), w.data_ptr()}  # the inputs only
    loss.backward()
    assert len(calls) == 2
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    y = torch.tanh(x) * w
    (y[:, :2] * y[:, 2:]).sum().backward()
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)


def test_the_switch_is_a_closed_choice_on_by_default():
    assert DLRMv4Config().stu_recompute == STURecompute.selective
    assert all(layer.selective_recompute for layer in build().dense_arch.layers)
    _, off = compose_config(["model=dlrmv4_small", "model.hstu.stu_recompute=none"])
    assert dlrmv4_config(off.model).stu_recompute == STURecompute.none
    keeps_all = build(stu_recompute=STURecompute.none).dense_arch.layers
    assert not any(layer.selective_recompute for layer in keeps_all)
    assert parse_stu_recompute("Selective") == STURecompute.selective
    unset = {k: v for k, v in off.model.hstu.items() if k != "stu_recompute"}
    default = dataclasses.replace(off.model, hstu=unset)
    assert dlrmv4_config(default).stu_recompute == STURecompute.selective
    bad = dataclasses.replace(off.model, hstu={**off.model.hstu, "stu_recompute": "full"})
    with pytest.raises(ValueError, match=r"^model.hstu.stu_recompute='full': choose selective or none$"):
        dlrmv4_config(bad)
