"""One-shot GPU check of the Triton TBE: correctness, bandwidth, and single-GPU DLRM training.

    OUT=/path PYTHONPATH=. python benchmarks/gpu_suite.py [--small] [--steps 300] [--execution auto]

Sections (each runs on its own; a failure is recorded and the rest still run):
  env          torch/triton versions, device facts, whether torchrec/fbgemm import
  correctness  Triton (or --execution) forward and 2 fused row-wise Adagrad / Adam steps vs the
               pure-torch reference at a few shapes (mixed dims, hot rows, mean pooling, fp16)
  tbe          benchmarks/tbe.py: DLRMv2 shape (26 x 1M x 128, B=16384), fp32/fp16, forward and
               fwd+bwd+row-wise Adagrad vs nn.EmbeddingBag and the device copy, same run
  interaction  benchmarks/interaction.py: the dot interaction forward + backward, Triton kernel and
               torch module vs plain torch's upper-triangle gather, batch 4096-65536, dim 128
  attention    benchmarks/hstu_attention.py: jagged HSTU attention forward and forward + backward, the
               Triton kernels (checked against the torch version first) at the DLRMv4 reference's shapes
               (bf16, 4 heads, dims 128, 8 contextual tokens and a target per sequence, max lengths 512 to
               4,096): ms, achieved TFLOP/s and the fraction of the device's dense bf16 peak; JSON in
               hstu_attention.json
  dlrm_tbe     a DLRM-like train loop (bottom MLP, TritonTableBatchedEmbedding, top MLP; dense Adagrad)
               from torch + triton only: samples/s
  dlrm_ebc     the same loop through TritonEmbeddingBagCollection on KeyedJaggedTensors (the
               trainer's single-device path), with a dispatch-mode check that no fbgemm op runs;
               skipped with the reason when torchrec does not import (a GPU image with torch and
               triton only)
  dlrm_sharded the same loop sharded at world size 1 (DistributedModelParallel, anyrec's TBE sharder,
               tables table-wise) with torchrec's sparse ops on anyrec's portable kernels
               (backend.sparse_ops=portable), checked by profiler to serve every fbgemm:: call;
               skipped like dlrm_ebc without torchrec
  data         synthetic batches made on the device at DLRMv2 shape, batch 16384: samples/s (goal
               >= 20 M on an H200) and whether they equal the CPU's batches bit for bit
  parity       anyrec-parity: the one-device trainer on the CPU (torch TBE) vs here (Triton TBE),
               20 steps of dlrm_tiny per optimizer; records saved as $OUT/parity_<optimizer>.json
  loop         benchmarks/train_step.py on the one-device Triton TBE: the whole training loop (data made
               on the device) against the step on pre-made batches, and plain PyTorch
  compile      the trainer's one-device DLRMv2 step (train_step.py's shape, batch 16384, fp32) with
               trainer.compile=false and =true (the dense model through inductor) on the same pre-made
               batches: samples/s, build seconds (the compile included) and the first steps' losses
  dlrmv4       DLRMv4's training step through the trainer on this device: the reference's dense shapes
               (3 STU layers, D 512, 4 heads, sequences up to 4,096) at 1,024 samples, tables at 1/1,000,
               sequence tables on anyrec's Triton TBE, the backend's attention, bf16 where it has it:
               samples/s, step and peak memory measured against the planner's predictions
  calibrate    python -m anyrec.calibrate calibrate.size=large on this device -> $OUT/calibration.yaml
  memory       the trainer on this device (one rank, DLRMv2-shaped dlrmv2_small, batch 16384): the plan's
               predicted peak memory (allocated, and reserved with the allocator's slack) against the
               measured max_memory_allocated and max_memory_reserved of the training steps; null on CPU
Writes $OUT/gpu_suite.json (default ./gpu_out), $OUT/tbe.json and the files named above. The first
six sections were sized for < 8 minutes on an H200 (most of it Triton compiles and nn.EmbeddingBag's
sparse SGD); data, parity, loop, dlrmv4 and calibrate add a few minutes more (never timed on a GPU):
where one command may run 10 minutes at most, run them as a second call with
`--only data,parity,loop,dlrmv4,calibrate`.
--small shrinks everything to toy sizes and, on CPU, uses the torch execution path (what its test runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

from anyrec.kernels import reference as R  # noqa: E402
from anyrec.kernels.optimizers import OptimizerConfig  # noqa: E402
from anyrec.kernels.tbe import TritonTableBatchedEmbedding  # noqa: E402
from anyrec.schema import load_model_config  # noqa: E402

MULTI_HOT = load_model_config("dlrmv2").multi_hot  # MLPerf DLRMv2's ids per sample per feature


def accelerator() -> torch.device:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.device(acc.type) if acc is not None else torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"anyrec_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def skipped_without_torchrec(section: str, ex: Exception) -> dict:
    """The section's {"skipped": why} (printed) when its torchrec imports failed."""
    reason = f"torchrec does not import here ({type(ex).__name__}: {str(ex)[:160]})"
    print(f"  {section}: SKIPPED: {reason}", flush=True)
    return {"skipped": reason}


