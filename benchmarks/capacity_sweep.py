"""Never out of memory on a plan it calls feasible: for each job on the simulated device (simdev), find
the smallest per-device capacity the co-design planner accepts, then train its ranks at capacities from
just below it up to 2x, each device holding exactly that many bytes (`SIMDEV_MEMORY_BYTES`: simdev's
allocator raises `torch.OutOfMemoryError` past it, as CUDA's does). The anchor, in the same table:
torchrec's `EmbeddingShardingPlanner` given the same topology and capacity (its default storage
reservation and estimators), its plans trained the same way.

    python benchmarks/capacity_sweep.py [--small] [--only JOB ...] [--factors F ...] [--anyrec-only]
                                        [--steps N] [--output out.json]

The jobs cover every optimizer, batches up to 4,096 per rank, 2D (replicated sharding groups) and the
sequence model dlrmv4_small; simdev
runs its allocator with expandable segments, as anyrec's backends do on CUDA and ROCm.

Each cell is one `torchrun` job: `ok` (trained every step), `oom` (an allocation failed), `refused`
(the planner said no before any rank allocated a table; anyrec's one-line reason is kept) or `error`.
Below anyrec's smallest capacity the job must be refused; at or above it it must train.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from anyrec.proc import run_session  # noqa: E402

# name -> Hydra overrides of a simdev job (the default planner, its own choice of sharding); 2 ranks unless
# RANKS says otherwise. data.batch_size is per rank.
JOBS: dict[str, list[str]] = {
    "tiny_adagrad_b256": ["model=dlrm_tiny", "data.batch_size=256"],
    "small_adagrad_b256": ["model=dlrm_small", "data.batch_size=256"],
    "small_sgd_b1024": ["model=dlrm_small", "optim=sgd", "data.batch_size=1024"],
    "small_rowwise_b512": ["model=dlrm_small", "optim=rowwise_adagrad", "data.batch_size=512"],
    "small_adam_b4096": ["model=dlrm_small", "optim=adam", "data.batch_size=4096"],
    "v2small_adagrad_b256": ["model=dlrmv2_small", "data.batch_size=256"],
    "v2small_adagrad_b2048": ["model=dlrmv2_small", "data.batch_size=2048"],
    "v2small_rowwise_b4096": ["model=dlrmv2_small", "optim=rowwise_adagrad", "data.batch_size=4096"],
    "v2small_sgd_b4096": ["model=dlrmv2_small", "optim=sgd", "data.batch_size=4096"],
    "v2small_adam_b1024": ["model=dlrmv2_small", "optim=adam", "data.batch_size=1024"],
    # 2D: groups of one rank holding every table, replicas averaged (2 ranks), and groups of two (4 ranks)
    "small_2d_g1_b1024": ["model=dlrm_small", "planner.sharding_group_size=1", "data.batch_size=1024"],
    "v2small_2d_g2_b512": ["model=dlrmv2_small", "planner.sharding_group_size=2", "optim=rowwise_adagrad",
                           "data.batch_size=512"],
    # DLRMv4: sequence tables (EmbeddingCollection) and the HSTU layers' activations, which dominate its
    # memory: the recipe's row-wise Adagrad and Adam, 128 and 512 samples per rank
    "v4small_rowwise_b128": ["model=dlrmv4_small"],
    "v4small_adam_b512": ["model=dlrmv4_small", "optim=adam", "data.batch_size=512"],
}
RANKS = {"v2small_2d_g2_b512": 4}
SMALL = ("tiny_adagrad_b256",)
# Capacities as multiples of anyrec's smallest accepted one: below it anyrec must refuse (where
# torchrec's planner may still accept and run out of memory), from it up it must train.
FACTORS = (0.4, 0.6, 0.9, 1.0, 1.5, 2.0)
SMALL_FACTORS = (0.9, 1.0, 2.0)
WORLD = 2


def install_simdev(tmp: Path) -> Path:
    """examples/simdev installed with pip into a fresh target folder under `tmp` (not the venv)."""
    src = shutil.copytree(ROOT / "examples" / "simdev", tmp / "src")
    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--no-index", "--target", str(target), str(src)],
                   check=True, capture_output=True, timeout=300)
    return target


def job_overrides(workload: list[str], steps: int) -> list[str]:
    """A 2-rank simdev training job of `workload` (Hydra overrides), `steps` steps, no evaluation."""
    return ["backend=simdev", *workload, f"trainer.steps={steps}", "trainer.eval_steps=0",
            "trainer.calibrate=never", "trainer.progress=false"]


def accepts(name: str, capacity: int) -> bool:
    """Whether anyrec's planner finds a plan for job `name` on its simdev devices of `capacity` bytes
    (planned in this process, as rank 0 of the job plans: `anyrec-plan` on the same config, without its
    what-ifs)."""
    from anyrec import _hydra, plan
    from anyrec.planner.types import InfeasiblePlanError

    cfg = _hydra.compose_job([*job_overrides(JOBS[name], 1), f"topology.world_size={RANKS.get(name, WORLD)}",
                              f"+hardware.spec.memory_bytes={capacity}"])
    try:
        result = plan.run(cfg, print_fn=lambda _: None)
    except InfeasiblePlanError:
        return False
    # anyrec-plan may fit a job by activation recompute, a what-if the trainer refuses
    return not result.workload.options.activation_recompute


def smallest_capacity(name: str, hi: int = 2**34) -> int:
    """The smallest capacity (to 0.5 %) anyrec's planner accepts for job `name`."""
    if not accepts(name, hi):
        raise RuntimeError(f"{name}: no plan even at {hi} bytes per device")
    lo = 1 << 20
    while hi - lo > max(lo // 200, 4096):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if accepts(name, mid) else (mid, hi)
    return hi


def worker(overrides: list[str]) -> None:
    """One rank of a job trained on torchrec's plan for this device's capacity; prints the summary."""
    import torch
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import PlannerError
    from torchrec.distributed.planner.types import Topology as TrTopology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from anyrec import _hydra
    from anyrec.backends import get_backend, resolve_hardware
    from anyrec.models.family import resolve_family
    from anyrec.planner.planned import ParallelLayout, PlannedJob
    from anyrec.trainer.optim import embedding_optimizer
    from anyrec.trainer.planning import sharders
    from anyrec.trainer.trainer import Trainer

    cfg = _hydra.compose_job(overrides)
    backend = get_backend(cfg.backend.name)
    kernels = backend.select_kernels(cfg.backend)
    family = resolve_family(cfg.model)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    spec = resolve_hardware(cfg.hardware.sku, cfg.hardware.spec, backend, cfg.hardware.measurements).spec
    meta = torch.device("meta")
    module = family.build_train(cfg.model, meta, meta, kernels)  # the training module, as the trainer's
    opt_cls, opt_kwargs = embedding_optimizer(cfg.optim)
    apply_optimizer_in_backward(opt_cls, family.sparse_module(module).parameters(), opt_kwargs)
    # torchrec as its users run it: the whole device as its HBM, its default storage reservation.
    topo = TrTopology(world_size=world, local_world_size=world, compute_device="cuda",
                      hbm_cap=spec.memory_bytes, ddr_cap=spec.host_memory_bytes or spec.memory_bytes)
    try:
        tr_plan = EmbeddingShardingPlanner(topology=topo, batch_size=cfg.data.batch_size).plan(
            module, sharders(kernels["embedding"], pooled=family.pooled))
    except PlannerError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps({"refused": str(e).splitlines()[0][:300]}), flush=True)
        return
    # torchrec's plan as the job, 1D over the world (the Trainer names each shard's device)
    trainer = Trainer(cfg, PlannedJob(tr_plan, ParallelLayout.one_d(world, world)))
    failed = True
    try:
        summary = trainer.train()
        failed = False
    finally:
        trainer.close(failed=failed)
    if trainer.dist.is_main:
        print(json.dumps(summary), flush=True)


