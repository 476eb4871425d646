"""How far one training step is from its floor on this machine: the floor from the calibrated figures,
anyrec's measured step, the MLPerf DLRM reference's measured step, each as a multiple of the floor, and
anyrec's step breakdown (where the rest goes).

    python benchmarks/step_floor.py --hardware cal.yaml --reference /path/to/dlrm --json out.json
    python benchmarks/step_floor.py --hardware cal.yaml --floor-only        # the floors, nothing run
    python benchmarks/step_floor.py --hardware cal.yaml --reference DLRM --compile --json out.json

The floor is the planner's analytical model (anyrec/planner/estimators.py) with every overhead taken out:
the plan the trainer would make for the job is costed again (`evaluate_assignment`) on the calibrated
device spec with the dense GEMMs at the measured GEMM FLOP/s (efficiency 1), embedding rows and their fused
optimizer state at the measured copy bandwidth (a kernel profile of efficiency 1, no per-row or per-launch
cost), the all-to-alls and all-reduces at the measured collective bus bandwidth with no latency, and none of
the measured framework costs (`DeviceSpec.step_*`). The dense optimizer's bytes (weights, gradients, state)
go at the copy bandwidth; the dot interaction's batched products at the GEMM rate. Overlap is what
torchrec's TrainPipelineSparseDist and DDP allow: the ids' all-to-all (the next batch's input distribution)
and the gradient all-reduce may hide under compute; the pooled embeddings' all-to-all and its gradient's are
on the critical path but for the bottom MLP, which the model runs (forward and backward) while they travel.
Per rank: max(compute + critical comms not hidden by the bottom MLP, overlappable comms); the step: the
slowest.

`--hardware` is a hardware file from `python -m anyrec.calibrate` (or a cache entry of it); without it,
this machine's cached calibration (`hardware=auto`), else an error. Measured steps: anyrec and the reference
alternate (`--pairs`), timed at the same call by benchmarks/vs_reference.py's runner; anyrec's breakdown is
one more run with `trainer.breakdown_steps` (torch.profiler; its steps run slower than unprofiled ones). The
default job is `anyrec.train` with no overrides (dlrm_small, synthetic data): timed by its own summary
(`measured_step_ms`); the reference's dlrm_small row is its counterpart. `--compile` adds, per shape,
`trainer.compile=auto`'s choice beside the other setting, compile time included (whole-job wall time).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import vs_reference as vsr  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# shape -> the anyrec overrides of its job (vs_reference's for the two MLPerf-comparable shapes)
DECISION = "dense model: "  # the trainer's log line saying compiled or eager, and why
SHAPES = {"dlrm_small": ["model=dlrm_small", "optim=adagrad"],
          "dlrmv2_small": ["model=dlrmv2_small", "optim=adagrad"],
          "default": []}


# ---- the floor -------------------------------------------------------------------------------------


def floor_of_job(overrides: list[str], hardware_files: list[str], nproc: int, batch_size: int | None) -> dict:
    """The plan the trainer makes for the job (costed with the first hardware file), its predicted step, and
    the floor (see the module's doc) on the best figure each file measured."""
    import torch

    from anyrec._hydra import compose_job
    from anyrec.backends import get_backend, resolve_hardware
    from anyrec.backends.dispatch import KernelProfile
    from anyrec.backends.hardware import EmbeddingCost
    from anyrec.history.cache import find_for_device
    from anyrec.models.dlrm import build_model, workload_facts
    from anyrec.planner.evaluate import evaluate_assignment
    from anyrec.planner.job import plan_model
    from anyrec.planner.types import Topology
    from anyrec.runtime.distributed import ONE_PROCESS
    from anyrec.trainer.planning import id_skew

    cfg = compose_job(overrides)
    backend = get_backend(cfg.backend.name)
    if not hardware_files:
        cached = find_for_device(backend, ONE_PROCESS, nproc)
        if cached is None:
            raise vsr.BenchmarkError(f"no calibration cached for this machine at {nproc} local ranks: "
                                     f"pass --hardware FILE (torchrun --nproc_per_node={nproc} -m "
                                     f"anyrec.calibrate calibrate.output=FILE)")
        hardware_files = [str(cached.path)]
    hardwares = [resolve_hardware(f, None, backend) for f in hardware_files]
    hardware = hardwares[0]
    impl = backend.select_kernels(cfg.backend)["embedding"]
    meta = torch.device("meta")
    model = build_model(cfg.model, meta, ebc_device=meta)
    batch = batch_size or cfg.data.batch_size
    topo = Topology(hardware.spec, nproc, nproc, backend.device_type)
    plan = plan_model(model, model.sparse_arch, workload_facts(cfg.model), cfg.planner, cfg.optim.name, topo,
                      batch, hardware.embedding_cost(impl), id_zipf_exponent=id_skew(cfg),
                      precision=backend.dense_precision(cfg.trainer.mixed_precision))
    # the lookups at the copy bandwidth: efficiency 1, no per-row or per-launch seconds (the access size,
    # the smallest memory transaction, stays the implementation's)
    ideal = KernelProfile(1.0, plan.workload.options.embedding.profile.access_bytes, 0.0)
    best = best_figures([h.spec for h in hardwares])
    floor = floor_of_plan(plan, best, EmbeddingCost(impl, ideal, ideal), cfg.model, evaluate_assignment)
    return {"hardware": hardware_files, "figures": {k: getattr(best, k) for k in FLOOR_FIGURES},
            "figures_per_file": [{k: getattr(h.spec, k) for k in FLOOR_FIGURES} for h in hardwares],
            "batch_size_per_rank": batch, "predicted_step_ms": plan.predicted_step_s * 1e3,
            "plan": {name: [o.sharding.value, sorted(set(o.ranks))] for name, o in plan.tables.items()},
            **floor}


# The measured figures the floor is made of (a calibration sets comms_efficiency 1: its link bandwidth is
# the achieved bus bandwidth)
FLOOR_FIGURES = ("memory_bw_bytes_per_s", "peak_fp32_flops", "peak_bf16_flops", "scale_up_bw_bytes_per_s",
                 "scale_out_bw_bytes_per_s")


def best_figures(specs: list) -> object:
    """The first spec with each floor figure the best any of `specs` measured (bandwidths and FLOP/s the
    machine has shown it reaches; on a shared host each calibration catches some of them under load), the
    links at their achieved bus bandwidth."""
    best = {k: max(getattr(s, k) * (s.comms_efficiency or 1.0 if "_bw_" in k and "scale" in k else 1.0)
                   for s in specs) for k in FLOOR_FIGURES}
    return specs[0].replace(comms_efficiency=1.0, **best)


def floor_of_plan(plan, spec, ideal_cost, model_cfg, evaluate) -> dict:
    """Per rank and for the step: compute (GEMM, embedding bytes, dense optimizer bytes), critical and
    overlappable comms, in ms, for `plan`'s assignment on `spec` with every overhead removed."""
    from anyrec.planner.estimators import OPTIMIZER_DENSE_STATE_BYTES, all_reduce_time_s
    from anyrec.planner.types import ShardingType

    zero = {f: 0.0 for f in ("step_fixed_s", "step_per_feature_s", "step_per_sample_s", "step_per_id_s",
                             "step_per_value_s", "step_per_pair_s", "step_per_dense_tensor_s",
                             "sharding_group_s", "replicated_table_s")}
    ideal_spec = spec.replace(dense_efficiency=1.0, comms_efficiency=1.0, **zero)
    topo = dataclasses.replace(plan.topology, device=ideal_spec)
    workload = dataclasses.replace(plan.workload,
                                   options=dataclasses.replace(plan.workload.options, embedding=ideal_cost))
    assignment = {n: (o.sharding.value, o.placement.value, o.ranks) for n, o in plan.tables.items()}
    ideal = evaluate(assignment, topo, workload)
    w, b, n = topo.world_size, workload.batch_size_per_rank, workload.dense_param_count
    from anyrec.planner.sequence import activation_bytes

    half = activation_bytes(topo, workload.options.dense_dtype) == 2
    flops_per_s = spec.peak_bf16_flops if half else spec.peak_fp32_flops
    f = len(model_cfg.table_rows) + 1
    # forward 2 FLOPs per parameter per sample, backward 4; the dot interaction's gram bmm likewise
    gemm_flops = 6.0 * n * b + (6.0 * b * f * f * model_cfg.embedding_dim if model_cfg.interaction == "dot"
                                else 0.0)
    widths = [model_cfg.num_dense_features, *model_cfg.bottom_mlp]
    bottom_gemm = 6.0 * b * sum(i * o + o for i, o in itertools.pairwise(widths)) / flops_per_s
    state = OPTIMIZER_DENSE_STATE_BYTES[workload.optimizer]
    dense_opt_bytes = n * (4 + 4 + 4 + 2 * state)  # read weight and gradient, write weight; state both ways
    ranks = []
    for r in range(w):
        emb = crit = over = 0.0
        for opt in ideal.tables.values():
            for s in opt.shards:
                if s.rank != r:
                    continue
                emb += s.perf.compute_s
                if opt.sharding == ShardingType.DATA_PARALLEL:
                    over += s.perf.comms_s  # the replica's gradient, in DDP's buckets
                else:  # pooled out forward and its gradient back are waited for; the ids are prefetched
                    crit += 2 * s.perf.bwd_comms_s
                    over += s.perf.fwd_comms_s - s.perf.bwd_comms_s
        gemm = gemm_flops / flops_per_s
        dense_opt = dense_opt_bytes / ideal_spec.memory_bw_bytes_per_s
        over += all_reduce_time_s(4 * n, topo, latency=False)
        exposed = max(0.0, crit - bottom_gemm)  # the bottom MLP runs while the pooled all-to-alls travel
        step = max(gemm + emb + dense_opt + exposed, over)
        ranks.append({"gemm_ms": gemm * 1e3, "embedding_ms": emb * 1e3, "dense_optimizer_ms": dense_opt * 1e3,
                      "critical_comms_ms": exposed * 1e3, "overlappable_comms_ms": over * 1e3,
                      "floor_ms": step * 1e3})
    slowest = max(ranks, key=lambda x: x["floor_ms"])
    return {"floor_ms": slowest["floor_ms"], "floor_per_rank": ranks,
            "floor_samples_per_s": w * b / (slowest["floor_ms"] / 1e3), "gemm_flops_per_rank": gemm_flops,
            "dense_params": n}


# ---- measured steps --------------------------------------------------------------------------------


def _train(overrides: list[str], nproc: int, out: Path, timeout_s: float) -> tuple[dict, float, str]:
    """One `anyrec.train` job under torchrun: its summary (the last JSON line), its wall seconds and its
    console output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "anyrec.train", *overrides, "trainer.progress=false", "trainer.tensorboard=false",
           f"hydra.run.dir={out}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=vsr._env(True), capture_output=True, text=True, timeout=timeout_s,
                          cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        raise vsr.BenchmarkError(f"anyrec.train {' '.join(overrides)} exited {proc.returncode}: {tail}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise vsr.BenchmarkError(f"anyrec.train {' '.join(overrides)}: no summary line")
    return json.loads(lines[-1]), wall, proc.stdout + proc.stderr


def breakdown(overrides: list[str], args: argparse.Namespace, work: Path) -> dict:
    """anyrec's step split into phases by torch.profiler over the last `--breakdown-steps` steps."""
    summary, _, _ = _train([*overrides, f"data.batch_size={args.batch_size}", f"trainer.steps={args.steps}",
                         f"trainer.breakdown_steps={args.breakdown_steps}", "trainer.eval_steps=0"],
                        args.nproc, work / f"breakdown_{time.monotonic_ns()}", args.timeout_s)
    bd = summary["step_breakdown_ms"]
    keys = bd["per_rank"][0].keys()
    slowest = max(bd["per_rank"], key=lambda r: r["step"])
    return {"steps": bd["steps"], "slowest_rank": {k: slowest[k] for k in keys}, "per_rank": bd["per_rank"],
            "predicted": bd["predicted"], "measured_step_ms_unprofiled": summary["measured_step_ms"]}


def measured_pairs(shape: str, args: argparse.Namespace, script: Path | None, work: Path) -> dict:
    """anyrec and the reference alternating (vs_reference's runs), `--pairs` times."""
    contenders = ["anyrec"] + (["reference"] if script is not None else [])
    runs = []
    for i in range(args.pairs):
        order = contenders if i % 2 == 0 else contenders[::-1]
        for c in order:
            r = vsr.run_once(c, shape, args, script, work)
            print(f"{shape} pair {i + 1}/{args.pairs} {c:<10} step {r['step_ms']:.2f} ms "
                  f"(load {r['loadavg_before'][0]:.1f})", flush=True)
            runs.append(r)
    med = {c: statistics.median(r["step_ms"] for r in runs if r["contender"] == c) for c in contenders}
    return {"runs": runs, "median_step_ms": med}


def default_job(args: argparse.Namespace, work: Path) -> dict:
    """The default job as users run it, `--pairs` times: its summary's measured step (its own clock)."""
    steps = []
    for i in range(args.pairs):
        summary, _, _ = _train([], args.nproc, work / f"default_{i}", args.timeout_s)
        steps.append(summary["measured_step_ms"])
        print(f"default job run {i + 1}/{args.pairs}: step {steps[-1]:.2f} ms", flush=True)
    return {"runs": steps, "median_step_ms": {"anyrec": statistics.median(steps)}}


def compile_choice(overrides: list[str], args: argparse.Namespace, work: Path) -> dict:
    """trainer.compile=auto beside =true and =false: whole-job wall seconds (compile included), the
    trainer's measured step, and what auto chose. The compile record is measured first (auto), cached in
    a fresh cache folder for this benchmark, so the timed auto run decides from it as a later job would."""
    env_cache = work / f"cache_{len(list(work.glob('cache_*')))}"  # each job shape from an empty cache
    os.environ["ANYREC_CACHE_DIR"] = str(env_cache)
    try:
        common = [*overrides, f"data.batch_size={args.batch_size}", f"trainer.steps={args.compile_steps}",
                  "trainer.eval_steps=0", "trainer.calibrate=never"]
        _, first_wall, _ = _train([*common, "trainer.compile=auto"], args.nproc, work / "cmp_first",
                                  args.timeout_s)
        out = {"steps": args.compile_steps, "first_auto_wall_s": first_wall}
        for setting in ("auto", "true", "false"):
            summary, wall, log = _train([*common, f"trainer.compile={setting}"], args.nproc,
                                        work / f"cmp_{setting}", args.timeout_s)
            decision = next((ln.split(DECISION, 1)[1] for ln in log.splitlines() if DECISION in ln), None)
            out[setting] = {"wall_s": wall, "elapsed_s": summary["elapsed_s"],
                            "measured_step_ms": summary["measured_step_ms"],
                            "final_loss": summary["final_loss"], "decision": decision}
            print(f"  compile={setting:<5} wall {wall:.1f} s, step {summary['measured_step_ms']:.2f} ms",
                  flush=True)
        records = list((env_cache / "compile").glob("*.json"))
        out["record"] = json.loads(records[0].read_text()) if records else None
        decision = out["auto"]["decision"] or ""
        out["auto_chose"] = "true" if decision.startswith("compiled") else "false"
        other = "false" if out["auto_chose"] == "true" else "true"
        out["auto_vs_other_wall"] = out[other]["wall_s"] / out["auto"]["wall_s"]
        return out
    finally:
        os.environ.pop("ANYREC_CACHE_DIR", None)


# ---- report ----------------------------------------------------------------------------------------


def table(results: dict) -> str:
    lines = [f"{'shape':<13} {'floor ms':>9} {'plan ms':>8} {'anyrec ms':>10} {'x floor':>8} {'ref ms':>8} "
             f"{'x floor':>8}   floor terms (slowest rank, ms)",
             "  (x floor: measured step / floor; its inverse, floor / measured, is the fraction of the "
             "floor's speed reached)"]
    for shape, res in results["shapes"].items():
        fl = res["floor"]
        med = res.get("measured", {}).get("median_step_ms", {})
        a, r = med.get("anyrec"), med.get("reference")
        slow = max(fl["floor_per_rank"], key=lambda x: x["floor_ms"])
        terms = " ".join(f"{k.removesuffix('_ms')}={v:.3f}" for k, v in slow.items() if k != "floor_ms")
        lines.append(f"{shape:<13} {fl['floor_ms']:>9.3f} {fl['predicted_step_ms']:>8.2f} {_ms(a):>10} "
                     f"{_times(a, fl['floor_ms'])} {_ms(r)} {_times(r, fl['floor_ms'])}   {terms}")
    lines.append("")
    lines.append("anyrec's step breakdown (torch.profiler, slowest rank, ms/step; collectives also count "
                 "inside the phase they ran in):")
    for shape, res in results["shapes"].items():
        bd = res.get("breakdown")
        if bd is None:
            lines.append(f"  {shape:<13} not run")
            continue
        s = bd["slowest_rank"]
        lines.append(f"  {shape:<13} " + " ".join(f"{k}={v:.2f}" for k, v in s.items() if v or k == "other"))
    comp = {s: r["compile"] for s, r in results["shapes"].items() if "compile" in r}
    if comp:
        lines.append("")
        lines.append(f"trainer.compile=auto's choice (whole job wall s, compile included; "
                     f"{next(iter(comp.values()))['steps']} steps):")
        for shape, c in comp.items():
            rec = c["record"]
            rec_s = (f"record: compile {rec['compile_s']:.1f} s, dense step eager "
                     f"{rec['eager_step_s'] * 1e3:.2f} ms / compiled {rec['compiled_step_s'] * 1e3:.2f} ms"
                     if rec else "no record (the saving's ceiling was under any compile)")
            lines.append(f"  {shape:<13} auto->{c['auto_chose']:<5} auto {c['auto']['wall_s']:.1f} s, "
                         f"true {c['true']['wall_s']:.1f} s, false {c['false']['wall_s']:.1f} s; "
                         f"other/auto {c['auto_vs_other_wall']:.2f}; {rec_s}")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return f"{v:>8.2f}" if v is not None else f"{'not run':>8}"


def _times(v: float | None, floor_ms: float) -> str:
    return f"{v / floor_ms:>7.1f}x" if v is not None else f"{'-':>8}"


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", action="append", default=[],
                    help="calibrated hardware file (anyrec.calibrate), repeatable: the plan is made with the "
                         "first, the floor with the best figure any measured; default: this machine's cached "
                         "calibration")
    ap.add_argument("--reference", type=Path, default=os.environ.get("DLRM_REFERENCE"),
                    help="checkout of the MLPerf DLRM reference (see benchmarks/vs_reference.py); default "
                         "$DLRM_REFERENCE; without it the reference is not run")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--floor-only", action="store_true", help="the floors only; run nothing")
    ap.add_argument("--pairs", type=int, default=2, help="alternating anyrec/reference runs per shape")
    ap.add_argument("--steps", type=int, default=120, help="training steps per measured run")
    ap.add_argument("--warmup", type=int, default=30, help="first steps of each measured run left out")
    ap.add_argument("--breakdown-steps", type=int, default=20, help="profiled steps of the breakdown run")
    ap.add_argument("--batch-size", type=int, default=256, help="per rank")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (one host)")
    ap.add_argument("--compile", action="store_true", help="also measure trainer.compile=auto's choice")
    ap.add_argument("--compile-steps", type=int, default=300, help="steps of each compile-choice job")
    ap.add_argument("--compile-only", action="store_true", help="the floors and the compile choice only")
    ap.add_argument("--timeout-s", type=int, default=900, help="per run")
    ap.add_argument("--json", type=Path, help="write everything here (and the table beside it, .txt)")
    ap.add_argument("--table", type=Path, help="print the table of an earlier --json file; run nothing")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    try:
        shapes = [s for s in args.shapes.split(",") if s]
        unknown = [s for s in shapes if s not in SHAPES]
        if unknown:
            raise vsr.BenchmarkError(f"unknown shape(s) {', '.join(unknown)}; choose from "
                                     f"{', '.join(SHAPES)}")
        if args.pairs < 1 or args.steps < args.warmup + 3 or args.nproc < 1 or args.breakdown_steps < 1:
            raise vsr.BenchmarkError("need --pairs >= 1, --steps >= --warmup + 3, --nproc >= 1, "
                                     "--breakdown-steps >= 1")
        script = vsr.reference_script(args.reference) if args.reference and not args.floor_only else None
        results = run(args, shapes, script)
    except vsr.BenchmarkError as e:
        print(f"step_floor.py: error: {e}", file=sys.stderr)
        return 2
    report = table(results)
    print(report)
    if args.json:  # the JSON and, beside it, the table
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
        args.json.with_suffix(".txt").write_text(report + "\n")
        print(f"wrote {args.json} and {args.json.with_suffix('.txt').name}")
    return 0