def torchrec_missing(section: str) -> dict | None:
    """{"skipped": why} when torchrec does not import here (a GPU image with torch and triton only)."""
    try:
        import torchrec  # noqa: F401
    except Exception as ex:
        return skipped_without_torchrec(section, ex)
    return None


def run_logged(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    """Run a child (anyrec on its path, its own session: a timeout kills its whole group); exit code
    and the tail of its output (124 on timeout)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, (out or "")[-4000:]
    return proc.returncode, out[-4000:]


# ---- sections ------------------------------------------------------------------------------------


def section_env(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as ex:
        info["triton"] = f"missing ({ex})"
    if device.type != "cpu":
        from anyrec.backends._gpu import probe_torch_cuda_facts

        f = probe_torch_cuda_facts()
        info.update(device_name=f.device_name, arch=f.arch, memory_bytes=f.memory_bytes,
                    sms=f.multiprocessors)
    for mod in ("torchrec", "fbgemm_gpu"):
        try:
            __import__(mod)
            info[mod] = "imports"
        except Exception as ex:
            info[mod] = f"does not import: {type(ex).__name__}: {str(ex)[:120]}"
    return info


def _batch(specs, ftm, batch, pooling_per_feature, device, hot: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([p for p in pooling_per_feature for _ in range(batch)])
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    ids = []
    for f, t in enumerate(ftm):
        rows = specs[t][0]
        n = int(lengths[f * batch: (f + 1) * batch].sum())
        hi = min(rows, 5) if hot and f % 2 == 0 else rows  # hot features: long segments
        ids.append(torch.randint(0, hi, (n,), generator=g))
    return torch.cat(ids).to(device), offsets.to(device)


def section_correctness(device: torch.device, execution: str, small: bool) -> dict:
    """Triton vs reference; returns the max errors per case and raises on a mismatch."""
    cases = [
        ("dlrm-like D=128 rowwise", [(1000, 128)] * 4, [0, 1, 2, 3], [1, 3, 20, 1], "sum",
         torch.float32, OptimizerConfig("rowwise_adagrad", lr=0.05, eps=1e-6)),
        ("mixed dims 4/36/260, shared table, mean, adam", [(50, 4), (40, 36), (30, 260)], [0, 1, 2, 0],
         [2, 5, 1, 40], "mean", torch.float32, OptimizerConfig("adam", lr=0.01, eps=1e-6)),
        ("fp16 D=64 sgd", [(500, 64)] * 3, [0, 1, 2], [1, 8, 2], "sum", torch.float16,
         OptimizerConfig("sgd", lr=0.05)),
    ]
    batch = 8 if small else 512
    out = {}
    for name, specs, ftm, pool, pooling, wdt, opt in cases:
        m = TritonTableBatchedEmbedding(specs, ftm, optimizer=opt, pooling=pooling, weights_dtype=wdt,
                                        stochastic_rounding=False, device=device, execution=execution)
        tables0 = [w.float().clone() for w in m.split_embedding_weights()]
        batches = []
        for s in range(2):
            ids, off = _batch(specs, ftm, batch, pool, device, hot=True, seed=s)
            batches.append((ids, off, None, torch.randn(batch, m.layout.output_dim, device=device)))
        with torch.no_grad():
            fwd = m(batches[0][0], batches[0][1])
        ref = R.pooled_forward_ref(tables0, list(ftm), batches[0][0], batches[0][1], None, pooling)
        tol = 1e-4 if wdt == torch.float32 else 2e-2
        fwd_err = float((fwd - ref).abs().max())
        for ids, off, psw, g in batches:
            m(ids, off, psw).backward(g)
        tables, _ = reference_steps(tables0, list(ftm), batches, opt, pooling)
        upd_err = max(float((w.float() - r).abs().max()) for w, r in zip(m.split_embedding_weights(), tables,
                                                                         strict=True))
        out[name] = {"forward_max_abs_err": fwd_err, "update_max_abs_err": upd_err,
                     "ok": fwd_err <= tol and upd_err <= (1e-4 if wdt == torch.float32 else 5e-3)}
        print(f"  correctness {name}: fwd err {fwd_err:.2e}, update err {upd_err:.2e}", flush=True)
    bad = [k for k, v in out.items() if not v["ok"]]
    if bad:
        raise AssertionError(f"mismatch vs reference in {bad}: {out}")
    return out


def reference_steps(tables, ftm, batches, opt, pooling):
    tables = [w.float().clone() for w in tables]
    states = [R.init_state_ref(opt.kind, *w.shape, device=w.device) for w in tables]
    for step, (ids, off, psw, g) in enumerate(batches, start=1):
        grads, touched = R.row_gradients_ref(tables, ftm, ids, off, g, psw, pooling)
        tables = [R.apply_optimizer_ref(w, s, gr, tc, opt, step)
                  for w, s, gr, tc in zip(tables, states, grads, touched, strict=True)]
    return tables, states


def section_tbe(out_dir: Path, execution: str, small: bool) -> dict:
    args = ["--out-dir", str(out_dir), "--json", "tbe.json", "--execution", execution,
            "--dtypes", "fp32,fp16"]
    res = load_benchmark("tbe").main(args + (["--small"] if small else []))
    return {"json": str(out_dir / "tbe.json"), "copy_GBps": res["copy_GBps"],
            "ratios": [r for r in res["results"] if r["name"].startswith("ratios")]}


class DenseArch(nn.Module):
    """Bottom MLP on dense features, concat with pooled embeddings, top MLP to a logit."""

    def __init__(self, num_dense: int, emb_dim: int, num_features: int, small: bool, device) -> None:
        super().__init__()
        w = 64 if small else 512
        self.bottom = nn.Sequential(nn.Linear(num_dense, w), nn.ReLU(), nn.Linear(w, emb_dim), nn.ReLU())
        top_in = emb_dim * (num_features + 1)
        widths = [64, 1] if small else [1024, 1024, 512, 256, 1]
        layers, prev = [], top_in
        for i, wd in enumerate(widths):
            layers.append(nn.Linear(prev, wd))
            if i < len(widths) - 1:
                layers.append(nn.ReLU())
            prev = wd
        self.top = nn.Sequential(*layers)
        self.to(device)

    def forward(self, dense, pooled):
        return self.top(torch.cat([self.bottom(dense), pooled], dim=1)).squeeze(1)


def _dlrm_shape(small: bool):
    if small:
        return 4, 100, 16, 32, [1, 3, 10, 1]  # tables, rows, dim, batch, pooling
    return 26, 1_000_000, 128, 16384, MULTI_HOT


def _train_loop(step_fn, steps: int, warmup: int, batch: int, device) -> dict:
    for i in range(warmup):
        step_fn(i)
    sync(device)
    t0 = time.perf_counter()
    loss = None
    for i in range(steps):
        loss = step_fn(warmup + i)
    sync(device)
    sec = time.perf_counter() - t0
    return {"steps": steps, "batch": batch, "seconds": sec, "samples_per_s": steps * batch / sec,
            "final_loss": float(loss)}


def section_dlrm_tbe(device, execution: str, small: bool, steps: int) -> dict:
    T, rows, D, B, pool = _dlrm_shape(small)
    emb = TritonTableBatchedEmbedding([(rows, D)] * T, optimizer=OptimizerConfig("rowwise_adagrad", lr=0.005),
                                      bounds_check="off", device=device, execution=execution)
    dense = DenseArch(13, D, T, small, device)
    opt = torch.optim.Adagrad(dense.parameters(), lr=0.005)
    batches = []
    for s in range(4):
        ids, off = _batch([(rows, D)] * T, list(range(T)), B, pool, device, hot=False, seed=100 + s)
        batches.append((torch.randn(B, 13, device=device), ids, off,
                        torch.randint(0, 2, (B,), device=device).float()))

    def step(i):
        x, ids, off, y = batches[i % len(batches)]
        loss = nn.functional.binary_cross_entropy_with_logits(dense(x, emb(ids, off)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # the embedding update happens here
        opt.step()
        return loss.detach()

    res = _train_loop(step, steps, 3 if small else 20, B, device)
    res["shape"] = {"tables": T, "rows": rows, "dim": D, "lookups_per_sample": sum(pool)}
    print(f"  dlrm_tbe: {res['samples_per_s']:.0f} samples/s ({res['steps']} steps, B={B})", flush=True)
    return res


def section_dlrm_ebc(device, execution: str, small: bool, steps: int) -> dict:
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

        from anyrec.kernels.ebc import TritonEmbeddingBagCollection, dense_named_parameters
    except Exception as ex:
        return skipped_without_torchrec("dlrm_ebc", ex)

    class OpNames(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    T, rows, D, B, pool = _dlrm_shape(small)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=D, num_embeddings=rows, feature_names=[f"f{i}"])
              for i in range(T)]
    emb = TritonEmbeddingBagCollection(tables, OptimizerConfig("rowwise_adagrad", lr=0.005), device=device,
                                       execution=execution, bounds_check="off")
    model = nn.ModuleDict({"emb": emb, "dense": DenseArch(13, D, T, small, device)})
    opt = torch.optim.Adagrad([p for _, p in dense_named_parameters(model)], lr=0.005)
    keys = [f"f{i}" for i in reversed(range(T))]  # not table order: mapped by name, no permute
    batches = []
    for _ in range(4):
        lengths = torch.tensor([pool[int(k[1:])] for k in keys for _ in range(B)], device=device)
        ids = torch.randint(0, rows, (int(lengths.sum()),), device=device)
        kjt = KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths)  # lengths only, as loaders build
        y = torch.randint(0, 2, (B,), device=device).float()
        batches.append((torch.randn(B, 13, device=device), kjt, y))

    def step(i):
        x, kjt, y = batches[i % len(batches)]
        logit = model["dense"](x, model["emb"](kjt).values())
        loss = nn.functional.binary_cross_entropy_with_logits(logit, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    with OpNames() as rec:
        step(0)
    fbgemm_ops = sorted(op for op in rec.ops if op.startswith("fbgemm"))
    if fbgemm_ops:
        raise AssertionError(f"fbgemm ops called in a training step: {fbgemm_ops}")
    res = _train_loop(step, steps, 3 if small else 20, B, device)
    res["fbgemm_ops_called"] = fbgemm_ops
    print(f"  dlrm_ebc: {res['samples_per_s']:.0f} samples/s, fbgemm ops called: none", flush=True)
    return res


def section_dlrm_sharded(device, execution: str, small: bool, steps: int) -> dict:
    """The sharded path at world size 1: DistributedModelParallel with anyrec's TBE sharder, every table
    table-wise on this device, torchrec's input/output distribution on the portable sparse ops (what a
    GPU without CUDA FBGEMM runs); a profiler check that each fbgemm:: call is served by them."""
    try:
        from torch.profiler import ProfilerActivity, profile
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        from anyrec.backends import get_backend, sparse_ops
        from anyrec.backends.dispatch import get_impl
        from anyrec.config import OptimConfig
        from anyrec.kernels.torchrec_kernel import TritonEmbeddingBagCollectionSharder
        from anyrec.planner.simple import to_sharding_plan
        from anyrec.runtime.distributed import destroy_distributed
        from anyrec.trainer.optim import embedding_optimizer
    except Exception as ex:
        return skipped_without_torchrec("dlrm_sharded", ex)

    backend = get_backend("auto")
    # A group of one of its own (an in-memory store): the suite never joins a job whose launcher
    # variables it happens to inherit.
    torch.distributed.init_process_group(backend.dist_backend, store=torch.distributed.HashStore(), rank=0,
                                         world_size=1, device_id=device if device.type != "cpu" else None)
    try:
        choice = sparse_ops.install(backend, "portable")
        missing = sparse_ops.missing_kernels(choice.dispatch_key)  # FBGEMM's gaps on this device
        T, rows, D, B, pool = _dlrm_shape(small)

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=D, num_embeddings=rows,
                                             feature_names=[f"f{i}"]) for i in range(T)]
                self.sparse_arch = EmbeddingBagCollection(tables, device=torch.device("meta"))
                self.dense = DenseArch(13, D, T, small, device)

            def forward(self, x, kjt, y):
                logit = self.dense(x, self.sparse_arch(kjt).values())
                return nn.functional.binary_cross_entropy_with_logits(logit, y)

        net = Net()
        opt_cls, opt_kwargs = embedding_optimizer(OptimConfig(name="rowwise_adagrad", embedding_lr=0.005))
        apply_optimizer_in_backward(opt_cls, net.sparse_arch.parameters(), opt_kwargs)
        sharder = TritonEmbeddingBagCollectionSharder(execution=execution)
        on_rank0 = {f"t{i}": ("table_wise", [0]) for i in range(T)}
        plan = to_sharding_plan(net.sparse_arch, on_rank0, "sparse_arch", 1, 1, device.type,
                                compute_kernel=get_impl("embedding", "triton").compute_kernel(),
                                sharder=sharder)
        model = DistributedModelParallel(net, device=device, plan=plan, sharders=[sharder])
        dense_params = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
        opt = torch.optim.Adagrad(dense_params, lr=0.005)
        keys = [f"f{i}" for i in reversed(range(T))]  # not table order: the input dist permutes
        batches = []
        for _ in range(4):
            lengths = torch.tensor([pool[int(k[1:])] for k in keys for _ in range(B)], device=device)
            ids = torch.randint(0, rows, (int(lengths.sum()),), device=device)
            kjt = KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths)
            y = torch.randint(0, 2, (B,), device=device).float()
            batches.append((torch.randn(B, 13, device=device), kjt, y))

        def step(i):
            x, kjt, y = batches[i % len(batches)]
            loss = model(x, kjt, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # the embedding update happens here
            opt.step()
            return loss.detach()

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(0)
        recorded: dict[str, int] = {}
        for ev in prof.events():
            if ev.name.startswith("fbgemm::"):
                recorded[ev.name] = recorded.get(ev.name, 0) + 1
        ours = set(sparse_ops.installed(choice.dispatch_key))
        if not recorded or not set(recorded) <= ours:
            raise AssertionError(f"fbgemm ops called {recorded}, not all served by the portable kernels "
                                 f"(installed for {sorted(ours)})")
        res = _train_loop(step, steps, 3 if small else 20, B, device)
        res.update(fbgemm_ops_called=recorded, served_by_portable=True, fbgemm_missing_kernels=missing,
                   shape={"tables": T, "rows": rows, "dim": D, "lookups_per_sample": sum(pool)})
        print(f"  dlrm_sharded: {res['samples_per_s']:.0f} samples/s, world size 1, portable sparse ops "
              f"served {sum(recorded.values())} fbgemm calls per step", flush=True)
        return res
    finally:
        sparse_ops.uninstall(backend)
        destroy_distributed()


# ---- driver --------------------------------------------------------------------------------------



def section_data(device: torch.device, small: bool) -> dict:
    """Synthetic batches made on the device at DLRMv2 shape (goal: >= 20 M samples/s on an H200),
    and the check that they are the CPU's batches bit for bit (ids, lengths, labels, dense)."""
    skipped = torchrec_missing("data")
    if skipped:
        return skipped
    from anyrec.config import DataConfig
    from anyrec.data.synthetic import SyntheticCriteo

    bench = load_benchmark("data")
    batch = 512 if small else 16384
    model = bench.dlrmv2([1000] * 26 if small else bench.DLRMV2_ROWS)
    make = {d: SyntheticCriteo(model, DataConfig(batch_size=batch), seed=0, rank=1, world_size=2, device=d)
            for d in (device, torch.device("cpu"))}
    wall, _ = bench.time_source(make[device], 3 if small else 50, 2, lambda: sync(device))
    mismatched = []
    for step in (0, 7):
        here, cpu = make[device].batch(step), make[torch.device("cpu")].batch(step)
        for name, a, b in [("ids", here.sparse_features.values(), cpu.sparse_features.values()),
                           ("lengths", here.sparse_features.lengths(), cpu.sparse_features.lengths()),
                           ("labels", here.labels, cpu.labels),
                           ("dense", here.dense_features, cpu.dense_features)]:
            if not torch.equal(a.cpu(), b):
                mismatched.append(f"step {step} {name}")
    rate = (3 if small else 50) * batch / wall
    print(f"  synthetic on {device}: {rate:,.0f} samples/s at batch {batch}; same bits as the CPU: "
          f"{not mismatched} {mismatched}", flush=True)
    return {"batch_size": batch, "samples_per_s": rate, "goal_samples_per_s": 20e6,
            "identical_to_cpu": not mismatched, "mismatched": mismatched}


