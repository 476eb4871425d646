"""The simulated accelerator (examples/simdev): installed by pip, it trains the sharded DLRM through the
plugin interface alone, with the CPU's numbers bit for bit, and refuses misplaced host tensors.

Every command of docs/porting.md's walk-through runs here, in order.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, last_json_line, single_process_env

pytestmark = pytest.mark.integration

PKG = ROOT / "examples" / "simdev"
DOC = ROOT / "docs" / "porting.md"
CHECK = ROOT / "tests" / "dist" / "simdev_check.py"


def _sh(cmd: str, cwd: Path, path: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run one shell command line with the plugin and anyrec importable and the venv's tools on PATH;
    its own session, so a timeout takes torchrun's workers with it."""
    env = single_process_env(path)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.Popen(cmd, shell=True, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def walkthrough_commands() -> list[str]:
    """The bash block after the `simdev-walkthrough` marker in docs/porting.md, one command a line."""
    text = DOC.read_text()
    block = re.search(r"<!-- simdev-walkthrough -->\n```bash\n(.*?)```", text, re.S)
    assert block, "docs/porting.md lost its simdev walk-through block"
    return [ln.strip() for ln in block.group(1).splitlines() if ln.strip() and not ln.startswith("#")]


def test_porting_walkthrough_runs_as_written(simdev_site, tmp_path):
    cmds = walkthrough_commands()
    # The first installs the package: here into the module's target directory rather than the venv.
    assert cmds[0] == "pip install examples/simdev"
    outs = []
    for cmd in cmds[1:]:
        proc = _sh(cmd, tmp_path, simdev_site)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        outs.append(proc.stdout)
    selfcheck, train, resume, _, against = outs
    assert "strictness check: simdev: aten::_embedding_bag got a cpu tensor of shape (3,)" in selfcheck
    assert "selfcheck: ok" in selfcheck
    first, second = last_json_line(train), last_json_line(resume)
    assert first["backend"] == second["backend"] == "simdev" and first["world_size"] == 2
    assert first["steps"] == 3 and first["eval_auc"] is not None and first["checkpoint"]
    assert second["resumed_from_step"] == 3 and second["steps"] == 5
    log = (tmp_path / "run1" / "train_rank0.log").read_text()
    assert "backend: simdev" in log and "sparse ops on PrivateUse1: portable kernels" in log
    assert "precision: fp32" in log  # what runs: simdev has no autocast dtypes
    cpu = json.loads((tmp_path / "cpu.json").read_text())["runs"][0]
    assert cpu["weights_sha256"][:12] in against and "all variants agree" in against


OPTIMS = ("sgd", "adagrad", "rowwise_adagrad")
SHARDINGS = {"table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"}


def _jobs(path: Path, tmp: Path, jobs: list[str], nproc: int) -> dict:
    """tests/dist/simdev_check.py's records of `jobs`, run one after another in one process per rank."""
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                                 if nproc > 1 else [])
    tmp.mkdir()
    proc = _sh(shlex.join([*launch, str(CHECK), str(tmp / "out.json"), *jobs]), tmp, path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())


# dlrmv4_small's sequence tables, every one row-wise (its output dist's portable invert_permute), under the
# co-design planner (the run's memory prediction), on anyrec's torch TBE and the torch attention
V4 = "torch rowwise_adagrad model=dlrmv4_small planner.sharding=row_wise"


def test_two_ranks_train_every_sharding_type_with_the_cpus_numbers(simdev_site, tmp_path):
    """One 2-rank job per device trains dlrm_tiny under a plan mixing every sharding type with
    data-parallel tables (column-wise ones except under rowwise_adagrad), for each optimizer, with
    evaluation and a checkpoint: simdev's records are the CPU's bit for bit, and the torch
    implementation's data-parallel tables train as FBGEMM's dense ones do, bit for bit. The same launches
    train dlrmv4_small's sequence embeddings on the torch TBE under the same plan: the CPU's losses within
    anyrec-parity's tolerance (the HSTU layers' ops round differently on the two devices from the first
    step, in the 8th digit), and the run's predicted peak memory within 10 % of simdev's measured one."""
    cpu = _jobs(simdev_site, tmp_path / "cpu",
                [f"cpu torch {o}" for o in OPTIMS] + ["cpu fbgemm sgd", f"cpu {V4}"], 2)
    sim = _jobs(simdev_site, tmp_path / "sim", [f"simdev torch {o}" for o in OPTIMS] + [f"simdev {V4}"], 2)
    c, s = cpu[f"cpu {V4}"], sim[f"simdev {V4}"]
    assert s["summary"]["model"] == "dlrmv4_small" and s["summary"]["embedding_kernel"] == "torch"
    assert set(s["shardings"].values()) == {"row_wise"} and len(s["shardings"]) == 11
    assert s["shardings"] == c["shardings"] and len(s["losses"]) == len(c["losses"]) == 3
    assert s["losses"] == pytest.approx(c["losses"], rel=1e-5)
    errors = s["summary"]["memory_prediction_error_per_rank"]
    assert len(errors) == 2 and all(abs(e) <= 0.10 for e in errors), errors
    for o in OPTIMS:
        c, s = cpu[f"cpu torch {o}"], sim[f"simdev torch {o}"]
        summary = s["summary"]
        assert summary["backend"] == "simdev" and summary["world_size"] == 2 and summary["steps"] == 3
        assert summary["eval_auc"] is not None and summary["checkpoint"]
        exact = SHARDINGS - ({"column_wise"} if o == "rowwise_adagrad" else set())
        assert set(s["shardings"].values()) == exact, o
        assert len(s["losses"]) == 3 and s["losses"] == c["losses"], o
        assert s["weights_sha256"] == c["weights_sha256"], o
    assert cpu["cpu fbgemm sgd"]["weights_sha256"] == cpu["cpu torch sgd"]["weights_sha256"]


def test_one_rank_parity_and_precision(simdev_site, tmp_path):
    """One rank (the unsharded torch TBE): the CPU's numbers bit for bit; `mixed_precision=auto` runs
    fp32 on simdev (no autocast dtypes) and a forced bf16 is refused in one line."""
    bf16 = "simdev torch sgd trainer.mixed_precision=bf16"
    rec = _jobs(simdev_site, tmp_path / "one", [f"{b} torch {o}" for o in OPTIMS for b in ("cpu", "simdev")]
                + [bf16], 1)
    for o in OPTIMS:
        c, s = rec[f"cpu torch {o}"], rec[f"simdev torch {o}"]
        assert s["summary"]["backend"] == "simdev" and len(s["losses"]) == 3 and s["losses"] == c["losses"], o
        assert s["weights_sha256"] == c["weights_sha256"] and s["autocast"] is False, o
    assert rec[bf16]["error"] == "trainer.mixed_precision=bf16: simdev has no bf16 autocast; use auto or fp32"
