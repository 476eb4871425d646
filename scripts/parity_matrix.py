#!/usr/bin/env python
"""The CPU parity matrix: anyrec-parity over kernels x plans x world sizes, once per optimizer.

    python scripts/parity_matrix.py [--optimizers sgd,adam] [--steps 20] [--nproc 1,2] [--no-triton]

Reference variant: anyrec's torch TBE on one rank (unsharded), or with --nproc 2 alone the first
two-rank variant. Then FBGEMM under the co-design plan and each forced sharding type, and anyrec's
torch TBE and Triton TBE (under TRITON_INTERPRET=1): unsharded on one rank, under the co-design plan
and each forced sharding type on two. Left out, because they do not exist on CPU or are refused by
design: FBGEMM's fused Adam (CPU FBGEMM has none; its replicated tables run anyway), data-parallel
tables on anyrec's TBE (torchrec's dense kernel only), column-wise shards under row-wise Adagrad
(one accumulator per column shard is another update rule). Prints one table per optimizer; exits 1
if any differs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

SHARDINGS = ("table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel")


def variants(optimizer: str, nprocs: list[int], triton: bool) -> list[str]:
    """The variant strings for one optimizer, the reference first (the first sharded one without 1 rank)."""
    out = ["backend.embedding_kernel=torch"] if 1 in nprocs else []
    for n in nprocs:
        ranks = f" nproc={n}" if n > 1 else ""
        forced = [f"planner.name=simple planner.sharding={s}" for s in SHARDINGS]
        fbgemm_plans = ["planner.name=codesign", *forced]
        anyrec_plans = ["planner.name=codesign", *(f for f in forced if "data_parallel" not in f)]
        for plan in fbgemm_plans:
            if optimizer == "adam" and "data_parallel" not in plan:
                continue
            if optimizer == "rowwise_adagrad" and "column_wise" in plan:
                continue
            out.append(f"backend.embedding_kernel=fbgemm {plan}{ranks}")
        if n > 1:  # on one rank anyrec's TBE runs unsharded: the plan does not apply
            for plan in anyrec_plans:
                if optimizer == "rowwise_adagrad" and "column_wise" in plan:
                    continue
                out.append(f"backend.embedding_kernel=torch {plan}{ranks}")
        if triton:
            for plan in anyrec_plans if n > 1 else [""]:
                if optimizer == "rowwise_adagrad" and "column_wise" in plan:
                    continue
                plan = f" {plan}" if plan else ""
                out.append(f"backend.embedding_kernel=triton{plan}{ranks} TRITON_INTERPRET=1")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizers", default="sgd,adagrad,rowwise_adagrad,adam")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nproc", default="1,2")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--no-triton", action="store_true")
    a = p.parse_args()
    worst = 0
    for opt in a.optimizers.split(","):
        base = ["model=dlrm_tiny", "backend=cpu", f"optim={opt}", f"trainer.steps={a.steps}",
                "trainer.eval_steps=0", "trainer.progress=false", f"data.global_batch_size={a.global_batch}"]
        vs = variants(opt, [int(n) for n in a.nproc.split(",")], not a.no_triton)
        print(f"\n### optim={opt}", flush=True)
        rc = subprocess.call([sys.executable, "-m", "anyrec.parity", *base,
                              "parity.variants=[" + ",".join(json.dumps(v) for v in vs) + "]"])
        worst = max(worst, rc)
    return worst


if __name__ == "__main__":
    sys.exit(main())
