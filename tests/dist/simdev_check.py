"""Run with the simdev plugin importable, as one process (1 rank) or under torchrun (2 ranks): dlrm_tiny
jobs on backend=cpu and on backend=simdev, one after the other in this process (one interpreter start
for all of them), each trained by `Trainer.train()` with evaluation and a checkpoint. At 2 ranks the
plan mixes every sharding type with data-parallel tables (column-wise ones only where the optimizer's
update stays exact). A job naming another model (`model=dlrmv4_small`) is planned by the trainer. Rank 0
writes OUT as JSON: {JOB: {"losses", "weights_sha256" (anyrec-parity's record), "summary", "shardings",
"autocast"}, or {"error": the ValueError's message}}.

Usage: simdev_check.py OUT JOB... (JOB: "<backend> <embedding kernel> <optim> [override...]")
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from anyrec.backends import get_backend
from anyrec.backends.dispatch import get_impl
from anyrec.models.dlrm import build_model
from anyrec.parity import full_weights, weights_sha256
from anyrec.planner.estimators import inexact_update_reason
from anyrec.planner.planned import ParallelLayout, PlannedJob
from anyrec.planner.simple import to_sharding_plan
from anyrec.runtime.distributed import all_reduce_mean
from anyrec.trainer.planning import place_shards, sharders
from anyrec.trainer.trainer import EBC_PATH, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import compose_config  # noqa: E402

KINDS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
BASE = ["model=dlrm_tiny", "trainer.steps=3", "trainer.eval_steps=1", "trainer.progress=false",
        "trainer.tensorboard=false", "data.global_batch_size=64"]


def mixed_plan(cfg, backend, kernel: str, world: int):
    """Table i of dlrm_tiny takes the i-th sharding type in turn (table-wise on rank i mod world)."""
    kinds = [k for k in KINDS if inexact_update_reason(cfg.optim.name, k) is None]
    meta = torch.device("meta")
    ebc = build_model(cfg.model, meta, ebc_device=meta).sparse_arch
    shardings = {}
    for i, t in enumerate(ebc.embedding_bag_configs()):
        kind = kinds[i % len(kinds)]
        shardings[t.name] = (kind, [i % world] if kind == "table_wise" else list(range(world)))
    impl = get_impl("embedding", kernel)
    plan = to_sharding_plan(ebc, shardings, EBC_PATH, world, world, backend.device_type,
                            impl.compute_kernel(), sharders(impl)[0])
    return PlannedJob(place_shards(plan, backend, world), ParallelLayout.one_d(world, world))


def job(run_dir: Path, backend: str, kernel: str, optim: str, *overrides: str) -> dict:
    own_model = any(o.startswith("model=") for o in overrides)
    base = [o for o in BASE if not (own_model and o.startswith("model="))]
    _, cfg = compose_config([*base, f"backend={backend}", f"backend.embedding_kernel={kernel}",
                             f"optim={optim}", f"trainer.run_dir={run_dir}",
                             f"trainer.checkpoint.dir={run_dir / 'ckpt'}", *overrides])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = mixed_plan(cfg, get_backend(backend), kernel, world) if world > 1 and not own_model else None
    try:
        trainer = Trainer(cfg, plan)
    except ValueError as e:
        return {"error": str(e)}
    losses: list[torch.Tensor] = []
    trainer.step_hooks.append(lambda t: losses.append(t.last_loss))
    try:
        summary = trainer.train()
        mean = all_reduce_mean([float(x) for x in losses], trainer.device)
        weights = full_weights(trainer.model, trainer.dist)
        plan = trainer.planned.plan if trainer.planned is not None else None
        path = trainer.family.sparse_path
        shardings = {n: ps.sharding_type for n, ps in plan.plan[path].items()} if plan else {}
    finally:
        trainer.close()
    return {"losses": mean, "weights_sha256": weights_sha256(weights), "summary": summary,
            "shardings": shardings, "autocast": trainer.autocast}


def main(out: Path, jobs: list[str]) -> None:
    results = {spec: job(out.parent / f"job{i}", *spec.split()) for i, spec in enumerate(jobs)}
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