def run(args: argparse.Namespace, shapes: list[str], script: Path | None) -> dict:
    results = {"host": {"cpus": len(os.sched_getaffinity(0)), "loadavg_start": loadavg(),
                        "shared": "a host shared with other users' jobs: the load average is recorded around "
                                  "every run"},
               "reference": None if script is None else {
                   "script": str(script), "commit": vsr.REFERENCE_COMMIT,
                   "blob_matches_commit": vsr.git_blob_id(script) == vsr.REFERENCE_BLOB},
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "shapes": {}}
    # Every anyrec job plans with the backend's datasheet figures, none calibrates on first contact (100 s a
    # job); the floor is costed on the plan made with the calibrated figures (the same plan on this host).
    os.environ["ANYREC_CALIBRATE"] = "never"
    with tempfile.TemporaryDirectory(prefix="step_floor_") as tmp:
        work = Path(tmp)
        for shape in shapes:
            overrides = SHAPES[shape]
            res: dict = {"overrides": overrides,
                         "floor": floor_of_job(overrides, args.hardware, args.nproc, args.batch_size)}
            fl = res["floor"]
            print(f"{shape}: floor {fl['floor_ms']:.3f} ms, plan {fl['predicted_step_ms']:.2f} ms",
                  flush=True)
            if args.compile_only:
                res["compile"] = compile_choice(overrides, args, work)
            elif not args.floor_only:
                res["loadavg_before"] = loadavg()
                if shape == "default":
                    res["measured"] = default_job(args, work)
                else:
                    ref = script if shape in vsr.SHAPES else None
                    res["measured"] = measured_pairs(shape, args, ref, work)
                res["breakdown"] = breakdown(overrides, args, work)
                if args.compile:
                    res["compile"] = compile_choice(overrides, args, work)
                res["loadavg_after"] = loadavg()
            results["shapes"][shape] = res
    results["host"]["loadavg_end"] = loadavg()
    return results


if __name__ == "__main__":
    sys.exit(main())