def outcome(proc: subprocess.CompletedProcess) -> dict:
    """A job's cell: ok / oom / refused / error, with anyrec's predicted and measured peaks when it ran."""
    text = proc.stdout + proc.stderr
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines and "refused" in lines[-1]:
        return {"result": "refused", "reason": lines[-1]["refused"]}
    if proc.returncode == 0 and lines:
        s = lines[-1]
        return {"result": "ok", "peak_memory_bytes": s.get("peak_memory_bytes"),
                "measured_peak_memory_bytes_per_rank": s.get("measured_peak_memory_bytes_per_rank"),
                "predicted_peak_memory_bytes_per_rank": s.get("predicted_peak_memory_bytes_per_rank")}
    if "OutOfMemoryError" in text or "out of memory" in text:
        line = next((ln for ln in text.splitlines() if "out of memory" in ln), "out of memory")
        return {"result": "oom", "reason": line.strip()[:300]}
    errors = [ln.strip() for ln in proc.stderr.splitlines() if ln.startswith("anyrec-train: error:")
              or ln.startswith("error:")]
    if errors and ("fit" in errors[-1] or "memory" in errors[-1] or "plan" in errors[-1]):
        return {"result": "refused", "reason": errors[-1][:300], "error_lines": len(set(errors))}
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-3:]
    return {"result": "error", "reason": " | ".join(tail)[:300]}


