"""Effective bandwidth of the table-batched embedding: forward and forward+backward+optimizer.

    python benchmarks/tbe.py [--small] [--out-dir DIR] [--json tbe.json] [--execution auto|triton|torch]

Shapes: one-hot and DLRMv2 multi-hot (26 tables x 1M rows x 128, batch 16384), fp32 and fp16
weights, uniform ids. In the same run it measures device copy bandwidth (the ceiling) and
torch.nn.EmbeddingBag (forward; forward + sparse backward + SGD) and quotes ratios to both.
Effective GB/s = bytes the op must move / time, counted as the plain-PyTorch anchor counts them:
forward = lookups*D*w_bytes + bags*D*out_bytes; training adds 2*lookups*D*w_bytes (row read +
write) and 2*lookups*state_bytes_per_row (optimizer state read + write). On CPU, or with --small,
sizes shrink to a toy problem (26 x 200 rows x 16, batch 8) so the script and its test stay fast.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from torch import nn

from anyrec.kernels.optimizers import OptimizerConfig, state_bytes_per_row
from anyrec.kernels.tbe import TritonTableBatchedEmbedding
from anyrec.schema import load_model_config

MULTI_HOT = load_model_config("dlrmv2").multi_hot  # MLPerf DLRMv2's ids per sample per feature


def accelerator() -> torch.device:
    """The current accelerator (CUDA or ROCm alike), else CPU; vendor-neutral torch API."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.device(acc.type) if acc is not None else torch.device("cpu")


