"""Training-step throughput: anyrec's Trainer against a plain-PyTorch DLRM of the same shape.

    python benchmarks/train_step.py --small              # CPU-sized (seconds)
    python benchmarks/train_step.py                      # DLRMv2 shape: 26 x 1M x 128, batch 16384 (GPU)
    python benchmarks/train_step.py --small --no-compile --json out.json

Same batches (pre-generated, multi-hot, already on the device) for every contender, same MLPs,
DCNv2 interaction, Adagrad and fp32 everywhere:
  anyrec eager      Trainer.train_step: DMP (world size 1), fused TBE Adagrad in backward
  anyrec pipelined  the Trainer's TrainPipelineSparseDist loop
  torch eager       nn.EmbeddingBag tables (sparse grads) + Adagrad, the same dense modules
  torch compile     the same with torch.compile on everything after the lookups (inductor
                    cannot trace sparse-gradient EmbeddingBags)
Prints a table (samples/s and the ratio to plain eager) and writes JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from anyrec.config import AnyrecConfig, DataConfig, ModelConfig, OptimConfig, TrainerConfig  # noqa: E402
from anyrec.data.synthetic import SyntheticCriteo  # noqa: E402
from anyrec.models.interaction import CrossInteraction  # noqa: E402
from anyrec.models.mlp import MLP  # noqa: E402
from anyrec.schema import load_model_config  # noqa: E402

DLRMV2_HOT = load_model_config("dlrmv2").multi_hot  # MLPerf DLRMv2's ids per sample per feature


def shapes(small: bool) -> tuple[ModelConfig, int]:
    """The model and per-step batch: DLRMv2's architecture with 1M-row tables, or a CPU toy."""
    if small:
        return ModelConfig(name="bench_small", interaction="dcn", embedding_dim=16, table_rows=[2000] * 26,
                           multi_hot=[min(h, 4) for h in DLRMV2_HOT], bottom_mlp=[64, 16],
                           top_mlp=[64, 32, 1], dcn_num_layers=2, dcn_low_rank=32), 256
    return ModelConfig(name="bench_dlrmv2", interaction="dcn", embedding_dim=128, table_rows=[1_000_000] * 26,
                       multi_hot=DLRMV2_HOT, bottom_mlp=[512, 256, 128], top_mlp=[1024, 1024, 512, 256, 1],
                       dcn_num_layers=3, dcn_low_rank=512), 16384


