#!/usr/bin/env python
"""Regenerate tests/golden/: the per-step training loss of every golden job (20 steps, fixed seed).

    python scripts/update_golden_losses.py                          # rewrite every file
    python scripts/update_golden_losses.py dlrm_tiny_adam dlrm_tiny_sgd   # only these jobs

The files are the project's loss baseline (tests/test_golden.py compares every run with them).
Rewriting them is an explicit act: do it only for a change meant to move the numerics (a new
initialisation, data keying, an optimizer fix), say in the commit message why the losses moved,
and commit the files with that change. Every job runs on the CPU through anyrec-train's loop
(`Trainer.train()`): one-rank jobs in this process, the two-rank job under torchrun.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.golden import JOBS, job_losses  # noqa: E402


def main(names: list[str]) -> None:
    if any(n in ("-h", "--help") for n in names):
        print(__doc__.strip())
        print(f"\njobs: {', '.join(JOBS)}")
        return
    unknown = sorted(set(names) - set(JOBS))
    if unknown:
        sys.exit(f"update_golden_losses: error: unknown job(s) {unknown}; choose from {list(JOBS)}")
    for name in names or JOBS:
        job = JOBS[name]
        losses = job_losses(job)
        record = {"overrides": job.overrides, **({"nproc": job.nproc} if job.nproc > 1 else {}),
                  "losses": losses}
        job.path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{job.path.relative_to(ROOT)}: {len(losses)} steps, final loss {losses[-1]:.7f}")


if __name__ == "__main__":
    main(sys.argv[1:])
