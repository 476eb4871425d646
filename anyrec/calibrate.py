"""`python -m anyrec.calibrate output=FILE.yaml`: measure this device and write a hardware YAML.

Measures copy bandwidth, host->device bandwidth (accelerators), embedding lookup bandwidth per
available kernel and dtype, GEMM FLOP/s, and (under torchrun) all-to-all and all-reduce bandwidth.
The YAML it writes is accepted by `hardware.sku=FILE.yaml` (see anyrec/backends/hardware.py).

    python -m anyrec.calibrate output=cal.yaml [backend=auto] [budget_s=0.5] [size=small|large]
    torchrun --nproc_per_node=2 -m anyrec.calibrate output=cal.yaml

Legend: T tables, R rows, D dim, B bags per table, L ids per bag.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from anyrec.backends import Backend, get_backend
from anyrec.backends.dispatch import availability
from anyrec.io_checks import writable_file

logger = logging.getLogger("anyrec.calibrate")

OPTIONS = {"output": None, "backend": "auto", "budget_s": "0.5", "size": "small"}
# Workload sizes: (tables, rows, dim, bags, ids per bag), GEMM n, collective bytes, copy bytes.
SIZES = {
    "small": dict(tbe=(8, 50_000, 64, 1024, 8), gemm=768, comm_bytes=4 << 20, copy_bytes=64 << 20),
    "large": dict(tbe=(26, 1_000_000, 128, 16384, 8), gemm=8192, comm_bytes=256 << 20, copy_bytes=1 << 30),
}


def parse_args(argv: list[str]) -> dict[str, str]:
    """`key=value` arguments, Hydra-style; unknown keys and a missing output are ValueErrors."""
    opts = dict(OPTIONS)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in OPTIONS:
            raise ValueError(f"unknown argument {arg!r}; expected key=value with key in {', '.join(OPTIONS)}")
        opts[key] = value
    if not opts["output"]:
        raise ValueError("output=FILE.yaml is required")
    if opts["size"] not in SIZES:
        raise ValueError(f"size={opts['size']}: choose one of {', '.join(SIZES)}")
    return opts


def timeit(fn: Callable[[], Any], backend: Backend, budget_s: float, min_reps: int = 3,
           reps: int | None = None) -> float:
    """Median seconds per call of `fn`: one warm-up, then repeat until the budget is spent.

    Collectives pass a fixed `reps`: every rank must make the same number of calls.
    """
    fn()
    backend.synchronize()
    times: list[float] = []
    start = time.perf_counter()
    while (len(times) < reps if reps is not None else
           len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 200)):
        t0 = time.perf_counter()
        fn()
        backend.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def measure_copy(backend: Backend, device: torch.device, nbytes: int, budget_s: float) -> dict[str, float]:
    """Device copy bandwidth (read + write counted) and host->device bandwidth from pinned memory."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    out = {"copy_bw_bytes_per_s": 2 * nbytes / timeit(lambda: dst.copy_(src), backend, budget_s)}
    if device.type != "cpu":
        host = torch.empty(nbytes // 4, dtype=torch.float32).pin_memory()
        out["h2d_bw_bytes_per_s"] = nbytes / timeit(lambda: dst.copy_(host, non_blocking=True),
                                                    backend, budget_s)
    return out


def measure_gemm(backend: Backend, device: torch.device, n: int, budget_s: float) -> dict[str, float]:
    """Achieved dense GEMM FLOP/s for fp32 and bf16 (n x n x n)."""
    out = {}
    for dtype, key in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        # CPUs without bf16 matrix units are slow at bf16: a smaller problem keeps the run short.
        m = n if device.type != "cpu" or dtype == torch.float32 else max(128, n // 2)
        a = torch.randn(m, m, device=device, dtype=dtype)
        b = torch.randn(m, m, device=device, dtype=dtype)
        out[key] = 2 * m**3 / timeit(lambda a=a, b=b: torch.mm(a, b), backend, budget_s)
    return out


def _lookup_inputs(device: torch.device, shape: tuple, seed: int = 0):
    t, rows, _, bags, ids_per_bag = shape
    g = torch.Generator().manual_seed(seed)
    ids_N = torch.randint(0, rows, (t * bags * ids_per_bag,), generator=g)
    offsets = torch.arange(0, t * bags * ids_per_bag + 1, ids_per_bag)
    return ids_N.to(device), offsets.to(device)


def measure_lookup(backend: Backend, device: torch.device, shape: tuple, budget_s: float) -> dict:
    """Pooled lookup (forward) bandwidth: bytes of rows read per second, per kernel and dtype."""
    t, rows, dim, bags, ids_per_bag = shape
    ids_N, offsets = _lookup_inputs(device, shape)
    out: dict[str, dict[str, float]] = {}
    for kernel in ("fbgemm", "torch", "triton"):
        reason = availability(backend, "embedding", kernel)
        if kernel == "triton" or reason is not None:
            # The Triton TBE lives in anyrec.kernels; calibrating it is that module's job.
            out[kernel] = {"skipped": reason or "measured by anyrec.kernels benchmarks"}
            continue
        out[kernel] = {}
        for dtype, name in ((torch.float32, "fp32"), (torch.float16, "fp16")):
            try:
                fn = _lookup_fn(kernel, device, t, rows, dim, dtype, ids_N, offsets)
                sec = timeit(fn, backend, budget_s)
            except (RuntimeError, NotImplementedError) as e:
                out[kernel][name] = f"failed: {str(e).splitlines()[0][:100]}"
                continue
            out[kernel][name] = t * bags * ids_per_bag * dim * dtype.itemsize / sec
    return out


def _lookup_fn(kernel, device, t, rows, dim, dtype, ids_N, offsets) -> Callable[[], Any]:
    if kernel == "torch":
        bag = torch.nn.EmbeddingBag(t * rows, dim, mode="sum", device=device, dtype=dtype)
        # One table of t*rows rows stands in for t tables: table i's ids are offset by i*rows.
        per = ids_N.numel() // t
        shifted_N = ids_N + torch.arange(t, device=device).repeat_interleave(per) * rows
        return lambda: bag(shifted_N, offsets[:-1])
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    on_cpu = device.type == "cpu"
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST if on_cpu else EmbeddingLocation.DEVICE,
          ComputeDevice.CPU if on_cpu else ComputeDevice.CUDA)] * t,
        weights_precision=SparseType.FP32 if dtype == torch.float32 else SparseType.FP16,
        device=device,
    )
    return lambda: tbe(ids_N, offsets)


