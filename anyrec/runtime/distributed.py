"""Process-group setup from torchrun's environment (or a one-process group without it).

torchrun tells every worker where it sits: RANK / WORLD_SIZE over the job, LOCAL_RANK /
LOCAL_WORLD_SIZE on its host, GROUP_RANK / GROUP_WORLD_SIZE for the host among the hosts (one
torchrun agent per host). The planner and torchrec's table-row-wise sharding take a host to be
`local_world_size` consecutive ranks, so the job must run the same number of ranks on every host.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from anyrec.backends import Backend, get_backend
from anyrec.backends.cpu import allowed_cores
from anyrec.backends.interface import Binding
from anyrec.choices import Switch
from anyrec.runtime.shutdown import Heartbeat

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job: ranks over the job, ranks on its host, hosts."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    hosts: int = 1  # torchrun agents (GROUP_WORLD_SIZE)
    host: int = 0  # this agent's GROUP_RANK

    @property
    def is_main(self) -> bool:
        return self.rank == 0


ONE_PROCESS = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1)  # a job without torchrun


def broadcast_from_main(value: object, info: DistInfo) -> object:
    """Rank 0's `value` on every rank (any picklable object; a collective on every rank)."""
    if info.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(value: object, info: DistInfo) -> list:
    """Every rank's `value`, by rank (any picklable object; a collective on every rank)."""
    if info.world_size == 1:
        return [value]
    out = [None] * info.world_size
    dist.all_gather_object(out, value)
    return out


