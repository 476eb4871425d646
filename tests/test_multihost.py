"""Two hosts on one machine: two torchrun agents meet at a c10d rendezvous on loopback.

Each agent runs in its own session (start_new_session), as it would on its own host; the job trains
model=dlrm_tiny with checkpoints in one shared directory. Cases: a clean run with table-row-wise
forced (the reference), a SIGKILLed worker on host 1 under --max-restarts=1, a resume of the
two-host checkpoint on one host (resharded), and hosts with different rank counts. Every launch is
bounded in time, and leaves no process behind (checked, then killed by process group if it did).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from anyrec.backends import get_backend
from anyrec.config import DataConfig, ModelConfig
from anyrec.data.criteo import CriteoSource, npy_paths
from anyrec.runtime.distributed import destroy_distributed, init_distributed, launch_token

from .conftest import ROOT, free_port, last_json_line, torchrun
from .faults import KILL_AT_STEP, KILL_RANK, faulty

MARK = "ANYREC_TEST_LAUNCH"  # environment marker: finds every process a launch started
BASE = ["-m", "anyrec.train", "model=dlrm_tiny", "data.batch_size=32", "trainer.steps=8",
        "trainer.eval_steps=0", "trainer.progress=false", "trainer.tensorboard=false", "trainer.log_every=4",
        "trainer.checkpoint.every=4", "trainer.fingerprint_weights=true"]
TWRW = "planner.sharding=table_row_wise"
# One-ulp-sized float noise: with 4 ranks, a resumed run's first step sums the dense all-reduce in
# another order than an uninterrupted one (not bit-exact even on one host); a lost optimizer state or
# a wrong data position moves the loss by orders of magnitude more.
LOSS_ATOL = 1e-6


def _marked(marker: str) -> list[int]:
    """Live processes carrying `MARK=marker` in their environment (agents and their workers)."""
    needle = f"{MARK}={marker}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    found.append(int(d.name))
            except OSError:
                pass  # gone, or not ours to read
    return found


def _wait_gone(marker: str, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _kill(marker: str) -> None:
    """SIGKILL every process group a launch started (agents and workers each lead their own)."""
    for pid in _marked(marker):
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Launch:
    """What a multi-agent launch left: exit codes, each agent's output, and the stray processes."""

    returncodes: list[int]
    stdout: list[str]
    stderr: list[str]
    strays: list[int]

    @property
    def out(self) -> str:
        return "\n".join(self.stdout + self.stderr)

    def summary(self) -> dict:
        """The JSON summary, printed by rank 0 on whichever agent holds it."""
        found = [last_json_line(s) for s in self.stdout if s.strip().splitlines()[-1:] != []
                 and s.strip().splitlines()[-1].startswith("{")]
        assert len(found) == 1, self.out[-4000:]
        return found[0]


def agent_flags(hosts: int, nproc: int, endpoint: str, run_id: str) -> list[str]:
    """torchrun's flags for one host's agent, as docs/multinode.md shows them."""
    return [f"--nnodes={hosts}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", "--local-addr=127.0.0.1"]


def launch_hosts(args: list[str], cwd: Path, nproc: tuple[int, ...] = (2, 2), torchrun_args: tuple = (),
                 timeout: float = 300) -> Launch:
    """One torchrun agent per 'host' (its own session), all at a c10d rendezvous on 127.0.0.1."""
    marker = uuid.uuid4().hex
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           MARK: marker}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    procs, files = [], []
    try:
        for host, n in enumerate(nproc):
            out, err = open(cwd / f"host{host}.out", "w+"), open(cwd / f"host{host}.err", "w+")  # noqa: SIM115
            files += [out, err]
            cmd = [sys.executable, "-m", "torch.distributed.run",
                   *agent_flags(len(nproc), n, f"127.0.0.1:{port}", f"test-{marker}"), *torchrun_args, *args]
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        strays = _wait_gone(marker, 15)  # every worker must be gone once its agent has exited
    finally:
        _kill(marker)
        for p in procs:
            p.wait()
    texts = []
    for f in files:
        f.seek(0)
        texts.append(f.read())
        f.close()
    assert not _marked(marker)
    return Launch([p.returncode for p in procs], texts[0::2], texts[1::2], strays)