def measure_collectives(device: torch.device, nbytes: int, backend: Backend, budget_s: float) -> dict:
    """all-to-all and all-reduce bus bandwidth per rank (nccl-tests conventions)."""
    world = dist.get_world_size()
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    a2a = timeit(lambda: dist.all_to_all_single(y, x), backend, budget_s, reps=10)
    ar = timeit(lambda: dist.all_reduce(x), backend, budget_s, reps=10)
    # Times differ between ranks; take the slowest, as a collective step would.
    t = torch.tensor([a2a, ar], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    a2a, ar = t.tolist()
    return {
        "all_to_all_bw_bytes_per_s": nbytes * (world - 1) / world / a2a,
        "all_reduce_bw_bytes_per_s": 2 * nbytes * (world - 1) / world / ar,
        "world_size": world,
    }


def calibrate(backend: Backend, device: torch.device, size: str = "small", budget_s: float = 0.5) -> dict:
    """Every measurement on this device, as the `measurements` section of a hardware YAML."""
    s = SIZES[size]
    m: dict[str, Any] = {}
    m.update(measure_copy(backend, device, s["copy_bytes"], budget_s))
    m["gemm_flops"] = measure_gemm(backend, device, s["gemm"], budget_s)
    m["embedding_lookup_bw_bytes_per_s"] = measure_lookup(backend, device, s["tbe"], budget_s)
    if dist.is_initialized() and dist.get_world_size() > 1:
        m.update(measure_collectives(device, s["comm_bytes"], backend, budget_s))
    m["lookup_shape"] = dict(zip(("tables", "rows", "dim", "bags", "ids_per_bag"), s["tbe"], strict=True))
    m["threads"] = torch.get_num_threads()
    return m


def hardware_yaml(backend: Backend, m: dict) -> dict:
    """The hardware file: the backend's spec with measured fields replaced, plus the measurements."""
    spec = backend.device_spec()
    measured: dict[str, Any] = {
        "name": f"{spec.name} (calibrated)",
        "memory_bw_bytes_per_s": m["copy_bw_bytes_per_s"],
        "peak_fp32_flops": m["gemm_flops"]["fp32"],
        "peak_bf16_flops": m["gemm_flops"]["bf16"],
    }
    if "h2d_bw_bytes_per_s" in m:
        measured["h2d_bw_bytes_per_s"] = m["h2d_bw_bytes_per_s"]
    if backend.device_type == "cpu":
        measured["host_memory_bw_bytes_per_s"] = m["copy_bw_bytes_per_s"]
    if "all_to_all_bw_bytes_per_s" in m:
        # Ranks of one launch share a host: what they measure is the scale-up link.
        measured["scale_up_bw_bytes_per_s"] = m["all_to_all_bw_bytes_per_s"]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    fields = {**spec.to_dict(), **measured,
              "source": f"anyrec.calibrate on {backend.describe()}, {stamp}; "
                        f"unmeasured fields from {spec.source or spec.name}"}
    return {"spec": fields, "measurements": m}


def write_yaml(path: Path, data: dict, header: str) -> None:
    """Atomic write: a temporary file beside the target, then rename."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False))
    os.replace(tmp, path)


def format_table(m: dict) -> str:
    """The measurements as a small text table."""
    rows = [("copy", "", m["copy_bw_bytes_per_s"] / 1e9, "GB/s")]
    if "h2d_bw_bytes_per_s" in m:
        rows.append(("host->device", "pinned", m["h2d_bw_bytes_per_s"] / 1e9, "GB/s"))
    for dtype, v in m["gemm_flops"].items():
        rows.append(("gemm", dtype, v / 1e12, "TFLOP/s"))
    for kernel, per in m["embedding_lookup_bw_bytes_per_s"].items():
        for dtype, v in per.items():
            if isinstance(v, float):
                rows.append((f"lookup {kernel}", dtype, v / 1e9, "GB/s"))
    for key, label in (("all_to_all_bw_bytes_per_s", "all-to-all"),
                       ("all_reduce_bw_bytes_per_s", "all-reduce")):
        if key in m:
            rows.append((label, f"{m['world_size']} ranks", m[key] / 1e9, "GB/s"))
    lines = [f"{'measurement':<16} {'variant':<10} {'value':>12}  unit"]
    lines += [f"{a:<16} {b:<10} {v:>12.3f}  {u}" for a, b, v, u in rows]
    skipped = [f"lookup {k}: {p['skipped']}" for k, p in m["embedding_lookup_bw_bytes_per_s"].items()
               if "skipped" in p]
    return "\n".join(lines + [f"(skipped) {s}" for s in skipped])


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for a usage error)."""
    # FBGEMM logs every TBE's arguments at INFO on the root logger: keep those out, ours in.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("anyrec").setLevel(logging.INFO)
    try:
        opts = parse_args(sys.argv[1:] if argv is None else argv)
        writable_file(opts["output"], "output")
        budget_s = float(opts["budget_s"])
        backend = get_backend(opts["backend"])
    except ValueError as e:
        print(f"anyrec.calibrate: error: {e}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if rank != 0:
        logging.getLogger("anyrec").setLevel(logging.WARNING)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = backend.device(local_rank)
    backend.set_device(local_rank)
    if world > 1 and not dist.is_initialized():
        if backend.device_type == "cpu":
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        dist.init_process_group(backend=backend.dist_backend)
    try:
        start = time.perf_counter()
        kernels = backend.select_kernels()
        m = calibrate(backend, device, opts["size"], budget_s)
        m["seconds"] = time.perf_counter() - start
        if rank == 0:
            out = Path(opts["output"])
            header = (f"# Hardware spec measured by anyrec.calibrate ({backend.describe()}, kernels "
                      f"{kernels}).\n# Use with: hardware.sku={out.resolve()}\n")
            write_yaml(out, hardware_yaml(backend, m), header)
            print(format_table(m))
            print(f"wrote {out} in {m['seconds']:.1f} s", flush=True)
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
