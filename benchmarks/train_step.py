"""Training-step throughput: anyrec's Trainer against a plain-PyTorch DLRM of the same shape.

    python benchmarks/train_step.py --small              # CPU-sized (seconds)
    python benchmarks/train_step.py                      # DLRMv2 shape: 26 x 1M x 128, batch 16384 (GPU)
    python benchmarks/train_step.py --small --no-compile --json out.json
    python benchmarks/train_step.py --model dlrmv2_small --batch-size 1024 --no-compile --repeats 3
    python benchmarks/train_step.py --embedding-kernel triton   # one device, anyrec's Triton TBE (no FBGEMM)

Same batches (pre-generated, multi-hot, already on the device) for every contender, same MLPs,
DCNv2 interaction, Adagrad and fp32 everywhere:
  anyrec eager      Trainer.run_steps, eager: DMP (world size 1), fused TBE Adagrad in backward
  anyrec pipelined  Trainer.run_steps through torchrec's TrainPipelineSparseDist
  torch eager       nn.EmbeddingBag tables (sparse grads) + Adagrad, the same dense modules
  torch compile     the same with torch.compile on everything after the lookups (inductor
                    cannot trace sparse-gradient EmbeddingBags)
  anyrec loop       Trainer.train(): the real loop with its real data source (synthetic batches made
                    on the device as it trains), input validation, loss checks and logging included
The pipelined step and the whole loop run alternately `--repeats` times (shared machines are noisy);
each pair's loop/step ratio is reported, the table shows the medians.
Prints a table (samples/s and the ratio to plain eager) and writes JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from anyrec.config import (
    AnyrecConfig,
    BackendConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainerConfig,
)
from anyrec.data.synthetic import SyntheticCriteo
from anyrec.models.interaction import CrossInteraction
from anyrec.models.mlp import MLP
from anyrec.schema import load_model_config

DLRMV2_HOT = load_model_config("dlrmv2").multi_hot  # MLPerf DLRMv2's ids per sample per feature


def named_model(name: str) -> ModelConfig:
    """`model=NAME` as the trainer composes it (configs/model/NAME.yaml with its defaults: dlrmv2_small
    takes DLRMv2's multi-hot sizes and dense features from dlrmv2.yaml)."""
    from anyrec._hydra import compose_job
    from anyrec.config import config_dir

    if not (config_dir() / "model" / f"{name}.yaml").is_file():
        raise SystemExit(f"train_step.py: error: no model config {config_dir() / 'model' / f'{name}.yaml'}")
    return compose_job([f"model={name}"]).model


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


CPU_SECONDS: dict[str, float] = {}  # process CPU time of the last timed run, by contender


def time_steps(step, n: int, warmup: int, sync, name: str = "") -> float:
    for i in range(warmup):
        step(i)
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(n):
        step(warmup + i)
    sync()
    CPU_SECONDS[name] = time.process_time() - c0
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


def anyrec_trainer(cfg: ModelConfig, batch_size: int, steps: int, pipelined: bool = True,
                   kernel: str = "auto"):
    from anyrec.trainer.trainer import Trainer

    return Trainer(AnyrecConfig(
        model=cfg, data=DataConfig(batch_size=batch_size), backend=BackendConfig(embedding_kernel=kernel),
        optim=OptimConfig(name="adagrad", embedding_lr=0.01, dense_lr=0.01),
        trainer=TrainerConfig(steps=steps, eval_steps=0, progress=False, tensorboard=False,
                              pipeline=pipelined, mixed_precision="fp32")))


def bench_loop(cfg: ModelConfig, batch_size: int, steps: int, warmup: int, kernel: str) -> float:
    """Seconds of `steps` steps of Trainer.train() after `warmup` steps of it (its own timer)."""
    trainer = anyrec_trainer(cfg, batch_size, warmup, kernel=kernel)
    try:
        trainer.train()
        trainer.steps = warmup + steps  # train() runs on to the new end
        c0 = time.process_time()
        summary = trainer.train()
        CPU_SECONDS["anyrec loop"] = time.process_time() - c0
        assert summary["steps"] == warmup + steps
        return summary["elapsed_s"]
    finally:
        trainer.close()


HOST_SYNC_OPS = ("aten::_local_scalar_dense", "c10d::allreduce_", "c10d::broadcast_", "c10d::allgather_")


def profile_loop(cfg: ModelConfig, batch_size: int, steps: int, warmup: int, kernel: str,
                 rows: int = 12) -> dict:
    """torch.profiler (CPU) over `steps` steady-state steps of Trainer.train(): the top ops by self
    time and how often anything reads a device value on the host or runs a collective."""
    trainer = anyrec_trainer(cfg, batch_size, warmup, kernel=kernel)
    try:
        trainer.train()
        trainer.steps = warmup + steps  # train() runs on to the new end
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            trainer.train()
    finally:
        trainer.close()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=rows))
    counts = {name: sum(e.count for e in averages if e.key == name) for name in HOST_SYNC_OPS}
    print(f"host reads / collectives in {steps} steps + run end: " +
          ", ".join(f"{k} {v}" for k, v in counts.items()))
    return {"steps": steps, "host_sync_ops": counts}


