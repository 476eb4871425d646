"""Process-group setup from torchrun's environment (or a one-process group without it)."""

from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from anyrec.backends import Backend


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env_dist_info() -> DistInfo:
    """Rank facts from torchrun's variables; a single process without them."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return DistInfo(
        rank=int(os.environ.get("RANK", "0")), world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
    )


def _elastic_store() -> dist.Store | None:
    """Under torchrun's agent store, a store prefixed by the restart attempt.

    After a worker restart (`--max-restarts`), the agent's store still holds the previous attempt's
    keys (e.g. the gloo address of a killed rank), and a new process group can read them and fail
    to connect; a per-attempt prefix keeps each attempt's keys apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=10))
    return dist.PrefixStore(f"anyrec/attempt_{attempt}", store)


def init_distributed(backend: Backend, timeout_s: float | None = None) -> DistInfo:
    """Join (or create) the default process group with the backend's collectives library.

    `timeout_s` bounds every collective (trainer.collective_timeout_s): a rank waiting longer on a
    stopped or stuck peer fails instead of hanging for torch's default (10 to 30 minutes).
    """
    info = env_dist_info()
    backend.set_device(info.local_rank)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # launched without torchrun: a group of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        device_id = backend.device(info.local_rank) if backend.device_type != "cpu" else None
        dist.init_process_group(backend=backend.dist_backend, rank=info.rank, store=_elastic_store(),
                                world_size=info.world_size, device_id=device_id,
                                timeout=timedelta(seconds=timeout_s) if timeout_s else None)
    return info


def destroy_distributed(barrier: bool = True) -> None:
    """Tear the group down; collect sharded modules first (avoids an abort at exit with row-wise shards).

    `barrier=False` when a peer may be gone (after an error): then nobody waits for it.
    """
    gc.collect()
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_mean(values: list[float], device: torch.device) -> list[float]:
    """Mean over ranks of a few Python floats (float64 on the wire, on the collectives' device)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).cpu().tolist()
