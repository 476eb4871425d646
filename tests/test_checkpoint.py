"""Checkpoints: exact resume under torchrun, resharding 2 -> 1 ranks, a SIGKILLed rank restarted by
torchrun, and clear failures (nothing overwritten) for corrupt or incompatible checkpoints (the one-process
runs in the test's own process: conftest.run_here)."""

from __future__ import annotations

import json
import shutil

import pytest

from .conftest import ROOT, last_json_line, torchrun
from .faults import KILL_AT_STEP, faulty

pytestmark = pytest.mark.integration  # every test here starts processes

BASE = ["-m", "anyrec.train", "model=dlrm_tiny", "data.batch_size=64", "trainer.eval_steps=2",
        "trainer.progress=false", "trainer.log_every=5", "trainer.fingerprint_weights=true",
        "planner.sharding=row_wise", "trainer.tensorboard=false"]


def _run(tmp_path, extra):
    """`torchrun --standalone --nproc_per_node=2 -m anyrec.train BASE... EXTRA`."""
    return torchrun([*BASE, f"hydra.run.dir={tmp_path}/hydra", *extra], cwd=tmp_path)


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    return last_json_line(proc.stdout)


def _tree(path):
    """Every checkpoint file (the directory's lock file aside) with its size and modification time."""
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in path.rglob("*") if p.name != ".anyrec.lock")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: 20 steps straight. B: 10 steps with checkpoints. C: B's directory resumed to 20."""
    tmp = tmp_path_factory.mktemp("ckpt")
    a = _ok(_run(tmp, ["trainer.steps=20"]))
    b = _ok(_run(tmp, ["trainer.steps=10", f"trainer.checkpoint.dir={tmp}/ck", "trainer.checkpoint.every=5"]))
    shutil.copytree(tmp / "ck", tmp / "ck_at_10")
    c = _ok(_run(tmp, ["trainer.steps=20", f"trainer.checkpoint.dir={tmp}/ck", "trainer.checkpoint.every=5"]))
    return tmp, a, b, c


def test_resume_is_exact(runs):
    """C (B's first 10 steps, resumed in a new launch) ends as A to the last bit: a resume restores
    everything, and two launches with the same seed train the same weights."""
    tmp, a, b, c = runs
    assert b["steps"] == 10 and b["checkpoint"].endswith("step_10")
    assert c["resumed_from_step"] == 10 and c["steps"] == 20
    assert c["final_loss"] == a["final_loss"]  # to the last bit
    assert c["weights_sha256"] == a["weights_sha256"]
    assert c["eval_auc"] == a["eval_auc"]
    # keep=2: the last two complete checkpoints, no temporary directories.
    assert sorted(p.name for p in (tmp / "ck").iterdir()) == [".anyrec.lock", "step_15", "step_20"]


def test_restore_onto_one_rank_reshards(runs, tmp_path, single):
    src, _, b, _ = runs
    shutil.copytree(src / "ck_at_10", tmp_path / "ck")
    d = _ok(single(["trainer.steps=10", f"trainer.checkpoint.dir={tmp_path}/ck"]))
    assert d["world_size"] == 1 and d["resumed_from_step"] == 10 and d["steps"] == 10
    assert d["weights_sha256"] == b["weights_sha256"]


@pytest.fixture
def single(train_here, tmp_path):
    """`python -m anyrec.train BASE... EXTRA` in one process, run in this one (conftest.train_here)."""
    def run(extra: list[str], flags: tuple[str, ...] = ()):
        return train_here([*BASE[2:], f"hydra.run.dir={tmp_path}/hydra", *extra], tmp_path, flags=flags)

    return run