PARITY_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


def section_parity(device: torch.device, small: bool, out_dir: Path) -> dict:
    """The one-device trainer on the CPU (anyrec's torch TBE) and here (the Triton TBE; the torch TBE
    on a CPU-only machine), 20 steps of dlrm_tiny per optimizer, compared by anyrec-parity; each
    optimizer's records are saved as parity_<optimizer>.json (`parity.against` input elsewhere)."""
    skipped = torchrec_missing("parity")
    if skipped:
        return skipped
    from anyrec.parity import compare

    kernel = "triton" if device.type != "cpu" else "torch"
    result = {}
    for opt in PARITY_OPTIMIZERS[-2:-1] if small else PARITY_OPTIMIZERS:
        saved = out_dir / f"parity_{opt}.json"
        code, tail = run_logged([
            sys.executable, "-m", "anyrec.parity", "model=dlrm_tiny", f"optim={opt}",
            f"trainer.steps={3 if small else 20}",
            f'parity.variants=["backend=cpu backend.embedding_kernel=torch", '
            f'"backend.embedding_kernel={kernel}"]', f"parity.save={saved}"], 900)
        runs = json.loads(saved.read_text())["runs"] if saved.is_file() else []
        row = {"exit": code, "table": [ln for ln in tail.splitlines() if ln.startswith("|")][-2:]}
        if len(runs) == 2:
            row.update(compare(runs[0], runs[1]), final_loss=[r["losses"][-1] for r in runs])
        else:
            row["error"] = tail[-1500:]
        print(f"  parity {opt}: cpu vs {device} ({kernel}): {row.get('loss_rel', 'failed')} rel loss, "
              f"{row.get('weight_abs', '-')} abs weight", flush=True)
        result[opt] = row
    return result