def env_dist_info() -> DistInfo:
    """Rank facts from torchrun's variables; a single process without them."""
    env = os.environ
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    local = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    return DistInfo(rank, world, int(env.get("LOCAL_RANK", "0")), local,
                    hosts=int(env.get("GROUP_WORLD_SIZE", str(max(1, world // max(1, local))))),
                    host=int(env.get("GROUP_RANK", str(rank // max(1, local)))))


_JOIN = "anyrec/join"  # keys of the launch handshake in torchrun's agent store


def launch_token(store: dist.Store, rank: int, world_size: int, timeout_s: float = 600.0) -> str:
    """A key prefix that every rank of this launch gets and no earlier launch on `store` used.

    torchrun's agent store outlives worker restarts and keeps the previous attempt's keys (e.g. the
    gloo address of a killed rank). TORCHELASTIC_RESTART_COUNT cannot name the attempt: an agent whose
    workers were stopped only because another host's failed does not count a restart. Instead rank 0
    draws a token and hands it to each rank in answer to a nonce that rank drew; the ranks acknowledge
    under the token (no stale key can hold either). Assumes, as torchrun ensures, that no worker of an
    earlier attempt is alive.
    """
    if world_size == 1:
        return uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        token = uuid.uuid4().hex
        requests = [f"{_JOIN}/req/{r}" for r in range(1, world_size)]
        answers = [f"{_JOIN}/resp/{r}" for r in range(1, world_size)]
        store.wait(requests)  # each exists, from this launch or an earlier one
        answered: list[bytes | None] = [None] * len(requests)
        while store.add(f"{_JOIN}/ack/{token}", 0) < world_size - 1:
            nonces = store.multi_get(requests)
            todo = [i for i, n in enumerate(nonces) if n != answered[i]]
            if todo:
                store.multi_set([answers[i] for i in todo], [nonces[i] + b":" + token.encode() for i in todo])
                for i in todo:
                    answered[i] = nonces[i]
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not join within {timeout_s:.0f} s")
            time.sleep(0.02)
        return token
    nonce = uuid.uuid4().hex
    store.set(f"{_JOIN}/req/{rank}", nonce)
    while True:
        got, _, token = store.get(f"{_JOIN}/resp/{rank}").decode().partition(":")
        if got == nonce:
            store.add(f"{_JOIN}/ack/{token}", 1)
            return token
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not answer rank {rank} within {timeout_s:.0f} s")
        time.sleep(0.02)


def _elastic_store(info: DistInfo) -> dist.Store | None:
    """Under torchrun's agent store, that store under a prefix of this launch's own (see launch_token)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=10))
    return dist.PrefixStore(f"anyrec/launch_{launch_token(store, info.rank, info.world_size)}", store)


def check_hosts(info: DistInfo, device: torch.device | None) -> None:
    """Raise ValueError on every rank unless every host runs `local_world_size` consecutive ranks (a
    collective: torchrun accepts a different --nproc-per-node per host, which only some ranks see)."""
    if info.world_size == 1:
        return
    numbered = (info.rank == info.host * info.local_world_size + info.local_rank
                and info.hosts * info.local_world_size == info.world_size)
    t = torch.tensor([info.local_world_size, -info.local_world_size, int(not numbered)], dtype=torch.int64,
                     device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    most, fewest, misnumbered = int(t[0]), -int(t[1]), int(t[2])
    if most != fewest:
        raise ValueError(f"hosts run different numbers of ranks ({fewest} to {most}); anyrec needs the "
                         "same --nproc-per-node on every host")
    if misnumbered:
        raise ValueError(f"ranks are not numbered host by host ({info.world_size} ranks, {info.hosts} "
                         f"host(s) x {info.local_world_size}); launch with torchrun, one agent per host")


class RendezvousError(ValueError):
    """The ranks of a job never all joined its process group (a rank started alone, by hand, or its
    peers' launcher gone): said in one line instead of the store's traceback."""


def _rendezvous_problem(info: DistInfo, e: Exception, timeout_s: float | None) -> str:
    """One line for a process group that could not be formed: what this rank waited for, where, how long."""
    at = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if isinstance(e, TimeoutError):  # under torchrun: the launch handshake (launch_token) timed out
        what = f"waited at {at} for the other ranks of this launch to answer"
    else:
        waited = f"{timeout_s:g} s (trainer.collective_timeout_s)" if timeout_s else "torch's default timeout"
        what = (f"waited {waited} at {at} for the other {info.world_size - 1} rank(s) to join the process "
                "group" if info.rank == 0 else f"waited {waited} to reach rank 0's store at {at}")
    cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"rank {info.rank} of {info.world_size}: {what}; the peer ranks never joined ({cause}); start "
            f"all {info.world_size} ranks (RANK=0..{info.world_size - 1}) within that time, or launch with "
            "torchrun")


def init_distributed(backend: Backend, timeout_s: float | None = None) -> DistInfo:
    """Join (or create) the default process group with the backend's collectives library.

    `timeout_s` (trainer.collective_timeout_s) bounds every collective: a rank waiting longer on a
    stopped or stuck peer fails instead of hanging for torch's default (10 to 30 minutes). Ranks that
    never all join within `timeout_s` are a RendezvousError (one line).
    """
    info = env_dist_info()
    backend.set_device(info.local_rank)
    if not dist.is_initialized():
        # Launched without torchrun: a group of one on an in-memory store. The process's environment
        # is left alone: a port written there would be inherited by every process it starts later.
        alone = "MASTER_ADDR" not in os.environ and info.world_size == 1
        device_id = backend.device(info.local_rank) if backend.device_type != "cpu" else None
        try:
            dist.init_process_group(backend=backend.dist_backend, rank=info.rank,
                                    store=dist.HashStore() if alone else _elastic_store(info),
                                    world_size=info.world_size, device_id=device_id,
                                    timeout=timedelta(seconds=timeout_s) if timeout_s else None)
        except (dist.DistError, TimeoutError) as e:  # DistStoreError, DistNetworkError: peers never came
            raise RendezvousError(_rendezvous_problem(info, e, timeout_s)) from None
    check_hosts(info, backend.device(info.local_rank))
    if info.is_main:
        logger.info("%d host(s) x %d ranks (world size %d)", info.hosts, info.local_world_size,
                    info.world_size)
    return info


@dataclass(frozen=True)
class Runtime:
    """What a process sets up once, before it calibrates or trains: its backend, its place in the process
    group, its device, and whether its threads were bound to its cores."""

    backend: Backend
    dist: DistInfo
    device: torch.device
    binding: Binding  # the host threads' binding and count, as decided at start
    cores: tuple[int, ...]  # the cores the process could run on before binding (calibration's cache key)
    heartbeat: Heartbeat | None = None  # watches the next rank (trainer.peer_timeout_s); None: unwatched
    started: float | None = None  # time.monotonic() when the job began (launch_started); None: a library call

    @property
    def bound(self) -> bool:
        """Threads bound to this rank's share of the host's cores."""
        return self.binding.cores is not None


def start_runtime(backend_name: str, bind_cores: Switch = Switch.auto, timeout_s: float | None = None,
                  peer_timeout_s: float | None = None, threads: int | None = None,
                  started: float | None = None) -> Runtime:
    """The backend called `backend_name`, the process group joined (init_distributed, with its timeouts)
    and this rank's threads bound as `bind_cores` says and as many as `threads` says (None, auto: by the
    cores' load): once per process. `started`: when the job began (launch_started(), from an entry
    point); None for a library call."""
    backend = get_backend(backend_name)
    info = init_distributed(backend, timeout_s)
    # the heartbeat (shutdown.Heartbeat) once the group is up; the runtime holds it, close_runtime stops it
    heartbeat = Heartbeat(info.rank, info.world_size, peer_timeout_s).start() if peer_timeout_s else None
    cores = tuple(allowed_cores())
    binding = backend.bind_local_rank(info.local_rank, info.local_world_size, bind_cores, threads, info.rank,
                                      info.world_size)
    return Runtime(backend, info, backend.device(info.local_rank), binding, cores, heartbeat, started)


def close_runtime(runtime: Runtime, barrier: bool = True) -> None:
    """The end of what start_runtime began: the group torn down (destroy_distributed) and the runtime's
    heartbeat stopped with it."""
    destroy_distributed(barrier, runtime.heartbeat)


def destroy_distributed(barrier: bool = True, heartbeat: Heartbeat | None = None) -> None:
    """Tear the group down; collect sharded modules first (avoids an abort at exit with row-wise shards).
    `barrier=False` when a peer may be gone (after an error): then nobody waits for it. `heartbeat` stops
    after the barrier (it still watches the peers there) and before the group goes down (the peers leave
    at their own pace)."""
    gc.collect()
    if barrier and dist.is_initialized():
        dist.barrier()
    if heartbeat is not None:
        heartbeat.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def padded(t: torch.Tensor, size: int, dim: int = 0) -> torch.Tensor:
    """`t` zero-padded along `dim` to `size` (all_gather needs one shape on every rank)."""
    if t.shape[dim] == size:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def all_gather_list(t: torch.Tensor, pg: dist.ProcessGroup | None, ranks: int) -> list[torch.Tensor]:
    """Every one of the `ranks` ranks' `t` (one shape on all) in `pg` (None: the default group)."""
    out = [torch.empty_like(t) for _ in range(ranks)]
    dist.all_gather(out, t, group=pg)
    return out


def all_reduce_mean(values: list[float], device: torch.device) -> list[float]:
    """Mean over ranks of a few Python floats (float64 on the wire, on the collectives' device)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).cpu().tolist()
