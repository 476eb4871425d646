"""Run under torchrun: a signal on one rank stops every rank at the same checked step.

argv: OUT_DIR SIGNAL_RANK. Each rank runs steps of one all-reduce; SIGNAL_RANK sends itself SIGINT
after step 7; with checks every 3 steps every rank must stop after step 9. Writes rank<r>.json.
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

dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # a hang fails, never strays
rank, world = dist.get_rank(), dist.get_world_size()
stop = StopRequest(rank, world, check_every=3, grace_s=20, timeout_s=20)
stop.install()
step = 0
while step < 1000:
    t = torch.ones(1)
    dist.all_reduce(t)
    step += 1
    if step == 7 and rank == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGINT)
        while stop.signum is None:  # the watcher thread notes it
            pass
    if stop.should_stop(step):
        break
stop.restore()
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps({"step": step, "stopped_by": stop.stopped_by}))
dist.barrier()
dist.destroy_process_group()