def section_interaction(out_dir: Path, small: bool) -> dict:
    """benchmarks/interaction.py (every contender checked against the anchor first); JSON in
    interaction.json."""
    args = ["--json", str(out_dir / "interaction.json")] + (["--small"] if small else [])
    rows = load_benchmark("interaction").main(args)
    return {"rows": [{k: r[k] for k in ("batch", "dim", "contender", "us", "ratio_to_anchor")} for r in rows]}


def section_attention(out_dir: Path, small: bool) -> dict:
    """benchmarks/hstu_attention.py (its torch version times only up to 1,024 positions on a GPU); JSON in
    hstu_attention.json."""
    args = ["--json", str(out_dir / "hstu_attention.json")] + (["--small"] if small else [])
    report = load_benchmark("hstu_attention").main(args)
    rows = [{k: r[k] for k in ("contender", "mode", "max_len", "tokens", "dtype", "ms", "peak_fraction")}
            | {"tflop_per_s": r["gflop_per_s"] / 1e3} for r in report["rows"]]
    return {"rows": rows, "triton": report["triton"], "peak_of": report["rows"][0]["peak_of"]}


def section_loop(device: torch.device, small: bool, out_dir: Path) -> dict:
    """benchmarks/train_step.py through the one-device Triton TBE (the torch TBE on a CPU-only
    machine): the trainer's whole loop with device-made data against its step on pre-made batches
    (goal: loop/step >= 0.95 at DLRMv2 shape), next to plain PyTorch; JSON in train_step.json."""
    skipped = torchrec_missing("loop")
    if skipped:
        return skipped
    kernel = "triton" if device.type != "cpu" else "torch"
    args = ["--embedding-kernel", kernel, "--no-compile", "--json", str(out_dir / "train_step.json")]
    args += (["--small", "--steps", "3", "--warmup", "1"] if small
             else ["--repeats", "3", "--distinct-batches", "53"])
    res = load_benchmark("train_step").main(args)
    return {k: res[k] for k in ("model", "batch_size", "embedding_kernel", "samples_per_s", "loop_vs_step")}