def _error_lines(proc):
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("anyrec-train: error:")]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_checkpoint_fails_clearly(runs, tmp_path, damage, single):
    src = runs[0]
    shutil.copytree(src / "ck_at_10", tmp_path / "ck")
    shard = sorted((tmp_path / "ck" / "step_10").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    before = _tree(tmp_path / "ck")
    proc = single(["trainer.steps=20", f"trainer.checkpoint.dir={tmp_path}/ck",
                              "trainer.checkpoint.every=5"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = _error_lines(proc)
    assert len(lines) == 1 and "is corrupt" in lines[0] and shard.name in lines[0], proc.stderr[-3000:]
    assert _tree(tmp_path / "ck") == before  # nothing overwritten


def test_a_corrupt_checkpoint_under_torchrun_exits_in_one_line_not_by_a_signal(runs, tmp_path):
    """Every rank fails with the one line and exit 2, its heartbeat stopped and the group gone before the
    interpreter exits (a heartbeat thread left in the store's C++ code aborted a rank at exit)."""
    shutil.copytree(runs[0] / "ck_at_10", tmp_path / "ck")
    shard = sorted((tmp_path / "ck" / "step_10").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = torchrun([str(ROOT / "tests" / "exit_threads.py"), *BASE[2:], f"hydra.run.dir={tmp_path}/hydra",
                     "trainer.steps=20", f"trainer.checkpoint.dir={tmp_path}/ck"], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "terminate called" not in out and "Signal 6" not in out, out[-3000:]
    assert len(_error_lines(proc)) == 1 and "is corrupt" in _error_lines(proc)[0], out[-3000:]
    assert sorted(ln for ln in proc.stderr.splitlines() if "threads at exit" in ln) == [
        "rank 0 threads at exit: []", "rank 1 threads at exit: []"], out[-3000:]


def test_incompatible_checkpoint_fails_clearly(runs, tmp_path, single):
    src = runs[0]
    shutil.copytree(src / "ck_at_10", tmp_path / "ck")
    before = _tree(tmp_path / "ck")
    proc = single(["trainer.steps=20", f"trainer.checkpoint.dir={tmp_path}/ck",
                              "model.embedding_dim=4", "model.bottom_mlp=[16,4]"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = _error_lines(proc)
    assert len(lines) == 1 and "incompatible model" in lines[0] and "dim 8 there" in lines[0], lines
    assert _tree(tmp_path / "ck") == before


def test_sigkilled_rank_restarts_from_last_checkpoint(runs, tmp_path):
    a = runs[1]
    proc = torchrun(["--max-restarts=1", *faulty(BASE), f"hydra.run.dir={tmp_path}/hydra", "trainer.steps=20",
                     f"trainer.checkpoint.dir={tmp_path}/ck", "trainer.checkpoint.every=5"], cwd=tmp_path,
                    env={KILL_AT_STEP: "12"})
    s = _ok(proc)
    assert "SIGKILL rank 1 after step 12" in proc.stdout + proc.stderr
    assert s["steps"] == 20 and s["resumed_from_step"] == 10
    assert s["final_loss"] == a["final_loss"] and s["weights_sha256"] == a["weights_sha256"]


def _hashes(path):
    """Every byte of every checkpoint under `path`, as {relative path: sha256} (the lock file aside)."""
    import hashlib

    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".anyrec.lock"}


@pytest.mark.parametrize(("extra", "message"), [
    (["trainer.checkpoint.resume=false"], "already holds checkpoints (step_5, step_10) and "
                                          "trainer.checkpoint.resume=false"),
    (["optim.dense_lr=0.1"], "holds another run's checkpoints (step_5, step_10, run "),
    (["trainer.seed=3"], "trainer.seed 0 there, 3 here"),
])
def test_another_runs_checkpoints_are_kept_byte_for_byte(runs, tmp_path, extra, message, single):
    src = runs[0]
    shutil.copytree(src / "ck_at_10", tmp_path / "ck")
    before = _hashes(tmp_path / "ck")
    proc = single(["trainer.steps=12", f"trainer.checkpoint.dir={tmp_path}/ck",
                              "trainer.checkpoint.every=2", "trainer.checkpoint.keep=1", *extra])
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = _error_lines(proc)
    assert len(lines) == 1 and message in lines[0], proc.stderr[-3000:]
    assert _hashes(tmp_path / "ck") == before


def test_overwrite_replaces_another_run(runs, tmp_path, single):
    src = runs[0]
    shutil.copytree(src / "ck_at_10", tmp_path / "ck")
    s = _ok(single(["trainer.steps=4", f"trainer.checkpoint.dir={tmp_path}/ck",
                               "trainer.checkpoint.resume=false", "trainer.checkpoint.overwrite=true"]))
    assert s["resumed_from_step"] is None and s["steps"] == 4
    assert sorted(p.name for p in (tmp_path / "ck").glob("step_*")) == ["step_4"]


def test_resume_past_the_last_step_says_so(runs, tmp_path, single):
    shutil.copytree(runs[0] / "ck_at_10", tmp_path / "ck")
    proc = single(["trainer.steps=6", f"trainer.checkpoint.dir={tmp_path}/ck"])
    s = _ok(proc)
    assert s["steps"] == 10 and s["resumed_from_step"] == 10 and s["final_loss"] is None
    assert "resumed at step 10, past trainer.steps=6: no step to train" in proc.stdout + proc.stderr


def test_multirun_jobs_get_a_directory_each(tmp_path, single):
    proc = single(["trainer.steps=2,3", f"trainer.checkpoint.dir={tmp_path}/ck",
                              f"hydra.sweep.dir={tmp_path}/sweep"], flags=("-m",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert [s["steps"] for s in summaries] == [2, 3]
    assert all(s["resumed_from_step"] is None for s in summaries)  # job 1 did not take job 0's
    assert [s["checkpoint"] for s in summaries] == [f"{tmp_path}/ck/0/step_2", f"{tmp_path}/ck/1/step_3"]


def test_a_checkpoint_dir_that_is_a_file_fails_before_training(tmp_path, single):
    (tmp_path / "ck").write_text("x")
    proc = single(["trainer.steps=2", f"trainer.checkpoint.dir={tmp_path}/ck"])
    assert proc.returncode == 2
    assert _error_lines(proc) == [f"anyrec-train: error: trainer.checkpoint.dir {tmp_path}/ck is a file, "
                                  "not a folder"], proc.stderr[-3000:]
    assert "step 1" not in proc.stdout + proc.stderr