def run_job(planner: str, workload: list[str], capacity: int, steps: int, simdev: Path, workdir: Path,
            timeout_s: float, ranks: int = WORLD) -> dict:
    """One job of `workload` on `ranks` ranks at `capacity` bytes per device, planned by anyrec's planner
    or torchrec's."""
    run_dir = workdir / f"{planner}_{abs(hash(tuple(workload)))}_{capacity}"
    overrides = [*job_overrides(workload, steps), f"hydra.run.dir={run_dir}"]
    args = (["-m", "anyrec.train", *overrides] if planner == "anyrec"
            else [str(Path(__file__).resolve()), "--worker", "--", *overrides])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(simdev)]), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "SIMDEV_MEMORY_BYTES": str(capacity),
           "ANYREC_CACHE_DIR": str(workdir / "cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *args]
    try:
        proc = run_session(cmd, timeout_s, env=env, cwd=workdir)
    except subprocess.TimeoutExpired:
        return {"result": "error", "reason": f"timed out after {timeout_s:.0f} s"}
    return outcome(proc)


def sweep(names: tuple[str, ...], factors: tuple[float, ...], steps: int, workdir: Path,
          timeout_s: float, planners: tuple[str, ...] = ("anyrec", "torchrec")) -> list[dict]:
    """Per job and capacity, anyrec's cell and torchrec's (a planner left out: `skipped`)."""
    simdev = install_simdev(workdir / "simdev")
    sys.path.insert(0, str(simdev))
    rows = []
    for name in names:
        smallest = smallest_capacity(name)
        for f in factors:
            cap = int(smallest * f)
            row = {"job": name, "capacity_bytes": cap, "factor": f, "smallest_accepted_bytes": smallest}
            for planner in ("anyrec", "torchrec"):
                row[planner] = (run_job(planner, JOBS[name], cap, steps, simdev, workdir, timeout_s,
                                        RANKS.get(name, WORLD))
                                if planner in planners else {"result": "skipped"})
            print(line(row), flush=True)
            rows.append(row)
    return rows


def _mb(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def line(r: dict) -> str:
    a, t = r["anyrec"], r["torchrec"]
    peaks = a.get("measured_peak_memory_bytes_per_rank") or []
    return (f"{r['job']:<22} {r['factor']:>5.2f} {_mb(r['capacity_bytes']):>9} {a['result']:>8} "
            f"{t['result']:>8}  {'/'.join(_mb(p) for p in peaks) or '-':<13} {a.get('reason', '')[:90]}")


def table(rows: list[dict]) -> str:
    head = (f"{'job':<22} {'x min':>5} {'cap MiB':>9} {'anyrec':>8} {'torchrec':>8}  {'peak MiB/rank':<13} "
            "reason (anyrec)")
    accepted = [r for r in rows if r["factor"] >= 1.0]
    a_oom = sum(r["anyrec"]["result"] == "oom" for r in accepted)
    t_ran = [r for r in rows if r["torchrec"]["result"] in ("ok", "oom")]  # (not skipped)
    t_oom = sum(r["torchrec"]["result"] == "oom" for r in t_ran)
    below = [r for r in rows if r["factor"] < 1.0]  # anyrec must refuse these
    refused = sum(r["anyrec"]["result"] == "refused" for r in below)
    foot = (f"anyrec: {a_oom} out of memory among {len(accepted)} accepted plans; {refused} of {len(below)} "
            f"jobs below the smallest capacity refused at planning.\n"
            f"torchrec: {t_oom} out of memory among {len(t_ran)} plans it made "
            f"({sum(r['torchrec']['result'] == 'refused' for r in rows)} capacities refused).")
    return "\n".join([head, *map(line, rows), foot])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="one job at three capacities (for tests)")
    ap.add_argument("--only", nargs="+", choices=tuple(JOBS), help="run only these jobs")
    ap.add_argument("--factors", nargs="+", type=float, help=f"capacities as multiples of the smallest "
                    f"accepted (default {' '.join(map(str, FACTORS))})")
    ap.add_argument("--anyrec-only", action="store_true", help="leave torchrec's planner out")
    ap.add_argument("--steps", type=int, default=None, help="training steps per job (default 8; 3 small)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    ap.add_argument("--output", type=Path, help="write the rows as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.overrides)
        return []
    names = tuple(args.only) if args.only else SMALL if args.small else tuple(JOBS)
    factors = tuple(args.factors) if args.factors else SMALL_FACTORS if args.small else FACTORS
    steps = args.steps or (3 if args.small else 8)
    with tempfile.TemporaryDirectory(prefix="anyrec-capacity-") as tmp:
        rows = sweep(names, factors, steps, Path(tmp), args.timeout,
                     ("anyrec",) if args.anyrec_only else ("anyrec", "torchrec"))
    print(table(rows))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