def section_dlrmv4(device: torch.device, small: bool, steps: int) -> dict:
    """DLRMv4's training step through anyrec's Trainer on this one device: the reference's dense shapes
    (3 STU layers, D 512, 4 heads, sequences up to 4,096 tokens) at 1,024 samples, its tables scaled to
    1/1,000 to fit one device; the sequence tables on anyrec's TBE (Triton on an accelerator, torch on a
    CPU), the attention the backend chooses, bf16 where the device has it. Samples/s, the measured step
    against the planner's prediction and the peak memory against its. --small: dlrmv4_small at 32."""
    skipped = torchrec_missing("dlrmv4")
    if skipped:
        return skipped
    from anyrec import _hydra
    from anyrec.trainer.trainer import Trainer

    kernel = "torch" if device.type == "cpu" else "triton"
    shape = (["model=dlrmv4_small", "data.batch_size=32"] if small else
             ["model=dlrmv4", "model.hstu.table_scale=0.001", "data.sequence.table_scale=0.001",
              "data.batch_size=1024"])
    run = [f"backend.embedding_kernel={kernel}", f"trainer.steps={steps + 3}", "trainer.progress=false",
           "trainer.tensorboard=false", "trainer.calibrate=never", "trainer.checkpoint.dir=null",
           "trainer.run_dir=null"]
    cfg = _hydra.compose_job([*shape, *run])
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    keys = ("model", "batch_size_per_rank", "steps", "samples_per_s", "measured_step_ms", "predicted_step_ms",
            "prediction_error", "attention_kernel", "embedding_kernel", "precision",
            "predicted_peak_memory_bytes_per_rank", "measured_peak_memory_bytes_per_rank",
            "memory_prediction_error", "final_loss")
    res = {k: summary[k] for k in keys}
    print(f"  dlrmv4: {res['samples_per_s']:.0f} samples/s at {res['batch_size_per_rank']} per step, "
          f"step {res['measured_step_ms']:.1f} ms measured vs {res['predicted_step_ms']:.1f} ms predicted, "
          f"attention {res['attention_kernel']}, tables on {res['embedding_kernel']}, {res['precision']}",
          flush=True)
    return res


