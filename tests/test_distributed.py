"""Process-group setup: a rank whose peers never join fails in one line within the collective timeout,
instead of the store's traceback."""

from __future__ import annotations

import socket
import time

import pytest
import torch.distributed as dist

from anyrec.backends import get_backend
from anyrec.runtime.distributed import RendezvousError, init_distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _started_by_hand(monkeypatch: pytest.MonkeyPatch, rank: int) -> int:
    """The environment of rank `rank` of 2 started without torchrun, its peer never started."""
    port = _free_port()
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    return port


@pytest.mark.parametrize(("rank", "waited_for"), [
    (0, "for the other 1 rank(s) to join the process group"),
    (1, "to reach rank 0's store at 127.0.0.1:"),
])
def test_a_rank_whose_peers_never_join_fails_in_one_line(monkeypatch, rank, waited_for):
    assert not dist.is_initialized()
    port = _started_by_hand(monkeypatch, rank)
    start = time.monotonic()
    with pytest.raises(RendezvousError) as e:
        init_distributed(get_backend("cpu"), timeout_s=1)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"rank {rank} of 2: waited 1 s (trainer.collective_timeout_s)")
    assert waited_for in message and f"127.0.0.1:{port}" in message
    assert "the peer ranks never joined" in message
    assert time.monotonic() - start < 30  # bounded by the timeout (the store retries within it)
    assert not dist.is_initialized()


def test_train_entry_point_says_it_in_one_line_and_exits_2(monkeypatch, capfd):
    from anyrec import train

    from .conftest import compose_config

    cfg, _ = compose_config(["model=dlrm_tiny", "backend.name=cpu", "trainer.collective_timeout_s=1",
                             "trainer.calibrate=never", "trainer.tensorboard=false"])
    _started_by_hand(monkeypatch, 0)
    with pytest.raises(SystemExit) as e:
        train.main(cfg)
    assert e.value.code == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anyrec-train: error: rank 0 of 2: waited 1 s"), err
    assert not dist.is_initialized()


def test_a_launch_handshake_that_times_out_is_one_line(monkeypatch):
    from anyrec.runtime import distributed

    _started_by_hand(monkeypatch, 0)

    def never_answered(info):
        raise TimeoutError("ranks did not join within 600 s")

    monkeypatch.setattr(distributed, "_elastic_store", never_answered)
    with pytest.raises(RendezvousError) as e:
        init_distributed(get_backend("cpu"), timeout_s=1)
    assert str(e.value).startswith("rank 0 of 2: waited at 127.0.0.1:")
    assert "the peer ranks never joined (ranks did not join within 600 s)" in str(e.value)
    assert not dist.is_initialized()
