"""Checkpoint directories are owned by one run lineage: resumed only by it (or when named explicitly),
never pruned, overwritten or written concurrently by another run, and a failed save leaves nothing.

One process and a small tensor state (DCP needs no process group for one rank); the multi-rank
paths run in tests/test_checkpoint.py and tests/test_shutdown.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from anyrec.config import CheckpointConfig
from anyrec.runtime.distributed import ONE_PROCESS
from anyrec.runtime.errors import CheckpointError
from anyrec.trainer.checkpoint import CheckpointManager

from .conftest import ROOT

SIG = {"tables": {"t0": [10, 4]}, "dense": {"w": [8]}, "optimizer": "adagrad"}
RUN_A = {"optim.dense_lr": 0.05, "model.embedding_dim": 4, "trainer.seed": 0}
RUN_B = {**RUN_A, "optim.dense_lr": 0.1}


def _manager(root, identity=RUN_A, **cfg):
    return CheckpointManager(CheckpointConfig(dir=str(root), **cfg), SIG, ONE_PROCESS, identity)


def _state(value: float) -> dict:
    return {"w": torch.full((8,), value), "t0": torch.full((10, 4), value)}


def _train(root, steps, identity=RUN_A, **cfg):
    """A fake run: start, 'resume' (read the step back), save at each of `steps`; returns the start."""
    m = _manager(root, identity, **cfg)
    start = m.start()
    for step in steps:
        m.save(step, _state(float(step)), {})
    m.close()
    return start


def _hashes(root):
    """Every byte under `root` (lock file aside), as {relative path: sha256}."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".anyrec.lock"}


def _meta(path):
    return json.loads((path / "meta.json").read_text())


def test_meta_records_the_run_and_the_same_settings_resume(tmp_path):
    root = tmp_path / "ck"
    assert _train(root, [5, 10]) is None
    meta = _meta(root / "step_10")
    run = meta["run"]
    assert run["config"] == RUN_A and len(run["fingerprint"]) == 16 and run["run_id"]
    assert _meta(root / "step_5")["run"]["lineage"] == run["lineage"]
    # A second launch with the same settings continues the lineage from its newest checkpoint.
    m = _manager(root)
    assert m.start() == root / "step_10"
    m.save(15, _state(15.0), {})
    assert _meta(root / "step_15")["run"]["lineage"] == run["lineage"]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_10", "step_15"]  # keep=2, own lineage


def test_other_settings_do_not_resume_another_run(tmp_path):
    root = tmp_path / "ck"
    _train(root, [5, 10, 20])
    before = _hashes(root)
    with pytest.raises(CheckpointError) as e:
        _train(root, [5, 10], identity=RUN_B)
    msg = str(e.value)
    assert "holds another run's checkpoints" in msg and "optim.dense_lr 0.05 there, 0.1 here" in msg
    assert "\n" not in msg
    assert _hashes(root) == before


def test_resume_false_refuses_a_directory_with_checkpoints(tmp_path):
    root = tmp_path / "ck"
    _train(root, [5, 10, 20])
    before = _hashes(root)
    with pytest.raises(CheckpointError, match="resume=false.*overwrite=true"):
        _train(root, [5, 10], resume=False)
    assert _hashes(root) == before


def test_overwrite_replaces_the_other_run_only_after_saving(tmp_path):
    root = tmp_path / "ck"
    _train(root, [5, 10, 20])
    old = _meta(root / "step_20")["run"]["lineage"]
    m = _manager(root, RUN_B, resume=False, overwrite=True)
    assert m.start() is None
    assert (root / "step_20").is_dir()  # nothing deleted before this run has a checkpoint
    m.save(5, _state(-5.0), {})
    m.close()
    assert sorted(p.name for p in root.glob("step_*")) == ["step_5"]
    assert _meta(root / "step_5")["run"]["lineage"] != old