def bench(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Median seconds of `fn` over `iters` runs after `warmup` runs."""
    def sync():
        if device.type != "cpu":
            torch.accelerator.synchronize()

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def make_batch(pooling: list[int], rows: int, batch: int, device):
    """KJT values/offsets (feature-major, table-local ids) and the global ids for one flat EmbeddingBag."""
    lengths = torch.tensor([p for p in pooling for _ in range(batch)], device=device)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(lengths, 0)
    n = int(offsets[-1])
    bag_table = torch.arange(len(pooling), device=device).repeat_interleave(batch)
    table = torch.repeat_interleave(bag_table, lengths)
    ids = torch.randint(0, rows, (n,), device=device)
    return ids, offsets, ids + table * rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="TBE effective bandwidth vs copy and nn.EmbeddingBag")
    ap.add_argument("--small", action="store_true", help="toy sizes (automatic on CPU)")
    ap.add_argument("--out-dir", default=".", help="directory for the JSON file")
    ap.add_argument("--json", default="tbe.json", help="JSON file name inside --out-dir")
    ap.add_argument("--execution", default="auto", choices=["auto", "triton", "torch"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtypes", default="fp32,fp16")
    a = ap.parse_args(argv)
    device = accelerator()
    if a.execution == "auto":  # the kernels take an explicit choice: Triton on an accelerator
        a.execution = "torch" if device.type == "cpu" else "triton"
    small = a.small or device.type == "cpu"
    T, D = 26, (16 if small else 128)
    rows, batch = (200, 8) if small else (1_000_000, 16384)
    iters, warmup = (2, 1) if small else (a.iters, 3)
    dtypes = {"fp32": torch.float32, "fp16": torch.float16}
    res: dict = {"device": str(device), "host": platform.node(), "torch": torch.__version__, "small": small,
                 "execution": a.execution, "shape": {"tables": T, "rows": rows, "dim": D, "batch": batch},
                 "results": []}
    lines = []
    if device.type == "cpu":
        res["gpu"] = "not run"
        print("GPU: not run (CPU: toy sizes, numbers only prove the plumbing)")

    def record(name, sec, nbytes, **extra):
        gbps = nbytes / sec / 1e9
        res["results"].append({"name": name, "ms": sec * 1e3, "GBps": gbps, **extra})
        lines.append(f"{name:<46} {sec * 1e3:10.3f} ms {gbps:10.1f} GB/s")
        print(lines[-1], flush=True)
        return gbps

    n = (1 << 20) if small else (1 << 28)
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    copy_gbps = record("copy (read+write)", bench(lambda: dst.copy_(src), device, iters, warmup), 2 * n * 4)
    res["copy_GBps"] = copy_gbps

    for dname in a.dtypes.split(","):
        dtype = dtypes[dname]
        esz = torch.empty((), dtype=dtype).element_size()
        opt = OptimizerConfig("rowwise_adagrad", lr=0.01)
        tbe = TritonTableBatchedEmbedding([(rows, D)] * T, optimizer=opt, weights_dtype=dtype,
                                          bounds_check="skip", device=device, execution=a.execution)
        ebag = nn.EmbeddingBag(T * rows, D, mode="sum", sparse=True, device=device, dtype=dtype)
        sgd = torch.optim.SGD(ebag.parameters(), lr=0.01)
        for shape, pooling in (("onehot", [1] * T), ("multihot", MULTI_HOT)):
            ids, offsets, gids = make_batch(pooling, rows, batch, device)
            lookups, bags = ids.numel(), T * batch
            fwd_bytes = lookups * D * esz + bags * D * 4
            train_bytes = fwd_bytes + 2 * lookups * D * esz + 2 * lookups * state_bytes_per_row(opt.kind, D)
            sgd_bytes = fwd_bytes + 2 * lookups * D * esz
            tag = f"{shape} {dname}"
            grad = torch.randn(batch, T * D, device=device)

            def tbe_train(tbe=tbe, ids=ids, offsets=offsets, grad=grad):
                tbe(ids, offsets).backward(grad)

            with torch.no_grad():
                tbe.eval()
                t_f = bench(lambda tbe=tbe, ids=ids, o=offsets: tbe(ids, o), device, iters, warmup)
            tbe.train()
            t_t = bench(tbe_train, device, iters, warmup)
            ours_f = record(f"anyrec TBE fwd {tag}", t_f, fwd_bytes, shape=shape, dtype=dname, op="fwd")
            ours_t = record(f"anyrec TBE fwd+bwd+rowwise_adagrad {tag}", t_t, train_bytes, shape=shape,
                            dtype=dname, op="train")
            goff = offsets[:-1]
            with torch.no_grad():
                e_f = bench(lambda e=ebag, g=gids, o=goff: e(g, o), device, iters, warmup)
            eb_f = record(f"nn.EmbeddingBag fwd {tag}", e_f, fwd_bytes, shape=shape, dtype=dname, op="fwd")

            def ebag_train(ebag=ebag, sgd=sgd, gids=gids, goff=goff):
                sgd.zero_grad(set_to_none=True)
                out = ebag(gids, goff)
                out.backward(torch.ones_like(out))
                sgd.step()

            try:
                eb_t = record(f"nn.EmbeddingBag fwd+bwd+sgd {tag}", bench(ebag_train, device, iters, warmup),
                              sgd_bytes, shape=shape, dtype=dname, op="train")
            except RuntimeError as ex:  # sparse fp16 SGD is not implemented everywhere
                eb_t = None
                lines.append(f"nn.EmbeddingBag fwd+bwd+sgd {tag}: {str(ex)[:60]}")
                print(lines[-1])
            res["results"].append({"name": f"ratios {tag}", "fwd_vs_copy": ours_f / copy_gbps,
                                   "fwd_vs_embeddingbag": ours_f / eb_f, "train_vs_copy": ours_t / copy_gbps,
                                   "train_vs_embeddingbag": (ours_t / eb_t) if eb_t else None})
            lines.append(f"  ratios {tag}: fwd {ours_f / copy_gbps:.2f}x copy, "
                         f"{ours_f / eb_f:.2f}x EmbeddingBag;"
                         f" train {ours_t / copy_gbps:.2f}x copy"
                         + (f", {ours_t / eb_t:.2f}x EmbeddingBag+SGD" if eb_t else ""))
            print(lines[-1], flush=True)

    out = Path(a.out_dir) / a.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"\n=== TBE benchmark on {res['device']} (small={small}), JSON: {out}"
          + ("; GPU: not run" if device.type == "cpu" else ""))
    print("\n".join(lines))
    return res


if __name__ == "__main__":
    main()
