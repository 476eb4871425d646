"""Run under torchrun: a signal on one rank stops every rank at the same checked step.

argv: OUT_DIR ROUND... with ROUND "SIGNAL:RANK" (e.g. SIGINT:1). Each round is one stop request: every
rank runs steps of one all-reduce; RANK sends itself SIGNAL after step 7; with checks every 3 steps every
rank must stop after step 9. Rounds run one after the other in this process; each rank writes
rank<r>.json, a list of {"step", "stopped_by"} per round.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from anyrec.runtime.shutdown import StopRequest


def stop_round(rank: int, world: int, signum: int, signal_rank: int) -> dict:
    """One stop request from install to restore; the step it stopped after and why."""
    stop = StopRequest(rank, world, check_every=3, grace_s=20, timeout_s=20)
    stop.install()
    step = 0
    while step < 1000:
        t = torch.ones(1)
        dist.all_reduce(t)
        step += 1
        if step == 7 and rank == signal_rank:
            os.kill(os.getpid(), signum)
            while stop.signum is None:  # the watcher thread notes it
                pass
        if stop.should_stop(step):
            break
    stop.restore()
    dist.barrier()
    return {"step": step, "stopped_by": stop.stopped_by}


def main(out: Path, rounds: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # a hang fails, never strays
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for spec in rounds:
        name, signal_rank = spec.split(":")
        results.append(stop_round(rank, world, signal.Signals[name], int(signal_rank)))
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
