"""Scoring speed on a CPU: anyrec's exported artifact (fp32 and row-wise int8 tables) against torchrec's own
inference path (`torchrec.inference.modules.quantize_embeddings`: its quantized EmbeddingBagCollection on
FBGEMM's inference TBE), on the same model weights and the same batches.

    python benchmarks/predict.py [--models dlrm_small dlrmv2_small] [--batch 256 2048] [--threads 1 default]
                                 [--json benchmarks/results/<date>_cpu-2core/predict.json]

Contenders, per model and precision:
  torchrec        the DLRM with its tables replaced by torchrec's quantized collection (fp32 or int8
                  weights), eager, fed KeyedJaggedTensors
  anyrec          the artifact anyrec-export writes, called as anyrec-predict calls it (its graph directly,
                  `ScoringProgram`), fed one ids and one offsets tensor per feature; int8 with each lookup
                  kernel (export.int8_kernel): fbgemm (torch's quantized CPU op, the CPU's default) and torch
                  (plain ops, for devices without that op)
  anyrec_guarded  the same program as `torch.export.load(...).module()` makes it (torch.export's checks of
                  every call's inputs), the torch-only way docs/export.md shows
All score the same `--batches` batches (multi-hot where the model is), made before timing, without
autograd, at each `--threads` count in turn (both sides alike); each contender runs them `--repeats` times
in alternating order and the table shows the median samples/s and anyrec's ratios to torchrec (> 1: faster).
Scores are compared before timing (the two anyrec calls: equal; against torchrec, fp32: 1e-5; int8: both
quantize row-wise to 8 bits, FBGEMM with fp16 scale and bias, anyrec with fp32 ones: 1e-2).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torchrec.inference.modules import quantize_embeddings

from anyrec._hydra import compose_job
from anyrec.config import IdLayout, Int8Kernel, ModelConfig, TablePrecision
from anyrec.models.dlrm import build_model, table_configs
from anyrec.models.dlrm_scoring import batch_inputs
from anyrec.models.family import DLRM_FAMILY, resolve_family
from anyrec.models.init import init_model
from anyrec.runtime.distributed import ONE_PROCESS
from anyrec.schema import load_model_config
from anyrec.serving.artifact import Artifact, export_program, load_artifact, manifest, save_artifact
from anyrec.serving.model import ScoringModel, resolve_int8_kernel
from anyrec.trainer.inputs import build_inputs

TORCHREC_DTYPES = {TablePrecision.fp32: torch.float, TablePrecision.int8: torch.qint8}
# anyrec's variants: fp32, and int8 with each of its lookups (export.int8_kernel)
VARIANTS = [(TablePrecision.fp32, "torch"), (TablePrecision.int8, "fbgemm"), (TablePrecision.int8, "torch")]
SCORE_ATOL = {TablePrecision.fp32: 1e-5, TablePrecision.int8: 1e-2}


def batches_for(model: str, batch: int, count: int) -> list:
    """`count` synthetic eval batches of `model` (what `anyrec-predict` reads), made once."""
    cfg = compose_job([f"model={model}", f"data.batch_size={batch}", "data.prefetch=0"])
    source = build_inputs(cfg, resolve_family(cfg.model), ONE_PROCESS, torch.device("cpu"), None).eval
    return list(source.iter_from(0, count))


def trained_like(cfg: ModelConfig) -> torch.nn.Module:
    """The model at its initial weights, tables spread as trained ones are (the init's rows are narrow)."""
    model = build_model(cfg, torch.device("cpu"))
    init_model(model, table_configs(cfg), 0, "sparse_arch")
    with torch.no_grad():
        for p in model.sparse_arch.parameters():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    return model.eval()


def exported(model: torch.nn.Module, cfg: ModelConfig, precision: TablePrecision, folder: str,
             kernel: str = "auto") -> Artifact:
    """The artifact anyrec-export would write for `model`, written and loaded back."""
    path = Path(folder) / f"{cfg.name}_{precision}.pt2"
    kernel = resolve_int8_kernel(Int8Kernel(kernel))
    program = export_program(ScoringModel(model, precision, IdLayout.offsets, kernel), DLRM_FAMILY, cfg,
                             IdLayout.offsets)
    save_artifact(program, manifest(cfg, DLRM_FAMILY, precision, IdLayout.offsets, {}, kernel), path)
    return load_artifact(path)


def time_runs(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function over `repeats` rounds, the order alternating each round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            t = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_model(name: str, batch: int, count: int, repeats: int, folder: str,
                threads: list[int]) -> list[dict]:
    """Rows of `name` at `batch`: each variant at each thread count, the contenders timed alike."""
    cfg = load_model_config(name)
    model, data = trained_like(cfg), batches_for(name, batch, count)
    plain = [batch_inputs(b, IdLayout.offsets, torch.device("cpu")).args() for b in data]
    rows = []
    for precision, kernel in VARIANTS:
        theirs = quantize_embeddings(copy.deepcopy(model), dtype=TORCHREC_DTYPES[precision], inplace=False)
        artifact = exported(model, cfg, precision, folder, kernel)
        contenders = {"torchrec": (theirs, [(b.dense_features, b.sparse_features) for b in data]),
                      "anyrec": (artifact.scorer, plain), "anyrec_guarded": (artifact.program, plain)}
        with torch.no_grad():
            scores = {k: [fn(*a) for a in args] for k, (fn, args) in contenders.items()}
        diff = max(float((ours - want).abs().max())
                   for ours, want in zip(scores["anyrec"], scores["torchrec"], strict=True))
        if diff > SCORE_ATOL[precision]:
            raise AssertionError(f"{name} {precision}: scores differ by {diff}")
        if not all(map(torch.equal, scores["anyrec"], scores["anyrec_guarded"])):
            raise AssertionError(f"{name} {precision}: the graph called directly scores otherwise")

        def run(fn: Callable[..., torch.Tensor], args: list[tuple]) -> Callable[[], None]:
            def scores_all() -> None:
                with torch.no_grad():
                    for a in args:
                        fn(*a)
            return scores_all

        runs = {k: run(fn, args) for k, (fn, args) in contenders.items()}
        for n in threads:
            torch.set_num_threads(n)
            for fn in runs.values():  # warm-up
                fn()
            secs = time_runs(runs, repeats)
            samples = batch * count
            rows.append({"model": name, "precision": str(precision),
                         "int8_kernel": kernel if precision == "int8" else None,
                         "batch": batch, "batches": count, "threads": n,
                         **{f"{k}_samples_per_s": samples / s for k, s in secs.items()},
                         "speedup": secs["torchrec"] / secs["anyrec"],
                         "guarded_speedup": secs["torchrec"] / secs["anyrec_guarded"],
                         "max_logit_diff": diff})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dlrm_small", "dlrmv2_small"])
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", nargs="+", default=["1"],
                        help="torch's intra-op thread counts to time each at, 'default' for torch's own "
                             f"({torch.get_num_threads()} here); both sides run at the same count")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    threads = [torch.get_num_threads() if t == "default" else int(t) for t in args.threads]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    with tempfile.TemporaryDirectory() as folder:
        rows = [r for m in args.models for b in args.batch
                for r in bench_model(m, b, args.batches, args.repeats, folder, threads)]
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    print(f"{'model':<14}{'batch':>6}{'threads':>8}  {'tables':<14}{'torchrec samples/s':>19}"
          f"{'anyrec samples/s':>17}{'anyrec/torchrec':>16}{'guarded/torchrec':>17}")
    for r in rows:
        tables = r["precision"] + (f" ({r['int8_kernel']})" if r["int8_kernel"] else "")
        print(f"{r['model']:<14}{r['batch']:>6}{r['threads']:>8}  {tables:<14}"
              f"{r['torchrec_samples_per_s']:>19,.0f}{r['anyrec_samples_per_s']:>17,.0f}"
              f"{r['speedup']:>15.2f}x{r['guarded_speedup']:>16.2f}x")
    print(f"{args.batches} batches x {args.repeats} repeats; load average before {' '.join(load_before)}, "
          f"after {' '.join(load_after)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "threads": threads, "cpus": os.cpu_count(),
                                         "torch": torch.__version__, "loadavg_before": load_before,
                                         "loadavg_after": load_after}, indent=1) + "\n")


if __name__ == "__main__":
    main()
