"""A checkpoint directory is untrusted input: nothing in it runs code, every file is checked against
meta.json before anything is unpickled, and with a signing key a forged meta.json is refused."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from anyrec.config import CheckpointConfig
from anyrec.runtime.distributed import ONE_PROCESS
from anyrec.runtime.errors import CheckpointError
from anyrec.signing import FIELD, SigningKey, resolve_key
from anyrec.trainer.checkpoint import CheckpointManager
from anyrec.trainer.dcp_reader import ALLOWED_GLOBALS, load_metadata

SIGNATURE = {"optimizer": "sgd", "tables": {"t0": [4, 2]}, "dense": {"w": [3]}}
KEY = SigningKey(b"0123456789abcdef0123", "test key")


def _state(scale: float = 1.0) -> dict:
    # a non-tensor entry ("groups") is stored as pickled bytes by DCP: read back with weights_only
    return {"w": torch.arange(3.0) * scale, "groups": [{"lr": 0.1 * scale, "name": "dense"}]}


def _manager(root: Path, key: SigningKey | None = None, **cfg) -> CheckpointManager:
    m = CheckpointManager(CheckpointConfig(dir=str(root), **cfg), SIGNATURE, ONE_PROCESS, {"seed": 0}, key)
    m.start()
    return m


def _saved(tmp_path, key: SigningKey | None = None) -> Path:
    m = _manager(tmp_path / "ck", key)
    path = m.save(3, _state(), {})
    m.close()
    return path


class _Marker:
    """Unpickled, it runs `touch <path>`: what a forged checkpoint index would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _recompute(path: Path, key: SigningKey | None = None) -> None:
    """What a forger with write access does: meta.json's sizes and checksums made to match (re-signed
    only when they hold the key)."""
    meta = json.loads((path / "meta.json").read_text())
    for name in meta["files"]:
        data = (path / name).read_bytes()
        meta["files"][name], meta["sha256"][name] = len(data), hashlib.sha256(data).hexdigest()
    if key is not None:
        meta = key.signed(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def _forge_index(path: Path, marker: Path) -> None:
    """A `.metadata` that runs code, padded to the real one's size (pickle ignores bytes after STOP)."""
    size = (path / ".metadata").stat().st_size
    evil = pickle.dumps(_Marker(marker))
    (path / ".metadata").write_bytes(evil + b"." * (size - len(evil)))


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_what_the_trainer_saves_loads_through_the_restricted_reader(tmp_path):
    path = _saved(tmp_path)
    with (path / ".metadata").open("rb") as f:
        assert load_metadata(f).state_dict_metadata  # every global it holds is admitted
    m = _manager(tmp_path / "ck")
    m.read_meta(path)
    state = _state(scale=0.0)
    m.load(path, state)
    assert torch.equal(state["w"], torch.arange(3.0)) and state["groups"] == [{"lr": 0.1, "name": "dense"}]
    assert m.saved_keys(path) >= {"w", "groups.0.lr", "groups.0.name"}
    m.close()


@pytest.mark.parametrize("recompute", [True, False], ids=["meta-recomputed", "meta-left-alone"])
@pytest.mark.parametrize("verify", [True, False])
def test_a_forged_index_never_runs(tmp_path, recompute, verify):
    """Whether meta.json was made to match or not, verify or not: refused in one line, no code ran."""
    path, marker = _saved(tmp_path), tmp_path / "pwned"
    _forge_index(path, marker)
    if recompute:
        _recompute(path)
    m = _manager(tmp_path / "ck", verify=verify)
    with pytest.raises(CheckpointError) as e:
        m.read_meta(path)
    line = _one_line(e)
    assert ("posix.system" in line) if recompute else ("checksum mismatch in .metadata" in line), line
    assert not marker.exists()


@pytest.mark.parametrize("call", ["load", "saved_keys"])
def test_the_loader_itself_unpickles_nothing_unrestricted(tmp_path, call):
    """Even called without read_meta first, DCP's load and the key listing use the restricted reader."""
    path, marker = _saved(tmp_path), tmp_path / "pwned"
    _forge_index(path, marker)
    m = _manager(tmp_path / "ck")
    with pytest.raises(CheckpointError) as e:
        m.load(path, _state()) if call == "load" else m.saved_keys(path)
    assert "posix.system" in _one_line(e) and not marker.exists()


def test_a_forged_non_tensor_entry_never_runs(tmp_path):
    """DCP's own planner reads non-tensor entries with torch.load(weights_only=False): ours does not."""
    path, marker = _saved(tmp_path), tmp_path / "pwned"
    shard = next(path.glob("*.distcp"))
    data = shard.read_bytes()
    with (path / ".metadata").open("rb") as f:
        md = load_metadata(f)
    info = next(md.storage_data[i] for i in md.storage_data if i.fqn.startswith("groups"))
    evil = pickle.dumps(_Marker(marker))
    assert len(evil) <= info.length
    evil = evil + b"." * (info.length - len(evil))  # STOP already ended the pickle; padding is ignored
    shard.write_bytes(data[:info.offset] + evil + data[info.offset + info.length:])
    _recompute(path)
    m = _manager(tmp_path / "ck")
    m.read_meta(path)  # checksums match: the forger recomputed them
    with pytest.raises(CheckpointError) as e:
        m.load(path, _state())
    assert "\n" not in str(e.value) and not marker.exists()


def test_the_allowed_globals_are_only_dcp_value_types():
    assert not {"builtins", "os", "posix", "subprocess"} & set(ALLOWED_GLOBALS)


def test_a_path_outside_the_checkpoint_is_refused(tmp_path):
    path = _saved(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"]["../../outside"] = 1
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="not a file of the checkpoint"):
        _manager(tmp_path / "ck").read_meta(path)


def test_a_signed_checkpoint_loads_and_a_forged_one_is_refused(tmp_path):
    path = _saved(tmp_path, KEY)
    assert FIELD in json.loads((path / "meta.json").read_text())
    m = _manager(tmp_path / "ck", KEY)
    m.read_meta(path)
    # tensors edited and re-saved, sizes and checksums recomputed: only the signature tells
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    _recompute(path)
    _manager(tmp_path / "ck2").read_meta(path)  # without a key: checksums detect damage, not forgery
    with pytest.raises(CheckpointError) as e:
        m.read_meta(path)
    assert "signature does not match" in _one_line(e)


def test_an_unsigned_checkpoint_is_refused_with_a_key(tmp_path):
    path = _saved(tmp_path)
    with pytest.raises(CheckpointError) as e:
        _manager(tmp_path / "ck", KEY).read_meta(path)
    assert "is not signed" in _one_line(e)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"step": 1, "signature": {}, "x": "'
                                  + "a" * (9 * 2**20) + '"}'], ids=["deep", "oversize"])