def plan_rows(text: str) -> dict[str, tuple[str, set[int]]]:
    """Per table of the co-design plan report in a rank 0's log file: (sharding, ranks)."""
    rows = {}
    for m in re.finditer(r"^(t_cat_\d+)\s+\d+\s+\d+\s+\d+\s+(\w+)\s+\w+\s+\w+\s+([\d,-]+)\s", text, re.M):
        lo_hi = [int(x) for x in m.group(3).split("-")] if "-" in m.group(3) else None
        ranks = set(range(lo_hi[0], lo_hi[1] + 1)) if lo_hi else {int(x) for x in m.group(3).split(",")}
        rows[m.group(1)] = (m.group(2), ranks)
    return rows


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """The reference: 2 hosts x 2 ranks, table-row-wise forced, checkpoints at steps 4 and 8."""
    d = tmp_path_factory.mktemp("two_hosts")
    run = launch_hosts([*BASE, TWRW, f"trainer.checkpoint.dir={d}/ck", f"hydra.run.dir={d}/h"], d)
    return d, run


def test_a_group_of_one_leaves_the_environment_alone(monkeypatch):
    """Without torchrun's variables the group of one lives on an in-memory store: nothing is written
    into os.environ, where a port would be inherited (and found in use) by every process started later."""
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    if dist.is_initialized():
        dist.destroy_process_group()
    before = dict(os.environ)
    info = init_distributed(get_backend("cpu"))
    try:
        assert info.world_size == 1 and dist.get_world_size() == 1 and dist.get_rank() == 0
        assert dict(os.environ) == before
    finally:
        destroy_distributed(barrier=False)
    assert not dist.is_initialized()


