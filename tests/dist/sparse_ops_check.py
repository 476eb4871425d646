"""Run under torchrun: the trainer's sharded path with FBGEMM's sparse ops and with the portable ones.

For each sharding type (argv[2], comma-separated) the same job trains twice in this process, with
`backend.sparse_ops=fbgemm` and `=portable` (which overrides FBGEMM's CPU kernels). Each run records
its per-step losses on this rank, a SHA-256 of all weights before and after, and -- under the
profiler -- every fbgemm:: op the steps dispatched next to the calls the portable kernels served.
Writes OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import gc
import json
import sys
from collections import Counter
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from anyrec.backends import sparse_ops
from anyrec.runtime.distributed import destroy_distributed
from anyrec.trainer.fingerprint import weights_fingerprint
from anyrec.trainer.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import compose_config  # noqa: E402
from portable_calls import counted_ops  # noqa: E402

CALLS: Counter[str] = Counter()  # calls served by the portable kernels, by op name
sparse_ops.SPARSE_OPS.update(counted_ops(CALLS))  # before any trainer registers them

STEPS = 3
MULTI_HOT = "[3,1,2,1,1,4,1,1,1,2,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,5]"  # dlrm_tiny has 26 features


def run(sharding: str, mode: str, out_dir: Path) -> dict:
    kernel = "fbgemm" if sharding == "data_parallel" else "torch"  # DP tables run FBGEMM's dense TBE
    _, cfg = compose_config([
        "model=dlrm_tiny", f"model.multi_hot={MULTI_HOT}", "planner=simple", f"planner.sharding={sharding}",
        "backend.name=cpu", f"backend.embedding_kernel={kernel}", f"backend.sparse_ops={mode}",
        f"trainer.steps={STEPS}", "trainer.eval_steps=0", "trainer.progress=false", "trainer.tensorboard=false",
        "trainer.log_every=1", "data.batch_size=16", f"trainer.run_dir={out_dir / f'{sharding}_{mode}'}",
    ])
    trainer = Trainer(cfg)
    losses: list[float] = []
    trainer.step_hooks.append(lambda t: losses.append(float(t.last_loss)))
    initial = weights_fingerprint(trainer.model, trainer.dist)
    before = Counter(CALLS)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        summary = trainer.train()
    served = Counter(CALLS)
    served.subtract(before)
    recorded = Counter(ev.name for ev in prof.events() if ev.name.startswith("fbgemm::"))
    result = {
        "losses": losses, "final_loss": summary["final_loss"], "initial_weights": initial,
        "weights": weights_fingerprint(trainer.model, trainer.dist), "recorded": dict(recorded),
        "served": {k: v for k, v in served.items() if v},
        "installed": list(sparse_ops.installed("CPU")),
    }
    trainer.close(keep_group=True)  # its heartbeat stops; the group stays for the next run
    del trainer, prof
    gc.collect()
    return result


def main(out_dir: Path, shardings: list[str]) -> None:
    import torch.distributed as dist

    results: dict[str, dict] = {}
    for sharding in shardings:
        results[sharding] = {mode: run(sharding, mode, out_dir) for mode in ("fbgemm", "portable")}
    rank = dist.get_rank()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
