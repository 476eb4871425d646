"""Jagged HSTU attention, forward and forward + backward: anyrec's torch version against its Triton kernels
(where they run: a GPU; on a CPU the Triton path is only the interpreter, not timed), at the DLRMv4
reference's heads and dims (4 heads, q/k and v dims 128) with its 8 contextual tokens and one target per
sequence, sequence lengths drawn uniformly from [max_len / 2, max_len].

    python benchmarks/hstu_attention.py [--small] [--json out.json] [--dtype bf16] [--max-lens 512,4096]

Each contender is checked against the torch version (forward and the three gradients) before timing,
then timed `--repeats` times in alternating order; the table shows median milliseconds and achieved
GFLOP/s (the causal pairs' FLOPs, `anyrec.kernels.hstu.attention_flops`: 2 (dq + dv) per pair and head
forward, twice that backward) and, where the device is a known SKU, the fraction of its dense peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from anyrec.backends import Backend, get_backend
from anyrec.backends.specs import get_sku, match_sku
from anyrec.kernels.hstu import attention_flops, hstu_attention_torch

CONTEXTUAL, TARGETS = 8, 1  # the reference's contextual entries and candidates per sequence
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def peak_flops(backend: Backend, dtype: torch.dtype) -> tuple[float | None, str]:
    """The device's dense peak FLOP/s for `dtype` and its SKU name, or (None, why) for an unknown device."""
    if backend.device_type == "cpu":
        return None, "cpu (no peak table)"
    facts = backend.facts
    sku, how = match_sku(facts.device_name, facts.arch, facts.memory_bytes)
    if sku is None:
        return None, how
    spec = get_sku(sku)
    return (spec.peak_bf16_flops if dtype != torch.float32 else spec.peak_fp32_flops), spec.name


