"""Run with the simdev plugin importable, as one process: the peak memory dlrmv4_small's dense part (the
torch attention, fp32) allocates on the simulated device through one forward and backward, above what was
allocated before it, against the memory model's activation peak for the same batch
(`anyrec.planner.sequence.hstu_memory_per_sample`). The embeddings read are leaves (no table gradient):
the model's other terms are the tables'. Prints one JSON line: [{"batch", "tokens", "recompute",
"measured", "modelled"}, ...].

Usage: hstu_peak_check.py BATCH:HISTORY:RECOMPUTE... (every sample of HISTORY events and one target;
RECOMPUTE: selective or none)
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


def main(jobs: list[str]) -> None:
    backend = get_backend("simdev")
    device = torch.device("simdev")
    _, cfg = compose_config(["model=dlrmv4_small"])
    shape = workload_facts(cfg.model).hstu
    torch.manual_seed(0)
    model = hstu.build_dlrmv4(dlrmv4_config(cfg.model), device, hstu_attention_torch).train()
    fp32 = sequence.activation_dtypes(cpu=False, half=False)
    out = []
    for job in jobs:
        b, history, recompute = job.split(":")
        batch, history = int(b), int(history)
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
        m = sequence.hstu_memory_per_sample(planned, fp32, "torch", False, tokens, batch)
        out.append({"batch": batch, "tokens": tokens, "recompute": recompute, "measured": measured,
                    "modelled": batch * m.activation})
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
