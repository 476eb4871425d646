"""Fault injection for the multi-process tests, kept out of anyrec itself: `anyrec-train` with faults.

    torchrun --nproc_per_node=2 -m tests.faults model=dlrm_tiny ...      (the anyrec-train arguments)

Faults come from the environment (a worker inherits it from torchrun):
  ANYREC_FAULT_KILL_AT_STEP=N   SIGKILL rank ANYREC_FAULT_KILL_RANK (default 1) after training step N,
                                on the first attempt only (TORCHELASTIC_RESTART_COUNT 0)
  ANYREC_FAULT_NAN_AT_STEP=N    rank 0's synthetic training batch N has a NaN dense feature
"""

from __future__ import annotations

import math
import os
import signal
import sys

KILL_AT_STEP = "ANYREC_FAULT_KILL_AT_STEP"
KILL_RANK = "ANYREC_FAULT_KILL_RANK"
NAN_AT_STEP = "ANYREC_FAULT_NAN_AT_STEP"


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def install_kill(at_step: int, rank: int) -> None:
    """Every Trainer built from now on SIGKILLs its process after step `at_step` when it is rank
    `rank` on torchrun's first attempt."""
    from anyrec.trainer.trainer import Trainer

    def kill(trainer: Trainer) -> None:
        if (trainer.step == at_step and trainer.dist.rank == rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            print(f"fault injection: SIGKILL rank {rank} after step {at_step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    build = Trainer.build

    def build_with_fault(self: Trainer) -> None:
        build(self)
        self.step_hooks.append(kill)

    Trainer.build = build_with_fault


def install_nan(at_step: int) -> None:
    """Rank 0's synthetic training batch `at_step` gets a NaN as its first dense value."""
    from anyrec.data.synthetic import SyntheticCriteo

    batch = SyntheticCriteo.batch

    def batch_with_nan(self: SyntheticCriteo, step: int):
        b = batch(self, step)
        if step == at_step and self.split == "train" and self.rank == 0:
            b.dense_features[0, 0] = math.nan
        return b

    SyntheticCriteo.batch = batch_with_nan


def main() -> None:
    """Install the faults the environment asks for, then run anyrec-train's command line."""
    kill_at = _int_env(KILL_AT_STEP)
    if kill_at is not None:
        install_kill(kill_at, _int_env(KILL_RANK) or 1)
    nan_at = _int_env(NAN_AT_STEP)
    if nan_at is not None:
        install_nan(nan_at)
    from anyrec import train

    train.cli()


def faulty(args: list[str]) -> list[str]:
    """A torchrun argument list of `-m anyrec.train` turned into the same job under this module."""
    i = args.index("anyrec.train")
    assert args[i - 1] == "-m", args
    return [*args[:i], "tests.faults", *args[i + 1:]]


if __name__ == "__main__":
    main()