def bench_anyrec(cfg: ModelConfig, batch_size: int, batches, steps, warmup, pipelined: bool,
                 kernel: str) -> float:
    """Seconds of `steps` steps of Trainer.run_steps (the training loop) over the pre-made batches,
    after `warmup` steps of it; eager or through torchrec's pipeline."""
    name = "anyrec pipelined" if pipelined else "anyrec eager"
    trainer = anyrec_trainer(cfg, batch_size, warmup + steps, pipelined, kernel)
    try:
        # On the device already, like the plain contenders' inputs (no host-to-device copy timed).
        batches = [b.to(trainer.device) for b in batches]
        cycled = (batches[i % len(batches)] for i in range(warmup + steps))
        trainer.run_steps(warmup, cycled)  # ends with the device drained
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.run_steps(steps, cycled)
        CPU_SECONDS[name] = time.process_time() - c0
        return time.perf_counter() - t0
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes")
    parser.add_argument("--model", default=None, help="a model config name instead (e.g. dlrmv2_small)")
    parser.add_argument("--repeats", type=int, default=1, help="alternating pipelined/loop pairs")
    parser.add_argument("--distinct-batches", type=int, default=8,
                        help="pre-generated batches, cycled (the loop never repeats one: for a like-for-like "
                             "loop/step ratio pass at least steps + warmup)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20 small, 50 full)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--profile", action="store_true", help="only profile the whole loop's steady state")
    parser.add_argument("--embedding-kernel", default="auto",
                        help="anyrec's embedding kernel (backend.embedding_kernel): auto | fbgemm | triton | "
                             "torch; triton/torch run the one-device unsharded path")
    args = parser.parse_args(argv)
    from anyrec.backends import get_backend

    backend = get_backend("auto")
    device = backend.device(0)
    cfg, batch_size = shapes(args.small)
    if args.model:
        cfg = named_model(args.model)
    batch_size = args.batch_size or batch_size
    steps = args.steps or (20 if args.small else 50)
    if args.profile:
        return profile_loop(cfg, batch_size, steps, args.warmup, args.embedding_kernel)
    src = SyntheticCriteo(cfg, DataConfig(batch_size=batch_size), seed=0)
    batches = [src.batch(i) for i in range(min(args.distinct_batches, steps + args.warmup))]

    results: dict[str, float] = {}
    sync = backend.synchronize
    for name, fn in [
        ("torch eager", lambda: bench_plain(cfg, batches, device, steps, args.warmup, False, sync)),
        ("torch compile", None if args.no_compile else
         lambda: bench_plain(cfg, batches, device, steps, args.warmup, True, sync)),
        ("anyrec eager", lambda: bench_anyrec(cfg, batch_size, batches, steps, args.warmup, False,
                                                args.embedding_kernel)),
    ]:
        if fn is not None:
            results[name] = steps * batch_size / fn()
    pairs = []
    for _ in range(max(1, args.repeats)):
        step_rate = steps * batch_size / bench_anyrec(cfg, batch_size, batches, steps, args.warmup, True,
                                                      args.embedding_kernel)
        loop_s = bench_loop(cfg, batch_size, steps, args.warmup, args.embedding_kernel)
        loop_rate = steps * batch_size / loop_s
        pairs.append({"anyrec pipelined": step_rate, "anyrec loop": loop_rate,
                      "loop/step": loop_rate / step_rate,
                      # CPU seconds per step: robust to other processes sharing the machine
                      "loop/step cpu": CPU_SECONDS["anyrec pipelined"] / CPU_SECONDS["anyrec loop"]})
    for name in ("anyrec pipelined", "anyrec loop"):
        results[name] = statistics.median(p[name] for p in pairs)
    loop_vs_step = statistics.median(p["loop/step"] for p in pairs)
    loop_vs_step_cpu = statistics.median(p["loop/step cpu"] for p in pairs)

    base = results["torch eager"]
    print(f"train step, {cfg.name}: {len(cfg.table_rows)} tables x {cfg.table_rows[0]} rows x "
          f"{cfg.embedding_dim}, batch {batch_size}, {backend.describe()}, {steps} steps")
    print(f"{'contender':<18}{'samples/s':>14}{'vs torch eager':>16}")
    for name, rate in results.items():
        print(f"{name:<18}{rate:>14,.0f}{rate / base:>15.2f}x")
    print(f"loop/step (anyrec loop / anyrec pipelined, median of {len(pairs)}): {loop_vs_step:.3f}  "
          f"[{', '.join(format(p['loop/step'], '.3f') for p in pairs)}]")
    print(f"loop/step by process CPU time (median of {len(pairs)}): {loop_vs_step_cpu:.3f}  "
          f"[{', '.join(format(p['loop/step cpu'], '.3f') for p in pairs)}]")
    out = {"model": cfg.name, "batch_size": batch_size, "steps": steps, "device": backend.describe(),
           "embedding_kernel": args.embedding_kernel,
           "samples_per_s": results, "ratio_vs_torch_eager": {k: v / base for k, v in results.items()},
           "loop_vs_step": loop_vs_step, "loop_vs_step_cpu": loop_vs_step_cpu, "pairs": pairs,
           "load_average": os.getloadavg()[0]}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