@pytest.mark.integration
def test_two_hosts_train_with_host_aware_plan_and_shared_checkpoints(two_hosts):
    d, run = two_hosts
    assert run.returncodes == [0, 0], run.out[-4000:]
    assert run.strays == []
    s = run.summary()
    assert s["world_size"] == 4 and s["hosts"] == 2 and s["local_world_size"] == 2
    assert s["steps"] == 8 and s["resumed_from_step"] is None
    assert "2 host(s) x 2 ranks (world size 4)" in run.out
    # Every table's rows sit on the two ranks of one host; both hosts hold tables.
    rows = plan_rows((d / "h" / "train_rank0.log").read_text())  # the plan report: the log file's
    assert len(rows) == 26 and {kind for kind, _ in rows.values()} == {"table_row_wise"}
    assert {frozenset(r) for _, r in rows.values()} == {frozenset({0, 1}), frozenset({2, 3})}
    # Both hosts wrote their shards into the one shared directory.
    for step in (4, 8):
        ck = d / "ck" / f"step_{step}"
        assert sorted(p.name for p in ck.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
        assert json.loads((ck / "meta.json").read_text())["world_size"] == 4


@pytest.mark.integration
def test_sigkilled_worker_on_host_1_restarts_both_hosts_from_checkpoint(two_hosts, tmp_path, monkeypatch):
    ref = two_hosts[1].summary()
    monkeypatch.setenv(KILL_AT_STEP, "6")
    monkeypatch.setenv(KILL_RANK, "3")
    run = launch_hosts([*faulty(BASE), TWRW, f"trainer.checkpoint.dir={tmp_path}/ck",
                        f"hydra.run.dir={tmp_path}/h"], tmp_path, torchrun_args=("--max-restarts=1",))
    assert run.returncodes == [0, 0], run.out[-4000:]
    assert run.strays == []
    assert "SIGKILL rank 3 after step 6" in run.out
    assert "exitcode: -9" in run.out.replace("  ", " ")  # host 1's agent saw its worker killed
    # Both agents stopped their surviving workers and started new ones, which resumed from step 4.
    # (or, where a surviving worker saw the lost peer first, it stopped itself and said so)
    assert all("closing signal SIGTERM" in err or "a peer rank failed" in err for err in run.stderr), \
        run.out[-4000:]
    s = run.summary()
    assert s["steps"] == 8 and s["world_size"] == 4 and s["hosts"] == 2 and s["resumed_from_step"] == 4
    assert s["final_loss"] == pytest.approx(ref["final_loss"], rel=0, abs=LOSS_ATOL)
    assert s["train_loss"] == pytest.approx(ref["train_loss"], rel=0, abs=LOSS_ATOL)


@pytest.mark.integration
def test_two_host_checkpoint_resumes_resharded_on_one_host(two_hosts, tmp_path):
    d, ref_run = two_hosts
    ref = ref_run.summary()
    shutil.copytree(d / "ck" / "step_4", tmp_path / "ck" / "step_4")
    proc = torchrun([*BASE, "planner.sharding=row_wise", f"trainer.checkpoint.dir={tmp_path}/ck",
                     f"hydra.run.dir={tmp_path}/h"],
                    nproc=4, cwd=tmp_path, timeout=300, env={"GLOO_SOCKET_IFNAME": "lo"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = last_json_line(proc.stdout)
    assert s["world_size"] == 4 and s["hosts"] == 1 and s["local_world_size"] == 4
    assert s["resumed_from_step"] == 4 and s["steps"] == 8
    assert "1 host(s) x 4 ranks (world size 4)" in proc.stdout + proc.stderr
    # One host: no table can be table-row-wise, so the loaded shards were laid out anew.
    rows = plan_rows((tmp_path / "h" / "train_rank0.log").read_text())
    assert len(rows) == 26 and "table_row_wise" not in {kind for kind, _ in rows.values()}
    # Same data slices (global ranks), same state: the same loss as the two-host run.
    assert s["final_loss"] == pytest.approx(ref["final_loss"], rel=0, abs=LOSS_ATOL)


@pytest.mark.integration
def test_hosts_with_different_rank_counts_fail_on_every_rank(tmp_path):
    run = launch_hosts([*BASE, f"hydra.run.dir={tmp_path}/h"], tmp_path, nproc=(2, 1), timeout=240)
    assert all(rc != 0 for rc in run.returncodes), run.out[-4000:]
    assert run.strays == []
    lines = [ln for ln in run.out.splitlines() if ln.startswith("anyrec-train: error:")]
    assert lines == ["anyrec-train: error: hosts run different numbers of ranks (1 to 2); anyrec needs the "
                     "same --nproc-per-node on every host"], run.out[-4000:]


def test_launch_token_ignores_an_earlier_launchs_keys():
    """Ranks agree on a fresh token though the store holds a killed launch's answers and acks."""
    world = 3
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def client():
        return dist.TCPStore("127.0.0.1", server.port, is_master=False)

    # What an earlier launch left: requests, answers (token "old") and acks.
    for r in range(1, world):
        server.set(f"anyrec/join/req/{r}", f"stale{r}")
        server.set(f"anyrec/join/resp/{r}", f"stale{r}:old")
    server.add("anyrec/join/ack/old", world - 1)
    tokens: dict[int, str] = {}
    saw_stale = {r: threading.Event() for r in range(1, world)}

    class Watched:
        """The store as rank r sees it, noting when it reads an earlier launch's answer."""

        def __init__(self, r: int) -> None:
            self.r, self.store = r, client()

        def get(self, key: str) -> bytes:
            value = self.store.get(key)
            if value.startswith(b"stale"):
                saw_stale[self.r].set()
            return value

        def __getattr__(self, name: str):
            return getattr(self.store, name)

    def rank(r: int) -> None:
        if r == 0:  # rank 0 last: every other rank has read a stale answer before it starts
            assert all(e.wait(30) for e in saw_stale.values())
            tokens[r] = launch_token(client(), r, world, timeout_s=30)
        else:
            tokens[r] = launch_token(Watched(r), r, world, timeout_s=30)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(tokens) == world and len(set(tokens.values())) == 1
    assert tokens[0] != "old"


_JOIN = """
import torch, torch.distributed as dist
from anyrec.backends import get_backend
from anyrec.runtime.distributed import init_distributed
init_distributed(get_backend("cpu"))
t = torch.ones(1)
dist.all_reduce(t)
print("sum", int(t.item()), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.integration
def test_hosts_with_different_restart_counts_join_one_group():
    """torchrun counts restarts per agent: after host 1's worker failed, its workers start with
    TORCHELASTIC_RESTART_COUNT=1 while host 0's (stopped only for the new round) keep 0. Both must
    still form one group in the agent store that holds the first launch's keys."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    for restarts in ((0, 0), (0, 1)):
        procs = [subprocess.Popen([sys.executable, "-c", _JOIN], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                  env={**env, "RANK": str(r), "GROUP_RANK": str(r),
                                       "TORCHELASTIC_RESTART_COUNT": str(restarts[r])}) for r in range(2)]
        try:
            outs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        assert [p.returncode for p in procs] == [0, 0] and all("sum 2" in o for o in outs), outs


def test_each_rank_reads_its_own_rows(tmp_path):
    """Rank r of W reads global batch step * W + r: the 4 ranks of 2 hosts read disjoint rows that
    together cover the file in order, whichever host they are on."""
    n, b, world = 64, 4, 4
    dense = np.zeros((n, 13), dtype=np.float32)
    dense[:, 0] = np.arange(n)
    for arr, path in zip((dense, np.zeros((n, 26), dtype=np.int32), np.zeros((n, 1), dtype=np.int32)),
                         npy_paths(tmp_path, "day_0"), strict=True):
        np.save(path, arr)
    model = ModelConfig(name="m", table_rows=[10] * 26, bottom_mlp=[16], top_mlp=[1], embedding_dim=8)
    data = DataConfig(name="criteo_npy", path=str(tmp_path), train_files=["day_0"], batch_size=b)
    seen = {r: [int(x) for step in range(3) for x in CriteoSource(model, data, r, world).batch(step)
                .dense_features[:, 0]] for r in range(world)}
    assert sorted(x for rows in seen.values() for x in rows) == list(range(3 * world * b))
    assert seen[2][:b] == list(range(2 * b, 3 * b))  # host 1's first rank, step 0


# ---- the cluster recipes and the commands in docs/multinode.md -----------------------------------

DOC = ROOT / "docs" / "multinode.md"
SBATCH = ROOT / "examples" / "cluster" / "anyrec.sbatch"
PYTORCHJOB = ROOT / "examples" / "cluster" / "pytorchjob.yaml"


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def _sbatch(tmp_path: Path, args: list[str], shared: str | None = "/shared/anyrec"):
    """Run the sbatch script with stand-ins for scontrol and srun; the argv srun got (or None)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames node-[a-b]" ] || exit 1\n'
                                      'printf "node-a\\nnode-b\\n"\n')
    (bin_dir / "srun").write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$SRUN_ARGV"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    record = tmp_path / "srun.argv"
    record.unlink(missing_ok=True)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-b]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "anyrec",
           "SRUN_ARGV": str(record), "HOME": str(tmp_path)}
    if shared:
        env["ANYREC_SHARED"] = shared
    proc = subprocess.run(["bash", str(SBATCH), *args], env=env, capture_output=True, text=True, timeout=60)
    argv = record.read_text().split("\0")[:-1] if record.exists() else None
    return proc, argv


@pytest.mark.integration
def test_sbatch_runs_one_torchrun_agent_per_node_with_c10d_on_the_first(tmp_path):
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, timeout=30).returncode == 0
    proc, argv = _sbatch(tmp_path, ["model=dlrmv2", "optim=adagrad", "hardware=mi350x"])
    assert proc.returncode == 0, proc.stderr
    assert argv == ["--ntasks=2", "--ntasks-per-node=1", "torchrun", "--nnodes=2", "--nproc-per-node=8",
                    "--rdzv-backend=c10d", "--rdzv-endpoint=node-a:29400", "--rdzv-id=anyrec-77",
                    "--max-restarts=3", "-m", "anyrec.train",
                    "trainer.checkpoint.dir=/shared/anyrec/checkpoints/anyrec",
                    "hydra.run.dir=/shared/anyrec/runs/77",
                    "model=dlrmv2", "optim=adagrad", "hardware=mi350x"]
    # The agent flags are the ones the two-host tests launch with (bar the loopback address).
    assert set(_flags(agent_flags(2, 8, "x", "y"))) - {"--local-addr"} < set(_flags(argv))
    from .conftest import compose_config

    compose_config([a for a in argv[11:] if not a.startswith(("hydra.", "hardware="))])  # valid overrides
    proc, argv = _sbatch(tmp_path, [], shared=None)
    assert proc.returncode != 0 and argv is None and "set ANYREC_SHARED" in proc.stderr


def test_pytorchjob_manifest():
    import yaml

    job = yaml.safe_load(PYTORCHJOB.read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    spec = job["spec"]
    elastic, worker = spec["elasticPolicy"], spec["pytorchReplicaSpecs"]["Worker"]
    assert elastic["rdzvBackend"] == "c10d" and elastic["maxRestarts"] >= 1
    assert elastic["minReplicas"] == elastic["maxReplicas"] == worker["replicas"]  # a fixed host count
    assert int(spec["nprocPerNode"]) >= 1
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"  # the container the operator injects PET_* into
    cmd = container["command"]
    assert cmd[:3] == ["torchrun", "-m", "anyrec.train"]
    from .conftest import compose_config

    overrides = [a for a in cmd[3:] if not a.startswith(("hydra.", "hardware="))]
    _, cfg = compose_config(overrides)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert cfg.trainer.checkpoint.dir.startswith("/shared/") and mounts["/shared"] == "shared"
    claims = {v["name"]: v for v in pod["volumes"]}
    assert "persistentVolumeClaim" in claims["shared"]


def _doc_commands() -> list[list[str]]:
    import shlex

    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    return [shlex.split(line) for block in blocks for line in block.splitlines() if line.strip()]


@pytest.mark.integration
def test_every_command_in_the_multinode_doc_is_one_a_test_runs(tmp_path, run_here):
    """torchrun lines are the two-host tests' agents, sbatch and kubectl name the files tested above,
    and the anyrec-plan lines run here, verbatim."""
    commands = _doc_commands()
    assert {c[0] for c in commands} == {"torchrun", "anyrec-plan", "sbatch", "kubectl"}
    plans = []
    for cmd in commands:
        if cmd[0] == "torchrun":
            tested = _flags(agent_flags(2, 2, "127.0.0.1:29400", "demo"))
            assert _flags(cmd) == tested and cmd[cmd.index("-m") + 1] == "anyrec.train"
            assert {"model=dlrm_tiny", TWRW} <= set(cmd)
        elif cmd[0] == "sbatch":
            assert cmd[1:3] == ["--nodes=8", str(SBATCH.relative_to(ROOT))]
            proc, argv = _sbatch(tmp_path, cmd[3:])
            assert proc.returncode == 0 and argv[-len(cmd[3:]):] == cmd[3:]
        elif cmd[0] == "kubectl":
            assert cmd[1:] == ["apply", "-f", str(PYTORCHJOB.relative_to(ROOT))]
        else:
            proc = run_here("plan", cmd[1:], tmp_path)
            assert proc.returncode == 0, proc.stderr[-3000:]
            plans.append(proc.stdout)
    default, dlrmv2 = plans
    # The excerpt the doc quotes is what the first command prints (the planner is deterministic).
    quoted = re.search(r"^    (hosts: 8 x 8 ranks.*)$", DOC.read_text(), re.M).group(1)
    assert quoted in default
    compared = re.findall(r"^    (table_row_wise tables\s+\d+ of 26\s+\d+ of 26)$", DOC.read_text(), re.M)
    assert len(compared) == 2  # the default model's counts, then DLRMv2's
    for quoted_counts, printed in zip(compared, (default, dlrmv2), strict=True):
        assert re.search(re.sub(r"\s+", r"\\s+", quoted_counts), printed)