def test_pruning_keeps_another_runs_checkpoints(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _train(a, [1, 2, 3], keep=3)
    _train(b, [4], identity=RUN_B, keep=1)
    for name in ("step_1", "step_2", "step_3"):  # another run's checkpoints copied in
        os.rename(a / name, b / name)
    before = _hashes(b)
    other = {k: v for k, v in before.items() if not k.startswith("step_4/")}
    assert _train(b, [5, 6, 7], identity=RUN_B, keep=1) == b / "step_4"  # own lineage, not step_3
    after = _hashes(b)
    assert {k: v for k, v in after.items() if k in other} == other
    assert sorted(p.name for p in b.glob("step_*")) == ["step_1", "step_2", "step_3", "step_7"]


def test_resume_from_names_a_compatible_checkpoint(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _train(a, [5, 10])
    before = _hashes(a)
    m = _manager(b, RUN_B, resume_from=str(a))
    assert m.start() == a / "step_10"
    m.save(15, _state(15.0), {})
    m.close()
    run = _meta(b / "step_15")["run"]
    assert run["parent"]["step"] == 10 and run["parent"]["path"] == str((a / "step_10").resolve())
    assert run["lineage"] != _meta(a / "step_10")["run"]["lineage"]
    assert _hashes(a) == before
    # A restart of that job resumes its own lineage, not the named checkpoint again.
    assert _train(b, [], RUN_B, resume_from=str(a)) == b / "step_15"
    # Into a directory that holds checkpoints: refused.
    with pytest.raises(CheckpointError, match="needs an empty directory"):
        _train(a, [], RUN_B, resume_from=str(b))
    assert _hashes(a) == before


def test_checkpoints_without_identity_are_not_resumed_silently(tmp_path):
    root = tmp_path / "ck"
    _train(root, [5])
    meta = _meta(root / "step_5")
    del meta["run"]
    (root / "step_5" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="no run identity.*resume_from="):
        _train(root, [10])


def test_incompatible_model_is_named(tmp_path):
    root = tmp_path / "ck"
    _train(root, [5])
    m = CheckpointManager(CheckpointConfig(dir=str(root)), {**SIG, "tables": {"t0": [10, 8]}}, ONE_PROCESS,
                          RUN_B)
    with pytest.raises(CheckpointError, match="incompatible model: table t0 is 10 rows x dim 4 there"):
        m.start()


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.integration
def test_a_locked_directory_is_refused_and_a_killed_holder_frees_it(tmp_path):
    root = tmp_path / "ck"
    m = _manager(root)
    m.start()
    proc = _python(f"""
        from tests.test_checkpoint_ownership import _train
        from anyrec.runtime.errors import CheckpointError
        try:
            _train({str(root)!r}, [1])
        except CheckpointError as e:
            print(e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert f"is in use by another job (pid {os.getpid()} on" in proc.stdout
    assert not list(root.glob("step_*"))
    m.close()
    # A holder killed with SIGKILL (no cleanup at all) leaves the directory free.
    proc = _python(f"""
        import os, signal
        from tests.test_checkpoint_ownership import _manager
        _manager({str(root)!r}).start()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert proc.returncode == -9
    assert _train(root, [1]) is None


@pytest.mark.integration
def test_a_failed_save_is_one_line_and_leaves_no_temporary(tmp_path):
    # A real write failure: the file size limit (EFBIG) stands in for a full disk.
    root = tmp_path / "ck"
    proc = _python(f"""
        import resource, signal
        from tests.test_checkpoint_ownership import _manager, _state
        from anyrec.runtime.errors import CheckpointError
        import torch
        m = _manager({str(root)!r})
        m.start()
        m.save(1, _state(1.0), {{}})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
        try:
            m.save(2, {{"w": torch.zeros(100_000)}}, {{}})
        except CheckpointError as e:
            print("ERROR", e)
    """)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR")]
    assert len(lines) == 1 and "checkpoint step_2 could not be written" in lines[0], proc.stdout
    assert "File too large" in lines[0]
    assert sorted(p.name for p in root.iterdir() if p.name != ".anyrec.lock") == ["step_1"]


def test_a_corrupt_checkpoint_load_is_one_line(tmp_path):
    root = tmp_path / "ck"
    _train(root, [1])
    (root / "step_1" / ".metadata").write_bytes(b"garbage")
    m = _manager(root)
    with pytest.raises(CheckpointError) as e:
        m.load(root / "step_1", _state(0.0))
    assert "is corrupt or unreadable: rank 0:" in str(e.value) and "\n" not in str(e.value)


def _edit_meta(path, edit):
    meta = _meta(path)
    edit(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def test_metadata_removed_and_meta_edited_to_match_is_refused_before_loading(tmp_path):
    root = tmp_path / "ck"
    _train(root, [1])
    ck = root / "step_1"
    (ck / ".metadata").unlink()

    def drop(meta):
        meta["files"].pop(".metadata")
        meta["sha256"].pop(".metadata")

    _edit_meta(ck, drop)
    with pytest.raises(CheckpointError) as e:
        _manager(root).read_meta(ck)
    assert str(e.value) == (f"checkpoint {ck} is corrupt or incomplete: meta.json does not list "
                            "DCP's .metadata")


def test_a_shard_missing_from_meta_is_refused_before_loading(tmp_path):
    root = tmp_path / "ck"
    _train(root, [1])
    ck = root / "step_1"
    shard = sorted(ck.glob("*.distcp"))[0]
    shard.unlink()

    def drop(meta):
        meta["files"].pop(shard.name)
        meta["sha256"].pop(shard.name)

    _edit_meta(ck, drop)
    with pytest.raises(CheckpointError, match=f"names {shard.name}, which meta.json does not list"):
        _manager(root, verify=False).read_meta(ck)


def test_checksums_must_cover_every_listed_file(tmp_path):
    root = tmp_path / "ck"
    _train(root, [1])
    ck = root / "step_1"
    shard = sorted(ck.glob("*.distcp"))[0]
    _edit_meta(ck, lambda meta: meta["sha256"].pop(shard.name))
    with pytest.raises(CheckpointError, match="checksums do not cover the files it lists"):
        _manager(root).read_meta(ck)


def test_an_unverified_resume_says_so_in_one_line(tmp_path, caplog):
    root = tmp_path / "ck"
    _train(root, [1])
    ck = root / "step_1"
    with caplog.at_level("WARNING", logger="anyrec.trainer.checkpoint"):
        _manager(root, verify=False).read_meta(ck)
        _manager(root).read_meta(ck)
    lines = [r.getMessage() for r in caplog.records if r.name == "anyrec.trainer.checkpoint"]
    assert lines == [f"checkpoint {ck} is loaded unverified: the checksums of its shard files are not "
                     "checked (trainer.checkpoint.verify=false)"]


def test_unreadable_dcp_metadata_is_one_line_everywhere_it_is_read(tmp_path):
    root = tmp_path / "ck"
    _train(root, [1])
    ck = root / "step_1"
    (ck / ".metadata").write_bytes(b"garbage")
    m = _manager(root, verify=False)
    digest = hashlib.sha256(b"garbage").hexdigest()  # damage with matching checksums: the index itself
    _edit_meta(ck, lambda meta: (meta["files"].update({".metadata": 7}),
                                 meta["sha256"].update({".metadata": digest})))
    for read in (m.read_meta, m.saved_keys):
        with pytest.raises(CheckpointError, match=r"is corrupt or unreadable: \.metadata: ") as e:
            read(ck)
        assert "\n" not in str(e.value)


def test_a_kill_while_pruning_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    from anyrec.trainer import checkpoint

    root = tmp_path / "ck"
    m = _manager(root, keep=1)
    m.start()
    m.save(1, _state(1.0), {})

    def killed_midway(path, ignore_errors=False):  # the process dies after deleting one file
        first = sorted(p.path for p in os.scandir(path) if p.is_file())[0]
        os.unlink(first)
        raise SystemExit(137)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_midway)
    with pytest.raises(SystemExit):
        m.save(2, _state(2.0), {})  # pruning step_1 dies half-way
    monkeypatch.undo()
    finals = sorted(p.name for p in root.glob("step_*") if ".tmp-" not in p.name)
    assert finals == ["step_2"]  # no final-named remains of step_1
    m.save(3, _state(3.0), {})  # the lineage's next save removes the temporary
    assert sorted(p.name for p in root.iterdir() if p.name != ".anyrec.lock") == ["step_3"]
    m.close()