def section_compile(device: torch.device, small: bool, steps: int) -> dict:
    """The trainer's step (anyrec's Triton TBE on one device; torch's on a CPU) eager and with the dense
    model compiled (trainer.compile), at train_step.py's DLRMv2 shape: samples/s of `Trainer.run_steps`
    over the same pre-made batches, the build's seconds (the compile happens there) and what was chosen."""
    skipped = torchrec_missing("compile")
    if skipped:
        return skipped
    from anyrec.config import AnyrecConfig, BackendConfig, DataConfig, OptimConfig, TrainerConfig
    from anyrec.data.synthetic import SyntheticCriteo
    from anyrec.trainer.trainer import Trainer

    cfg, batch = load_benchmark("train_step").shapes(small)
    warmup = 2 if small else 5
    batches = [b.to(device) for b in (SyntheticCriteo(cfg, DataConfig(batch_size=batch), seed=0).batch(i)
                                      for i in range(4))]
    kernel = "triton" if device.type != "cpu" else "torch"
    out: dict = {"model": cfg.name, "batch_size": batch, "steps": steps, "embedding_kernel": kernel}
    for setting in ("false", "true"):
        t0 = time.perf_counter()
        trainer = Trainer(AnyrecConfig(
            model=cfg, data=DataConfig(batch_size=batch), backend=BackendConfig(embedding_kernel=kernel),
            optim=OptimConfig(name="adagrad", embedding_lr=0.01, dense_lr=0.01),
            trainer=TrainerConfig(steps=warmup + steps, eval_steps=0, progress=False, tensorboard=False,
                                  mixed_precision="fp32", compile=setting, calibrate="never")))
        try:
            build_s = time.perf_counter() - t0
            losses: list[float] = []
            trainer.step_hooks.append(lambda t, out=losses: out.append(float(t.last_loss)) if len(out) < 3
                                      else None)
            cycled = (batches[i % len(batches)] for i in range(warmup + steps))
            trainer.run_steps(warmup, cycled)  # the first step's compile-cache hits included here
            start = time.perf_counter()
            trainer.run_steps(steps, cycled)
            seconds = time.perf_counter() - start
            name = "compiled" if setting == "true" else "eager"
            out[name] = {"samples_per_s": steps * batch / seconds, "step_ms": seconds / steps * 1e3,
                         "build_s": build_s, "compiled": trainer.compiled.compiled,
                         "reason": trainer.compiled.reason, "first_losses": losses}
            print(f"  compile: {name} {out[name]['samples_per_s']:,.0f} samples/s, build {build_s:.1f} s "
                  f"({trainer.compiled.reason})", flush=True)
        finally:
            trainer.close()
    out["compiled_vs_eager"] = out["compiled"]["samples_per_s"] / out["eager"]["samples_per_s"]
    return out


