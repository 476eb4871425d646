#!/usr/bin/env python
"""Regenerate tests/golden/: the per-step training loss of model=dlrm_tiny, 20 steps, one file per optimizer.

    python scripts/update_golden_losses.py            # rewrite every file
    python scripts/update_golden_losses.py adam sgd   # only these optimizers

The files are the project's loss baseline (tests/test_golden.py compares every run with them).
Rewriting them is an explicit act: do it only for a change meant to move the numerics (a new
initialisation, data keying, an optimizer fix), say in the commit message why the losses moved,
and commit the files with that change. Runs on the CPU with anyrec's torch embedding kernel (no
FBGEMM, no sharding), in this process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from anyrec.parity import train_losses  # noqa: E402
from anyrec.trainer.optim import OPTIMIZERS  # noqa: E402
from tests.golden import GOLDEN_DIR, golden_overrides  # noqa: E402


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown:
        sys.exit(f"update_golden_losses: error: unknown optimizer(s) {unknown}; "
                 f"choose from {list(OPTIMIZERS)}")
    for name in names or OPTIMIZERS:
        overrides = golden_overrides(name)
        losses = train_losses(overrides)
        path = GOLDEN_DIR / f"dlrm_tiny_{name}.json"
        path.write_text(json.dumps({"overrides": overrides, "losses": losses}, indent=1) + "\n")
        print(f"{path.relative_to(ROOT)}: {len(losses)} steps, final loss {losses[-1]:.7f}")


if __name__ == "__main__":
    main(sys.argv[1:])
