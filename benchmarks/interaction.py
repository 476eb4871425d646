"""Dot interaction, forward + backward: anyrec's modules against the plain-PyTorch gather of the upper
triangle (`gram[:, rows, cols]`, the anchor), at DLRM shapes (26 sparse features).

    python benchmarks/interaction.py [--small] [--json out.json]

Contenders, on the same inputs and output gradient:
  torch gather    bmm, then gram[:, rows, cols] (advanced indexing; its backward is index_put with
                  accumulate into a zeroed gram)
  anyrec torch    DotInteraction: bmm, then one index_select of the flat upper triangle (backward: one
                  index_add)
  anyrec triton   TritonDotInteraction, one kernel per direction (GPU only)
Each is timed `--repeats` times in alternating order; the table shows the median microseconds and the
ratio to the anchor (< 1: faster). The outputs and gradients of every contender are checked against
the anchor before timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from anyrec.backends import Backend, get_backend
from anyrec.models.interaction import DotInteraction, TritonDotInteraction

F = 26  # Criteo's sparse features


class TorchGather(torch.nn.Module):
    """The anchor: the upper triangle by advanced indexing."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        n = num_sparse_features + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense_BD: torch.Tensor, sparse_BFD: torch.Tensor) -> torch.Tensor:
        feats_BfD = torch.cat([dense_BD.unsqueeze(1), sparse_BFD], dim=1)
        gram_Bff = torch.bmm(feats_BfD, feats_BfD.transpose(1, 2))
        return torch.cat([dense_BD, gram_Bff[:, self.rows, self.cols]], dim=1)


def _step(module, dense, sparse, grad) -> tuple[torch.Tensor, ...]:
    out = module(dense, sparse)
    return (out, *torch.autograd.grad(out, (dense, sparse), grad))


def contenders(device: torch.device) -> dict[str, torch.nn.Module]:
    out = {"torch gather": TorchGather(F).to(device), "anyrec torch": DotInteraction(F).to(device)}
    if device.type != "cpu":
        out["anyrec triton"] = TritonDotInteraction(F).to(device)
    return out


def run_shape(batch: int, dim: int, backend: Backend, repeats: int, iters: int) -> list[dict]:
    device = backend.device()
    g = torch.Generator().manual_seed(batch + dim)
    dense = torch.randn(batch, dim, generator=g).to(device).requires_grad_()
    sparse = torch.randn(batch, F, dim, generator=g).to(device).requires_grad_()
    grad = torch.randn(batch, dim + (F + 1) * F // 2, generator=g).to(device)
    mods = contenders(device)
    want = _step(mods["torch gather"], dense, sparse, grad)
    for name, mod in mods.items():
        got = _step(mod, dense, sparse, grad)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{name} differs from the anchor")
    times: dict[str, list[float]] = {name: [] for name in mods}
    order = list(mods)
    for k in range(repeats):
        for name in order if k % 2 == 0 else order[::-1]:
            backend.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                _step(mods[name], dense, sparse, grad)
            backend.synchronize()
            times[name].append((time.perf_counter() - t0) / iters)
    anchor = statistics.median(times["torch gather"])
    return [{"batch": batch, "dim": dim, "contender": name, "us": statistics.median(t) * 1e6,
             "ratio_to_anchor": statistics.median(t) / anchor, "runs_us": [x * 1e6 for x in t]}
            for name, t in times.items()]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="two small shapes, few repeats (for tests)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    backend = get_backend("auto")  # the device and its sync, as the trainer finds them
    device = backend.device()
    if args.small:
        shapes, repeats, iters = [(64, 16), (128, 32)], args.repeats or 3, 3
    elif device.type != "cpu":
        shapes, repeats, iters = [(4096, 128), (16384, 128), (65536, 128)], args.repeats or 7, 20
    else:
        shapes, repeats, iters = [(256, 16), (1024, 16), (1024, 128), (4096, 16)], args.repeats or 7, 10
    rows = [r for b, d in shapes for r in run_shape(b, d, backend, repeats, iters)]
    print(f"{'batch':>6} {'dim':>4} {'contender':<14} {'us':>10} {'vs torch gather':>16}")
    for r in rows:
        print(f"{r['batch']:>6} {r['dim']:>4} {r['contender']:<14} {r['us']:>10.1f} "
              f"{r['ratio_to_anchor']:>16.3f}")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "threads": torch.get_num_threads(),
                                         "sparse_features": F, "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