def section_calibrate(small: bool, out_dir: Path) -> dict:
    """`python -m anyrec.calibrate` on this device (one process: embedding steps per available
    implementation, GEMM, copies, host-to-device), written to calibration.yaml."""
    skipped = torchrec_missing("calibrate")
    if skipped:
        return skipped
    out = out_dir / "calibration.yaml"
    size = "small" if small else "large"
    code, tail = run_logged([sys.executable, "-m", "anyrec.calibrate", f"calibrate.output={out}",
                             f"calibrate.budget_s={0.05 if small else 0.5}", f"calibrate.size={size}"], 900)
    print(f"  calibrate: exit {code}, {'written' if out.is_file() else 'not written'}", flush=True)
    if code != 0:
        raise RuntimeError(f"anyrec.calibrate exited {code}: {tail[-1500:]}")
    return {"file": str(out), "yaml": out.read_text()}


# A wrapper that runs `anyrec.train` and, on exit, records the device's peak reserved memory (the trainer
# resets the peaks when training starts; its summary carries the allocated peak).
_RESERVED_WRAPPER = """
import atexit, json, runpy, sys
import torch
path = sys.argv[1]
def _record():
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    reserved = torch.accelerator.max_memory_reserved() if acc is not None and acc.type != "cpu" else None
    open(path, "w").write(json.dumps(reserved))
atexit.register(_record)
sys.argv = ["anyrec.train", *sys.argv[2:]]
runpy.run_module("anyrec.train", run_name="__main__", alter_sys=True)
"""