def test_an_unbounded_meta_json_is_refused_in_one_line(tmp_path, text):
    path = _saved(tmp_path)
    (path / "meta.json").write_text(text)
    with pytest.raises(CheckpointError) as e:
        _manager(tmp_path / "ck").read_meta(path)
    assert "meta.json" in _one_line(e)


def test_resume_from_a_forged_checkpoint_runs_nothing(tmp_path, train_here):
    """The documented resume_from path, end to end: one error line, exit 2, no marker. The forger here
    holds the per-user key too (the checkpoint is re-signed with it): the restricted reader still refuses
    to unpickle the index."""
    base = ["model=dlrm_tiny", "data.batch_size=32", "trainer.steps=2", "trainer.eval_steps=0",
            "trainer.progress=false", "trainer.tensorboard=false", "trainer.calibrate=never",
            f"hydra.run.dir={tmp_path}/hydra"]
    env = {"ANYREC_CACHE_DIR": str(tmp_path), "ANYREC_SIGNING_KEY": None}
    first = train_here([*base, f"trainer.checkpoint.dir={tmp_path}/a"], tmp_path, env)
    assert first.returncode == 0, first.stderr[-3000:]
    marker = tmp_path / "pwned"
    _forge_index(tmp_path / "a" / "step_2", marker)
    _recompute(tmp_path / "a" / "step_2", resolve_key(None, {"ANYREC_CACHE_DIR": str(tmp_path)}))
    for where in ([f"trainer.checkpoint.dir={tmp_path}/a"],
                  [f"trainer.checkpoint.dir={tmp_path}/b", f"trainer.checkpoint.resume_from={tmp_path}/a"]):
        proc = train_here([*base, "trainer.steps=4", *where], tmp_path, env)
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("anyrec-train: error:")]
        assert proc.returncode == 2 and len(lines) == 1 and "posix.system" in lines[0], proc.stderr[-3000:]
        assert not marker.exists()


@pytest.mark.parametrize("edit", [{"saved_at": "yesterday"}, {"run": {"lineage": 7, "fingerprint": "x"}},
                                  {"run": {"lineage": "l", "fingerprint": "x", "config": [1]}}])
def test_a_malformed_meta_json_is_one_line_when_choosing_where_to_start(tmp_path, edit):
    """decide_start reads meta.json before any checksum: odd field types are refusals, not tracebacks."""
    m = _manager(tmp_path / "ck")
    m.save(3, _state(), {})
    path = m.save(4, _state(), {})
    m.close()
    meta = json.loads((path / "meta.json").read_text())
    meta.update(edit)
    (path / "meta.json").write_text(json.dumps(meta))
    seed = 0 if "saved_at" in edit else 1  # its own run (two checkpoints to choose from), or another's
    m = CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ck")), SIGNATURE, ONE_PROCESS, {"seed": seed})
    try:
        m.start()  # its own run (resumed), or another run's settings (refused in one line)
    except CheckpointError as e:
        assert "\n" not in str(e)
    finally:
        m.close()


def test_a_signed_run_resumes_with_its_key_only(tmp_path, train_here):
    """anyrec-train as documented: ANYREC_SIGNING_KEY signs, the same key resumes, another is one line;
    an unusable key file fails in one line before any checkpoint is touched."""
    base = ["model=dlrm_tiny", "data.batch_size=32", "trainer.eval_steps=0", "trainer.progress=false",
            "trainer.tensorboard=false", "trainer.calibrate=never", f"hydra.run.dir={tmp_path}/hydra",
            f"trainer.checkpoint.dir={tmp_path}/ck"]
    env = {"ANYREC_CACHE_DIR": str(tmp_path), "ANYREC_SIGNING_KEY": "a-key-of-more-than-16-bytes"}

    def run(*extra, **env_changes):
        proc = train_here([*base, *extra], tmp_path, {**env, **env_changes})
        return proc, [ln for ln in proc.stderr.splitlines() if ln.startswith("anyrec-train: error:")]

    proc, _ = run("trainer.steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert FIELD in json.loads((tmp_path / "ck" / "step_2" / "meta.json").read_text())
    proc, lines = run("trainer.steps=3", ANYREC_SIGNING_KEY="another-key-of-16-bytes")
    assert proc.returncode == 2 and len(lines) == 1 and "signature does not match" in lines[0], proc.stderr
    (tmp_path / "short").write_text("short")
    proc, lines = run("trainer.steps=3", f"trainer.signing_key_file={tmp_path}/short")
    assert proc.returncode == 2 and len(lines) == 1 and "shorter than 16 bytes" in lines[0], proc.stderr
    proc, _ = run("trainer.steps=3")
    assert proc.returncode == 0 and "resumed_from_step\": 2" in proc.stdout, proc.stderr[-3000:]
