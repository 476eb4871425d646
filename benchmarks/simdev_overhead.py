"""What the simulated device (simdev) adds to each op: the same ATen ops timed on the host and on simdev,
whose every op goes through a Python fallback that runs the CPU kernel on host aliases of device memory.

    python benchmarks/simdev_overhead.py [--small] [--repeats N] [--json out.json]

simdev is imported as the environment has it (installed, or on PYTHONPATH: point PYTHONPATH at another
copy to compare two versions), else from examples/simdev. Each case runs `--iters` calls per timing,
`--repeats` timings per device, the devices alternating; the table shows the fastest timing's microseconds
per call on each device (on a shared host the least disturbed one; the JSON keeps every timing), what simdev
adds per call and the ratio. Every case is checked first: simdev's result must
equal the host's bit for bit. The cases are the ops a DLRM training step is made of (a functional op is
two fallback calls on simdev, `empty` and the op's `out=` form; a view is an `as_strided`), and one small
training step (MLP forward, backward and Adagrad) to show them together.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
BATCH, DIM, ROWS, IDS = 256, 64, 10_000, 2_048  # a DLRM batch, embedding dim, table rows, ids per batch


def load_simdev() -> str:
    """Import simdev (which registers the device); the file it came from."""
    try:
        import anyrec_simdev
    except ImportError:
        sys.path.insert(0, str(ROOT / "examples" / "simdev"))
        import anyrec_simdev
    return str(Path(anyrec_simdev.__file__).parent)


def _inputs(device: str, step: bool) -> dict:
    """The cases' tensors on `device`, and where `step`, a training step of its own there (`step`)."""
    g = torch.Generator().manual_seed(0)
    host = {"a": torch.randn(BATCH, DIM, generator=g), "b": torch.randn(BATCH, DIM, generator=g),
            "w": torch.randn(DIM, DIM, generator=g), "bias": torch.randn(DIM, generator=g),
            "table": torch.randn(ROWS, DIM, generator=g), "ids": torch.randint(0, ROWS, (IDS,), generator=g),
            "offsets": torch.arange(0, IDS, IDS // BATCH)}
    return {**{k: v.to(device) for k, v in host.items()}, **({"step": _Step(device)} if step else {})}


class _Step:
    """One training step of a small MLP (3 linear layers, Adagrad), from the same seed on every device."""

    def __init__(self, device: str) -> None:
        torch.manual_seed(0)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.ReLU(), torch.nn.Linear(DIM, DIM),
                                       torch.nn.ReLU(), torch.nn.Linear(DIM, 1)).to(device)
        self.opt = torch.optim.Adagrad(self.mlp.parameters(), lr=0.01)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.mlp(x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()


# name -> the op, given the inputs on one device; results are compared across devices before timing.
CASES: dict[str, Callable[[dict], object]] = {
    "empty": lambda t: torch.empty(BATCH, DIM, device=t["a"].device),
    "add": lambda t: t["a"] + t["b"],
    "add_ (in place)": lambda t: t["a"].add_(t["b"], alpha=0.0),
    "mul by a number": lambda t: t["a"] * 0.5,
    "view": lambda t: t["a"].view(-1),
    "slice": lambda t: t["a"][:, 1:],
    "sum": lambda t: t["a"].sum(),
    "cat": lambda t: torch.cat([t["a"], t["b"]], dim=1),
    "linear": lambda t: F.linear(t["a"], t["w"], t["bias"]),
    "index_select": lambda t: t["table"].index_select(0, t["ids"]),
    "embedding_bag": lambda t: F.embedding_bag(t["ids"], t["table"], t["offsets"], mode="sum"),
}
STEP = "MLP train step"
CASES[STEP] = lambda t: t["step"](t["a"])
UNINITIALISED = frozenset({"empty"})  # cases whose values are whatever memory held: shape and dtype compared


def check_equal(name: str, results: dict[str, torch.Tensor]) -> None:
    """Raise unless every device's result of case `name` equals the first's bit for bit."""
    (first_dev, first), *rest = ((d, out.detach().cpu()) for d, out in results.items())
    for dev, out in rest:
        same = (out.shape, out.dtype) == (first.shape, first.dtype) if name in UNINITIALISED else \
            torch.equal(out, first)
        if not same:
            raise AssertionError(f"{name}: {dev} differs from {first_dev}")


def measure(devices: list[str], repeats: int, iters: int, cases: list[str]) -> list[dict]:
    """The fastest timing's microseconds per call of each case on each device (timings alternate between
    devices)."""
    inputs = {d: _inputs(d, STEP in cases) for d in devices}
    rows = []
    for name in cases:
        fn = CASES[name]
        check_equal(name, {d: fn(inputs[d]) for d in devices})
        times: dict[str, list[float]] = {d: [] for d in devices}
        for k in range(repeats):
            for d in devices if k % 2 == 0 else devices[::-1]:
                t = inputs[d]
                start = time.perf_counter()
                for _ in range(iters):
                    fn(t)
                times[d].append((time.perf_counter() - start) / iters * 1e6)
        rows.append({"case": name, **{f"{d}_us": min(times[d]) for d in devices},
                     "runs_us": times})
    return rows


def with_overhead(rows: list[dict]) -> list[dict]:
    """Each row with what simdev adds per call (`added_us`) and its ratio to the host (`ratio`)."""
    return [{**r, "added_us": r["simdev_us"] - r["cpu_us"], "ratio": r["simdev_us"] / r["cpu_us"]}
            for r in rows]


def table(rows: list[dict]) -> str:
    """The rows as the printed table, with the median over the single ops last."""
    lines = [f"{'case':<18} {'cpu us':>9} {'simdev us':>10} {'added us':>9} {'ratio':>7}"]
    lines += [f"{r['case']:<18} {r['cpu_us']:>9.1f} {r['simdev_us']:>10.1f} {r['added_us']:>9.1f} "
              f"{r['ratio']:>7.1f}" for r in rows]
    ops = [r["added_us"] for r in rows if r["case"] != STEP]
    if ops:
        lines.append(f"{'median added per op':<39} {statistics.median(ops):>9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="few calls and repeats (for a quick look)")
    ap.add_argument("--repeats", type=int, default=None, help="timings per device and case (default 7)")
    ap.add_argument("--iters", type=int, default=None, help="calls per timing (default 200; 20 for the step)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    where = load_simdev()
    repeats = args.repeats or (3 if args.small else 7)
    iters = args.iters or (20 if args.small else 200)
    rows = measure(["cpu", "simdev"], repeats, iters, [n for n in CASES if n != STEP])
    rows += measure(["cpu", "simdev"], repeats, max(1, iters // 10), [STEP])
    rows = with_overhead(rows)
    print(f"simdev from {where}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"simdev": where, "torch": torch.__version__,
                                         "threads": torch.get_num_threads(), "repeats": repeats,
                                         "iters": iters, "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