def section_memory(device: torch.device, small: bool, out_dir: Path) -> dict:
    """The trainer's one-device step: predicted peak memory per term against the measured allocated and
    reserved peaks (the summary's memory_prediction_error; the reserved one here)."""
    skipped = torchrec_missing("memory")
    if skipped:
        return skipped
    model, batch, steps = ("dlrm_tiny", 256, 4) if small else ("dlrmv2_small", 16384, 20)
    reserved_path = out_dir / "memory_reserved.json"
    cmd = [sys.executable, "-c", _RESERVED_WRAPPER, str(reserved_path), f"model={model}",
           f"data.batch_size={batch}", f"trainer.steps={steps}", "trainer.eval_steps=0",
           "trainer.calibrate=never", "trainer.progress=false", "trainer.tensorboard=false",
           f"hydra.run.dir={out_dir / 'memory_run'}"]
    code, out = run_logged(cmd, 600)
    if code != 0:
        raise RuntimeError(f"anyrec.train exited {code}: {out[-1500:]}")
    summary = next(json.loads(ln) for ln in reversed(out.splitlines()) if ln.startswith("{"))
    reserved = json.loads(reserved_path.read_text())
    predicted_reserved = summary["predicted_reserved_memory_bytes_per_rank"]
    keys = ("predicted_peak_memory_bytes_per_rank", "measured_peak_memory_bytes_per_rank",
            "memory_prediction_error", "predicted_memory_terms", "predicted_reserved_memory_bytes_per_rank")
    res = {k: summary[k] for k in keys}
    res.update(model=model, batch_size=batch, measured_peak_reserved_bytes=reserved,
               reserved_prediction_error=(predicted_reserved[0] / reserved - 1.0
                                          if reserved and predicted_reserved else None))
    err = res["memory_prediction_error"]
    print(f"  memory: predicted {res['predicted_peak_memory_bytes_per_rank']} B, measured "
          f"{res['measured_peak_memory_bytes_per_rank']} B allocated (error {err}), reserved {reserved} B",
          flush=True)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="toy sizes (for CPU tests)")
    ap.add_argument("--steps", type=int, default=300, help="timed DLRM training steps per loop")
    ap.add_argument("--execution", default="auto", choices=["auto", "triton", "torch"])
    ap.add_argument("--only", default="", help="comma list of sections to run (default: all)")
    a = ap.parse_args(argv)
    out_dir = Path(os.environ.get("OUT") or "gpu_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    device = accelerator()
    if a.execution == "auto":  # the kernels take an explicit choice: Triton on an accelerator
        a.execution = "torch" if device.type == "cpu" else "triton"
    small = a.small
    steps = min(a.steps, 5) if small else a.steps
    print(f"=== anyrec GPU suite on {device} (small={small}, execution={a.execution}); JSON in {out_dir}")
    if device.type == "cpu":
        print("GPU: not run (no accelerator here); CPU numbers below are for plumbing only")
    sections = {
        "env": lambda: section_env(device),
        "correctness": lambda: section_correctness(device, a.execution, small),
        "tbe": lambda: section_tbe(out_dir, a.execution, small),
        "interaction": lambda: section_interaction(out_dir, small),
        "attention": lambda: section_attention(out_dir, small),
        "dlrm_tbe": lambda: section_dlrm_tbe(device, a.execution, small, steps),
        "dlrm_ebc": lambda: section_dlrm_ebc(device, a.execution, small, steps),
        "dlrm_sharded": lambda: section_dlrm_sharded(device, a.execution, small, steps),
        "data": lambda: section_data(device, small),
        "parity": lambda: section_parity(device, small, out_dir),
        "loop": lambda: section_loop(device, small, out_dir),
        "compile": lambda: section_compile(device, small, steps),
        "dlrmv4": lambda: section_dlrmv4(device, small, steps),
        "calibrate": lambda: section_calibrate(small, out_dir),
        "memory": lambda: section_memory(device, small, out_dir),
    }
    only = [s for s in a.only.split(",") if s]
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "small": small, "sections": {}}
    for name, fn in sections.items():
        if only and name not in only and name != "env":
            continue
        t0 = time.perf_counter()
        print(f"--- {name}", flush=True)
        try:
            result, status = fn(), "ok"
            if isinstance(result, dict) and "skipped" in result:
                status = "skipped"
        except Exception as ex:
            traceback.print_exc()
            result, status = {"error": f"{type(ex).__name__}: {ex}"[:2000]}, "failed"
        report["sections"][name] = {"status": status, "seconds": time.perf_counter() - t0, **result}
        (out_dir / "gpu_suite.json").write_text(json.dumps(report, indent=1, default=str))
        if device.type != "cpu" and hasattr(torch.accelerator, "empty_cache"):
            torch.accelerator.empty_cache()  # the next section's tables need the memory
    print("=== summary: " + ", ".join(f"{k} {v['status']} ({v['seconds']:.0f}s)"
                                      for k, v in report["sections"].items()))
    return report


if __name__ == "__main__":
    rep = main()
    sys.exit(1 if any(s["status"] == "failed" for s in rep["sections"].values()) else 0)
