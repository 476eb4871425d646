"""Run with the simdev plugin importable, as one process: the peak memory dlrmv4_small's dense part (fp32)
allocates on the simulated device through one forward and backward, above what was allocated before it,
against the memory model's activation peak for the same batch (`anyrec.planner.sequence.
hstu_memory_per_sample`). The embeddings read are leaves (no table gradient): the model's other terms are
the tables'. ATTENTION `torch` is the torch attention (its padded buffers hold the peak); `triton` a stand-in
that keeps what the Triton kernel keeps (q, k, v) and holds its workspace in the backward (twice the q, k, v
bytes: `ATTENTION_WORKSPACE_QKV`), so that the STU layer's other backward parts hold the peak. Prints one
JSON line: [{"batch", "tokens", "recompute", "attention", "measured", "modelled"}, ...].

Usage: hstu_peak_check.py BATCH:HISTORY:RECOMPUTE:ATTENTION... (every sample of HISTORY events and one
target; RECOMPUTE: selective or none)
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from anyrec.backends import get_backend
from anyrec.config import STURecompute
from anyrec.sequence_schema import NUM_CONTEXTUAL
from anyrec.kernels.hstu import hstu_attention_torch
from anyrec.models import hstu
from anyrec.models.dlrmv4 import dlrmv4_config, workload_facts
from anyrec.planner import sequence
from tests.conftest import compose_config
from tests.test_hstu_model import Batch, make_batch


class KeepsInputs(torch.autograd.Function):
    """The Triton attention's memory without its arithmetic: it saves q, k, v and its backward holds a
    workspace of their size beside dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return v * 1.0

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        workspace = torch.empty(q.numel() + k.numel() + v.numel(), dtype=q.dtype, device=q.device)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), grad * 1.0
        del workspace
        return dq, dk, dv


def keeps_inputs(q, k, v, offsets, max_len, num_heads, num_targets, num_contextual):
    return KeepsInputs.apply(q, k, v)


def main(jobs: list[str]) -> None:
    backend = get_backend("simdev")
    device = torch.device("simdev")
    _, cfg = compose_config(["model=dlrmv4_small"])
    shape = workload_facts(cfg.model).hstu
    fp32 = sequence.activation_dtypes(cpu=False, half=False)
    out = []
    for job in jobs:
        b, history, recompute, attention = job.split(":")
        batch, history = int(b), int(history)
        torch.manual_seed(0)
        model = hstu.build_dlrmv4(dlrmv4_config(cfg.model), device,
                                  hstu_attention_torch if attention == "torch" else keeps_inputs).train()
        for layer in model.dense_arch.layers:
            layer.selective_recompute = recompute == STURecompute.selective
        host = make_batch([history] * batch, [1] * batch)
        data = Batch(*(getattr(host, f.name).to(device) for f in dataclasses.fields(host)))
        with torch.no_grad():
            embeddings = model.sparse_arch(data.sparse_features)
        for jagged in embeddings.values():
            jagged.values().requires_grad_()
        before = backend.memory_allocated()
        backend.reset_peak_memory_stats()
        model.dense_arch(embeddings, data.actions, data.timestamps, data.num_targets).sum().backward()
        measured = backend.max_memory_allocated() - before
        del embeddings
        model.zero_grad(set_to_none=True)
        tokens = history + 1 + NUM_CONTEXTUAL  # every sample alike: mean, rms and longest
        planned = dataclasses.replace(shape, stu_recompute=STURecompute(recompute), mean_seq_len=tokens,
                                      rms_seq_len=tokens, longest_seq_len=tokens)
        m = sequence.hstu_memory_per_sample(planned, fp32, attention, False, tokens, batch)
        # the stand-in's parameters' gradients are the dense model's (the planner's dense_gradient term)
        grads = sum(p.numel() * p.element_size() for p in model.dense_arch.parameters())
        out.append({"batch": batch, "tokens": tokens, "recompute": recompute, "attention": attention,
                    "measured": measured - grads, "modelled": batch * m.activation})
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
