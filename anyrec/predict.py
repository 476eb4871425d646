"""`anyrec-predict` / `python -m anyrec.predict`: score a data split with an exported artifact.

    anyrec-predict predict.artifact=model.pt2 predict.split=eval predict.steps=20 predict.output=scores.npy
    anyrec-predict predict.artifact=v4.pt2 predict.world_size=2

The data overrides are the training run's (`data=criteo_npy data.path=...`, `trainer.seed`, ...): the
rows are those its sources give, so split=eval with steps=trainer.eval_steps (and predict.world_size=the
run's world size) are the rows the trainer evaluated on. A stream of windows (DLRMv4's): split=eval is
the window the trainer evaluated after the artifact's checkpoint step (the final checkpoint: the run's last
evaluation, its `eval_auc`), split=train the first predict.steps training batches. The model is the
artifact's own. Prints AUC, NE, log loss and accuracy; the last stdout line is a JSON summary."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from anyrec import _hydra
from anyrec.config import AnyrecConfig, check_values
from anyrec.io_checks import atomic_write, writable_file

logger = logging.getLogger("anyrec.predict")


def run(cfg: AnyrecConfig, print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Score `predict.steps` batches per rank of `predict.world_size` ranks' `predict.split`; write the
    scores (`predict.output`) and return (and print, last) the summary. ValueError in one line for a bad
    artifact, an option out of range or data that does not fit the artifact's model."""
    import numpy as np
    import torch
    from tqdm import tqdm

    from anyrec.backends import get_backend  # late: after the command line
    from anyrec.models.family import resolve_family  # late: after the command line
    from anyrec.runtime.distributed import DistInfo  # late: after the command line
    from anyrec.serving.artifact import load_artifact, read_manifest  # late: after the command line
    from anyrec.serving.scoring import score_batches  # late: after the command line
    from anyrec.serving.weights import check_fits, host_memory_bytes  # late: after the command line
    from anyrec.trainer.inputs import build_inputs  # late: after the command line

    check_values(cfg)
    pc = cfg.predict
    if not pc.artifact:
        raise ValueError("predict.artifact: a value is required; set it on the command line, e.g. "
                         "predict.artifact=model.pt2")
    steps = cfg.trainer.eval_steps if pc.steps is None else pc.steps
    if pc.world_size < 1 or (pc.steps is not None and pc.steps < 1):
        raise ValueError(f"predict.steps and predict.world_size must be >= 1, got {pc.steps} and "
                         f"{pc.world_size}")
    writable_file(pc.output, "predict.output")
    check_fits(int(read_manifest(pc.artifact)["table_bytes"]), f"scoring with {pc.artifact}",
               host_memory_bytes())
    artifact = load_artifact(pc.artifact)
    model = artifact.model
    if cfg.model.name != model.name:
        logger.info("model: %s, the artifact's (the composed model=%s is not used)", model.name,
                    cfg.model.name)
    backend = get_backend(cfg.backend.name)
    device = backend.device(0)
    if artifact.manifest.get("int8_kernel") == "fbgemm" and device.type != "cpu":
        raise ValueError(f"{pc.artifact}: its int8 tables use torch's quantized CPU lookup, which has no "
                         f"{device.type} kernel; export with export.int8_kernel=torch to score on "
                         f"{backend.name}")
    # the graph called directly: score_batches checks every batch, torch.export's per-call checks of the
    # same would cost a fifth of a small batch's time (anyrec.serving.program)
    program = artifact.scorer.to(device)
    # the sources the training run built, for the artifact's model: the rows its ranks read
    job = dataclasses.replace(cfg, model=model, trainer=dataclasses.replace(cfg.trainer, eval_steps=steps))
    family = resolve_family(model)
    ranks = [build_inputs(job, family, DistInfo(rank, pc.world_size, rank, pc.world_size), device, None)
             for rank in range(pc.world_size)]
    checkpoint_step = int(artifact.manifest["checkpoint"].get("step") or 0)
    if (pc.split == "eval" and ranks[0].eval_batches is None) or (pc.split == "train" and steps < 1):
        raise ValueError(f"predict.steps must be >= 1, got {steps} (the default: trainer.eval_steps)")
    bar = tqdm(desc=f"score {pc.split}", unit="sample", unit_scale=True, file=sys.stderr,
               disable=not cfg.trainer.progress)

    per_rank = [0] * pc.world_size  # batches each rank's source gave (a stream's window: its length)

    def batches():
        for rank, inputs in enumerate(ranks):
            # eval: what the trainer evaluated after the checkpoint's step (a stream: its window)
            for batch in (inputs.eval_batches(checkpoint_step) if pc.split == "eval"
                          else inputs.train.iter_from(0, steps)):
                per_rank[rank] += 1
                yield batch

    scored = score_batches(program, family, model, artifact.id_layout, batches(), device,
                           on_batch=bar.update)
    bar.close()
    probs = torch.cat(scored.probs).numpy().astype(np.float32) if scored.probs else np.zeros(0, np.float32)
    if pc.output:
        with atomic_write(pc.output, "wb") as f:
            np.save(f, probs)
    metrics = scored.metrics or {}
    summary = {**{k: metrics.get(k) for k in ("auc", "ne", "logloss", "accuracy")},
               "samples": scored.samples,
               "samples_per_s": scored.samples / scored.wall_s if scored.wall_s else None,
               "model_samples_per_s": scored.samples / scored.model_s if scored.model_s else None,
               "split": str(pc.split), "steps": max(per_rank), "world_size": pc.world_size,
               "precision": artifact.manifest["precision"], "backend": backend.name,
               "artifact": str(Path(pc.artifact).resolve()), "output": pc.output,
               "checkpoint_step": artifact.manifest["checkpoint"].get("step")}
    if metrics:
        logger.info("%s: auc %.5f accuracy %.5f ne %.5f logloss %.5f over %d samples, %.0f samples/s",
                    pc.split, metrics["auc"], metrics["accuracy"], metrics["ne"], metrics["logloss"],
                    scored.samples, summary["samples_per_s"] or 0.0)
    sys.stdout.flush()
    print_fn(json.dumps(summary))
    return summary


def main(cfg: DictConfig) -> None:
    """Score with a composed config; user mistakes and bad artifacts or data: one line, exit status 2."""
    _hydra.run_typed("anyrec-predict", run, cfg)


def cli() -> None:
    """Console entry: the job under Hydra's runner (`_hydra.launch`), one line and exit 2 for a mistake."""
    _hydra.launch("anyrec-predict", main)


if __name__ == "__main__":
    cli()
