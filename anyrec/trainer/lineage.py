"""Who owns a checkpoint directory: run identities, the directory lock, and where a run starts from.

A *lineage* is one training run across its launches: it starts empty (or from a checkpoint named
with `trainer.checkpoint.resume_from`) and continues whenever a launch with the same config resumes
it. Every checkpoint's meta.json records its lineage, the launch that wrote it (torchrun's run id)
and the settings that must match to resume it by default (model, data, optimizer, seed: not the
step count, logging, kernels or world size, which may change between launches).

Rules, decided by rank 0 while it holds the directory lock: resume=true resumes the newest checkpoint
of a lineage with the same settings (another lineage's checkpoints are an error naming the settings
that differ); resume=false (or resume_from) on a directory with checkpoints is refused unless
overwrite=true, which deletes the other checkpoints once this run has saved its first one; pruning
only ever deletes this lineage's checkpoints (and, when overwriting, the replaced ones).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anyrec.config import AnyrecConfig, CheckpointConfig
from anyrec.io_checks import LinkError, open_nofollow
from anyrec.runtime.errors import CheckpointError
from anyrec.safe_load import load_json

LOCK = ".anyrec.lock"
META = "meta.json"
_FINAL = re.compile(r"^step_(\d+)$")  # a complete checkpoint's directory
# Settings a run must share with a lineage to resume it without being told to (dotted prefixes).
IDENTITY_KEYS = ("model.", "data.name", "data.path", "data.train_files", "data.batch_size",
                 "data.global_batch_size", "data.hash_ids", "data.zipf_exponent", "data.signal_scale",
                 "data.id_range_scale", "optim.", "trainer.seed")


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix[:-1]: value}
    return {k: v for key, sub in value.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}


def identity_config(cfg: AnyrecConfig) -> dict[str, Any]:
    """The flattened settings (see IDENTITY_KEYS) a checkpoint's lineage must share to be resumed."""
    flat = _flatten(dataclasses.asdict(cfg))
    return {k: v for k, v in sorted(flat.items())
            if any(k.startswith(p) if p.endswith(".") else k == p for p in IDENTITY_KEYS)}