def make_batch(batch: int, max_len: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device,
               seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(max_len // 2, CONTEXTUAL + TARGETS), max_len + 1, (batch,), generator=g)
    offsets = torch.zeros(batch + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    tokens = int(offsets[-1])
    q, k, v, grad = (torch.randn(tokens, heads, dim, generator=g).to(device, dtype) for _ in range(4))
    targets = torch.full((batch,), TARGETS, dtype=torch.int64)
    return [q.requires_grad_(), k.requires_grad_(), v.requires_grad_()], grad, offsets.to(device), \
        targets.to(device), lengths.tolist()


def contenders(device: torch.device, max_len: int, torch_max_len: int) -> dict:
    out = {}
    if max_len <= torch_max_len:
        out["torch"] = hstu_attention_torch
    if device.type != "cpu":
        from anyrec.kernels.triton_hstu import hstu_attention_triton

        out["triton"] = hstu_attention_triton
    return out


def run_shape(batch: int, max_len: int, heads: int, dim: int, dtype: torch.dtype, backend: Backend,
              repeats: int, iters: int, torch_max_len: int) -> list[dict]:
    device = backend.device()
    leaves, grad, offsets, targets, lengths = make_batch(batch, max_len, heads, dim, dtype, device, max_len)
    fns = contenders(device, max_len, torch_max_len)

    def fwd(fn):
        return fn(*leaves, offsets, max_len, heads, targets, CONTEXTUAL)

    def fwd_bwd(fn):
        return (fwd(fn), *torch.autograd.grad(fwd(fn), leaves, grad))

    if "torch" in fns and len(fns) > 1:  # every other contender against the torch version
        want = fwd_bwd(fns["torch"])
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        for name, fn in fns.items():
            for what, a, b in zip(("out", "dq", "dk", "dv"), fwd_bwd(fn), want, strict=True):
                err, scale = float((a - b).abs().max()), float(b.abs().max())
                if err > tol * scale:
                    raise AssertionError(f"{name} {what} differs from the torch version: "
                                         f"{err:.2e} of {scale:.2e}")
    flops_fwd, flops_bwd = attention_flops(lengths, heads, dim, dim)
    times = {(name, mode): [] for name in fns for mode in ("fwd", "fwd+bwd")}
    order = list(times)
    for r in range(repeats):
        for name, mode in order if r % 2 == 0 else order[::-1]:
            fn = fns[name]
            step = (lambda fn=fn: fwd(fn).detach()) if mode == "fwd" else (lambda fn=fn: fwd_bwd(fn))
            with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                step()  # warm: compiles, allocator
                backend.synchronize()
                t0 = time.perf_counter()
                for _ in range(iters):
                    step()
                backend.synchronize()
            times[(name, mode)].append((time.perf_counter() - t0) / iters)
    peak, sku = peak_flops(backend, dtype)
    rows = []
    for (name, mode), t in times.items():
        sec = statistics.median(t)
        flops = flops_fwd if mode == "fwd" else flops_fwd + flops_bwd
        rows.append({"contender": name, "mode": mode, "batch": batch, "max_len": max_len,
                     "tokens": sum(lengths), "heads": heads, "dim": dim,
                     "dtype": str(dtype).removeprefix("torch."), "ms": sec * 1e3,
                     "gflop": flops / 1e9, "gflop_per_s": flops / sec / 1e9, "runs_ms": [x * 1e3 for x in t],
                     "peak_fraction": flops / sec / peak if peak else None, "peak_of": sku})
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'contender':<9} {'mode':<8} {'batch':>5} {'max_len':>7} {'tokens':>7} {'dtype':<9} {'ms':>9} "
            f"{'GFLOP/s':>9} {'of peak':>8}")
    lines = [head]
    for r in rows:
        peak = f"{r['peak_fraction']:.1%}" if r["peak_fraction"] is not None else "-"
        lines.append(f"{r['contender']:<9} {r['mode']:<8} {r['batch']:>5} {r['max_len']:>7} {r['tokens']:>7} "
                     f"{r['dtype']:<9} {r['ms']:>9.3f} {r['gflop_per_s']:>9.1f} {peak:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes, few repeats (for tests)")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None,
                    help="default: bf16 on a GPU, fp32 on a CPU")
    ap.add_argument("--max-lens", default="", help="comma list of max lengths (default by device)")
    ap.add_argument("--torch-max-len", type=int, default=None,
                    help="time the torch version only up to this max length "
                         "(default: 1024 on a GPU, all on a CPU)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args(argv)
    backend = get_backend("auto")
    device = backend.device()
    gpu = device.type != "cpu"
    dtype = DTYPES[a.dtype or ("bf16" if gpu else "fp32")]
    heads, dim = (2, 32) if a.small else (4, 128)
    if a.small:
        max_lens, tokens, repeats, iters = [32, 64], 256, a.repeats or 3, 2
    elif gpu:
        max_lens, tokens, repeats, iters = [512, 1024, 2048, 4096], 1 << 17, a.repeats or 5, 10
    else:
        max_lens, tokens, repeats, iters = [128, 512, 1024], 1 << 13, a.repeats or 3, 2
    if a.max_lens:
        max_lens = [int(x) for x in a.max_lens.split(",")]
    torch_max_len = a.torch_max_len or (1024 if gpu else max(max_lens))
    rows = []
    for max_len in max_lens:
        batch = max(1, tokens // max_len)  # about the same tokens per batch at every length
        rows += run_shape(batch, max_len, heads, dim, dtype, backend, repeats, iters, torch_max_len)
    triton = "timed" if gpu else "not run (no GPU: Triton reaches a CPU only through its interpreter)"
    print(format_table(rows))
    print(f"Triton: {triton}")
    report = {"device": str(device), "device_name": backend.facts.device_name,
              "threads": torch.get_num_threads(), "contextual": CONTEXTUAL, "targets": TARGETS,
              "triton": triton, "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {a.json}")
    return report


if __name__ == "__main__":
    main()