class PlainDLRM(nn.Module):
    """DLRMv2 in plain PyTorch: one nn.EmbeddingBag per table, the same dense modules."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(r, cfg.embedding_dim, mode="sum", sparse=True)
                                    for r in cfg.table_rows)
        self.dense_arch = MLP(cfg.num_dense_features, cfg.bottom_mlp)
        self.interaction = CrossInteraction(len(cfg.table_rows), cfg.embedding_dim, cfg.dcn_num_layers,
                                            cfg.dcn_low_rank)
        self.over_arch = MLP(self.interaction.out_features, cfg.top_mlp, final_activation=False)
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.head = self.dense_part

    def dense_part(self, dense_BI, pooled_BFD, labels_B):
        logits_B = self.over_arch(self.interaction(self.dense_arch(dense_BI), pooled_BFD)).squeeze(-1)
        return self.loss_fn(logits_B, labels_B)

    def forward(self, dense_BI, ids, offsets, labels_B):
        pooled_BFD = torch.stack([t(i, o) for t, i, o in zip(self.tables, ids, offsets, strict=True)], dim=1)
        return self.head(dense_BI, pooled_BFD, labels_B)


def plain_inputs(batch, device):
    kjt = batch.sparse_features
    ids = [v.to(device) for v in torch.split(kjt.values(), kjt.length_per_key())]
    B = batch.dense_features.shape[0]
    lengths = kjt.lengths().view(len(ids), B)
    offsets = [torch.cat([torch.zeros(1, dtype=torch.long), lengths[f].long().cumsum(0)[:-1]]).to(device)
               for f in range(len(ids))]
    return batch.dense_features.to(device), ids, offsets, batch.labels.to(device)


def time_steps(step, n: int, warmup: int, sync) -> float:
    for i in range(warmup):
        step(i)
    sync()
    t0 = time.perf_counter()
    for i in range(n):
        step(warmup + i)
    sync()
    return time.perf_counter() - t0


def bench_plain(cfg: ModelConfig, batches, device, steps, warmup, compile_: bool, sync) -> float:
    torch.manual_seed(0)
    model = PlainDLRM(cfg).to(device)
    sparse = [p for n, p in model.named_parameters() if n.startswith("tables.")]
    dense = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    opts = [torch.optim.Adagrad(sparse, lr=0.01), torch.optim.Adagrad(dense, lr=0.01)]
    if compile_:  # inductor cannot trace sparse-gradient EmbeddingBags: compile everything after them
        model.head = torch.compile(model.dense_part)
    inputs = [plain_inputs(b, device) for b in batches]

    def step(i):
        for o in opts:
            o.zero_grad(set_to_none=True)
        model(*inputs[i % len(inputs)]).backward()
        for o in opts:
            o.step()

    return time_steps(step, steps, warmup, sync)


def bench_anyrec(cfg: ModelConfig, batch_size: int, batches, steps, warmup, pipelined: bool) -> float:
    from anyrec.trainer.trainer import Trainer

    trainer = Trainer(AnyrecConfig(
        model=cfg, data=DataConfig(batch_size=batch_size),
        optim=OptimConfig(name="adagrad", embedding_lr=0.01, dense_lr=0.01),
        trainer=TrainerConfig(steps=steps, eval_steps=0, progress=False, tensorboard=False,
                              pipeline=pipelined, mixed_precision="fp32")))
    try:
        sync = trainer.backend.synchronize
        # On the device already, like the plain contenders' inputs (no host-to-device copy timed).
        batches = [b.to(trainer.device) for b in batches]
        if not pipelined:
            return time_steps(lambda i: trainer.train_step(batches[i % len(batches)]), steps, warmup, sync)
        trainer.model.train()
        it = iter([batches[i % len(batches)] for i in range(warmup + steps)])
        return time_steps(lambda i: trainer.pipeline.progress(it), steps, warmup, sync)
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20 small, 50 full)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    from anyrec.backends import get_backend

    backend = get_backend("auto")
    device = backend.device(0)
    cfg, batch_size = shapes(args.small)
    batch_size = args.batch_size or batch_size
    steps = args.steps or (20 if args.small else 50)
    src = SyntheticCriteo(cfg, DataConfig(batch_size=batch_size), seed=0)
    batches = [src.batch(i) for i in range(min(8, steps + args.warmup))]

    results: dict[str, float] = {}
    sync = backend.synchronize
    for name, fn in [
        ("torch eager", lambda: bench_plain(cfg, batches, device, steps, args.warmup, False, sync)),
        ("torch compile", None if args.no_compile else
         lambda: bench_plain(cfg, batches, device, steps, args.warmup, True, sync)),
        ("anyrec eager", lambda: bench_anyrec(cfg, batch_size, batches, steps, args.warmup, False)),
        ("anyrec pipelined", lambda: bench_anyrec(cfg, batch_size, batches, steps, args.warmup, True)),
    ]:
        if fn is None:
            continue
        results[name] = steps * batch_size / fn()

    base = results["torch eager"]
    print(f"train step, {cfg.name}: {len(cfg.table_rows)} tables x {cfg.table_rows[0]} rows x "
          f"{cfg.embedding_dim}, batch {batch_size}, {backend.describe()}, {steps} steps")
    print(f"{'contender':<18}{'samples/s':>14}{'vs torch eager':>16}")
    for name, rate in results.items():
        print(f"{name:<18}{rate:>14,.0f}{rate / base:>15.2f}x")
    out = {"model": cfg.name, "batch_size": batch_size, "steps": steps, "device": backend.describe(),
           "samples_per_s": results, "ratio_vs_torch_eager": {k: v / base for k, v in results.items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