def fingerprint(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_diff(there: dict[str, Any], here: dict[str, Any], limit: int = 3) -> str:
    """The first few settings that differ, as `key X there, Y here`."""
    keys = [k for k in sorted(set(there) | set(here)) if there.get(k) != here.get(k)]
    parts = [f"{k} {there.get(k, '<unset>')!r} there, {here.get(k, '<unset>')!r} here" for k in keys[:limit]]
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return "; ".join(parts) + more


@dataclass(frozen=True)
class RunIdentity:
    """The lineage a run writes, the launch writing it and the settings that identify it."""

    lineage: str
    run_id: str
    config: dict[str, Any]
    parent: dict[str, Any] | None = None  # the checkpoint a resume_from lineage started from

    def to_meta(self) -> dict[str, Any]:
        meta = {"lineage": self.lineage, "run_id": self.run_id, "fingerprint": fingerprint(self.config),
                "config": self.config}
        return {**meta, "parent": self.parent} if self.parent else meta


@dataclass(frozen=True)
class Found:
    """A complete checkpoint in the directory: its step, path and meta.json (None if unreadable)."""

    step: int
    path: Path
    meta: dict[str, Any] | None
    problem: str | None = None  # why meta.json is unreadable, where it is

    @property
    def run(self) -> dict[str, Any] | None:
        run = (self.meta or {}).get("run")
        return run if isinstance(run, dict) and isinstance(run.get("lineage"), str) else None

    @property
    def lineage(self) -> str | None:
        return self.run["lineage"] if self.run else None


@dataclass(frozen=True)
class Start:
    """Rank 0's decision, shared with every rank: what to load and which lineage to write."""

    load: str | None  # a checkpoint directory to load, or None (fresh start)
    lineage: str
    parent: dict[str, Any] | None = None
    replace: tuple[str, ...] = ()  # other checkpoints this run deletes after its first save
    skipped: tuple[str, ...] = ()  # one line per damaged newer checkpoint passed over (and moved aside)


def scan(root: Path) -> list[Found]:
    """The complete checkpoints in `root`, by step."""
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        m = _FINAL.match(p.name)
        if m and p.is_dir():
            problem = None
            try:
                meta = load_json(p / META, META)
            except ValueError as e:
                meta, problem = None, str(e)
            if meta is not None and not isinstance(meta, dict):
                meta, problem = None, f"{META} is not a JSON object"
            found.append(Found(int(m.group(1)), p, meta, problem))
    return sorted(found, key=lambda f: f.step)


def _saved_at(found: Found) -> float:
    """When a checkpoint was saved, by its meta.json (read before it is verified: a number or 0)."""
    t = (found.meta or {}).get("saved_at")
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else 0.0


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _names(found: list[Found]) -> str:
    names = [f.path.name for f in found]
    return ", ".join(names) if len(names) <= 4 else f"{names[0]} .. {names[-1]} ({len(names)})"


def decide_start(root: Path, cfg: CheckpointConfig, config: dict[str, Any], signature_why) -> Start:
    """Where a run with settings `config` starts in `root`; CheckpointError if it may not.
    `signature_why(saved_signature)` says why a checkpoint's model cannot load here, or None."""
    found, mine_fp = scan(root), fingerprint(config)
    if cfg.resume:
        mine = [f for f in found if f.run and f.run.get("fingerprint") == mine_fp]
        if mine:  # this run's own lineage (newest written, should an overwrite have been cut short)
            lineage = max(mine, key=_saved_at).lineage
            newest = [f for f in mine if f.lineage == lineage][-1]
            damaged = [f for f in found if f.meta is None and f.step > newest.step]
            return Start(str(newest.path), lineage, skipped=tuple(_set_aside(f, newest) for f in damaged))
    load, parent = None, None
    if cfg.resume_from:
        src = resolve_checkpoint(Path(cfg.resume_from).expanduser())
        meta = read_meta_file(src)
        run = meta.get("run") if isinstance(meta.get("run"), dict) else {}
        load = str(src)
        parent = {"path": str(src.resolve()), "step": meta["step"], "lineage": run.get("lineage")}
    if found and not cfg.overwrite:
        newest = found[-1]
        if cfg.resume_from:
            raise CheckpointError(
                f"trainer.checkpoint.dir {root} already holds checkpoints ({_names(found)}); a run "
                "started from trainer.checkpoint.resume_from needs an empty directory (or "
                "trainer.checkpoint.overwrite=true to replace them)")
        if not cfg.resume:
            raise CheckpointError(
                f"trainer.checkpoint.dir {root} already holds checkpoints ({_names(found)}) and "
                "trainer.checkpoint.resume=false: choose another directory, or set "
                "trainer.checkpoint.overwrite=true to replace them")
        if newest.meta is None:
            raise CheckpointError(f"checkpoint {newest.path} is corrupt or incomplete: unreadable meta.json "
                                  f"({newest.problem})")
        why = signature_why(newest.meta.get("signature", {}))
        if why:
            raise CheckpointError(f"checkpoint {newest.path} is from an incompatible model: {why}")
        if newest.run is None:
            raise CheckpointError(
                f"trainer.checkpoint.dir {root} holds checkpoints with no run identity ({_names(found)}, "
                "written by an older anyrec): start from one with trainer.checkpoint.resume_from="
                f"{newest.path} and another trainer.checkpoint.dir")
        raise CheckpointError(
            f"trainer.checkpoint.dir {root} holds another run's checkpoints ({_names(found)}, run "
            f"{newest.run.get('run_id')}) with different settings: "
            f"{config_diff(_dict(newest.run.get('config')), config)}; use another directory, or start "
            f"from it with trainer.checkpoint.resume_from={newest.path} in another directory")
    return Start(load, uuid.uuid4().hex[:16], parent, tuple(str(f.path) for f in found))


def _set_aside(damaged: Found, newest: Found) -> str:
    """Move a damaged checkpoint newer than the one resumed out of the way (renamed, never deleted: this
    run saves that step again) and say so in one line."""
    aside = damaged.path.with_name(f"{damaged.path.name}.damaged-{uuid.uuid4().hex[:6]}")
    try:
        os.replace(damaged.path, aside)  # renames the entry itself, link or not
        where = f"moved to {aside.name}"
    except OSError as e:
        where = f"left in place ({e.strerror})"
    return (f"checkpoint {damaged.path} is damaged and was skipped ({damaged.problem}; {where}): "
            f"resuming from the newest usable one, {newest.path}")


def read_meta_file(path: Path) -> dict[str, Any]:
    """A checkpoint's meta.json as a dict, or CheckpointError naming it."""
    try:
        meta = load_json(path / META, META)  # bounded: a forged one makes no unbounded work
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or incomplete: {e}") from None
    if not isinstance(meta, dict) or "step" not in meta or "signature" not in meta:
        raise CheckpointError(f"checkpoint {path} is corrupt or incomplete: unreadable meta.json "
                              "(missing fields)")
    step = meta["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint {path} is corrupt: meta.json's step is {step!r}, not a step")
    named = _FINAL.match(path.name)
    if named and int(named.group(1)) != step:
        raise CheckpointError(f"checkpoint {path} holds step {step} but is named {path.name}: refused (a "
                              f"renamed or misplaced checkpoint; name it step_{step} or resume from it "
                              "with trainer.checkpoint.resume_from and another trainer.checkpoint.dir)")
    return meta


def resolve_checkpoint(path: Path) -> Path:
    """`path` itself when it is a checkpoint, else the newest `step_<n>` in it."""
    if (path / META).is_file():
        return path
    found = scan(path)
    if not found:
        raise CheckpointError(f"trainer.checkpoint.resume_from {path}: no checkpoint there")
    return found[-1].path


class DirLock:
    """An exclusive lock on a checkpoint directory, held by one process of one job.

    `flock` on a file inside the directory: the kernel releases it when the holder exits, however
    it exits (SIGKILL included), so a crashed job never leaves the directory locked.
    """

    def __init__(self, root: Path, run_id: str) -> None:
        self.path = root / LOCK
        try:
            f = open_nofollow(self.path, "a+")
        except LinkError as e:
            raise CheckpointError(f"trainer.checkpoint.dir {root}: {e}") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise CheckpointError(f"trainer.checkpoint.dir {root} is in use by another job ({holder}); "
                                  "two jobs must not write one directory") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, run {run_id}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self._file: Any = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the lock
            self._file = None
