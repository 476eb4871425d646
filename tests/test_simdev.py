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

from .conftest import ROOT, last_json_line, pip_install_target, single_process_env

pytestmark = pytest.mark.integration

PKG = ROOT / "examples" / "simdev"
DOC = ROOT / "docs" / "porting.md"
PARITY = ["model=dlrm_tiny", "trainer.steps=4", "backend.embedding_kernel=torch"]


@pytest.fixture(scope="module")
def simdev_path(tmp_path_factory) -> Path:
    """examples/simdev installed with pip into a fresh target directory (not the venv)."""
    return pip_install_target(PKG, tmp_path_factory.mktemp("simdev"))


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


def test_porting_walkthrough_runs_as_written(simdev_path, tmp_path):
    cmds = walkthrough_commands()
    # The first installs the package: here into the module's target directory rather than the venv.
    assert cmds[0] == "pip install examples/simdev"
    outs = []
    for cmd in cmds[1:]:
        proc = _sh(cmd, tmp_path, simdev_path)
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
    cpu = json.loads((tmp_path / "cpu.json").read_text())["runs"][0]
    assert cpu["weights_sha256"][:12] in against and "all variants agree" in against


@pytest.mark.parametrize("planner", ["planner=simple planner.sharding=table_wise",
                                     "planner=simple planner.sharding=column_wise",
                                     "planner=simple planner.sharding=table_row_wise",
                                     "planner=codesign"])
def test_two_ranks_train_evaluate_and_checkpoint(simdev_path, tmp_path, planner):
    cmd = ("torchrun --standalone --nproc_per_node=2 -m anyrec.train backend=simdev model=dlrm_tiny "
           f"{planner} trainer.steps=3 trainer.eval_steps=2 trainer.checkpoint.dir=ckpt hydra.run.dir=run")
    proc = _sh(cmd, tmp_path, simdev_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert summary["backend"] == "simdev" and summary["world_size"] == 2 and summary["steps"] == 3
    assert summary["eval_auc"] is not None and summary["checkpoint"]
    log = (tmp_path / "run" / "train_rank0.log").read_text()
    if "codesign" in planner:
        assert "2 x SimDev-1" in log  # planned with the plugin's simulated DeviceSpec


@pytest.mark.parametrize("optim,nproc", [("sgd", 1), ("adagrad", 1), ("adagrad", 2),
                                         ("rowwise_adagrad", 1), ("rowwise_adagrad", 2)])
def test_parity_with_the_cpu_is_bit_exact(simdev_path, tmp_path, optim, nproc):
    """(sgd, 2 ranks) is the walk-through's own parity pair."""
    base = " ".join([*PARITY, f"optim={optim}"])
    runs = (("cpu", "parity.save=cpu.json"), ("simdev", "parity.against=cpu.json parity.save=sim.json"))
    for backend, flag in runs:
        variants = shlex.quote(f'parity.variants=["backend={backend} nproc={nproc}"]')
        proc = _sh(f"anyrec-parity {base} {variants} {flag}", tmp_path, simdev_path)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    cpu, sim = (json.loads((tmp_path / f).read_text())["runs"][0] for f in ("cpu.json", "sim.json"))
    assert len(cpu["losses"]) == 4 and sim["losses"] == cpu["losses"]
    assert sim["weights_sha256"] == cpu["weights_sha256"]
