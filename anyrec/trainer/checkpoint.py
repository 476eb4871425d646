"""Checkpoints with torch.distributed.checkpoint (DCP): written atomically, found, checked, resharded.

Layout of `trainer.checkpoint.dir` (owned by one run lineage at a time, see lineage.py):

    step_<n>/                       a complete checkpoint: DCP files + meta.json
    step_<n>.tmp-<lineage>-<id>/    one being written: never read; removed if the save fails, or
                                    (left by a crash) by the lineage's next save
    .anyrec.lock                    held (flock) by rank 0 of the job writing the directory

Every rank writes its shards into the temporary directory; rank 0 adds `meta.json` (step, the model
signature, world size, file sizes and checksums, anyrec version) and, after a barrier, renames the
directory to its final name, so a reader never sees half a checkpoint under a final name. Loading
checks the signature (tables, dense shapes, optimizer), the file sizes and SHA-256 checksums first, so
an incompatible or corrupt checkpoint fails with one clear line on every rank; DCP reshards
ShardedTensors when the world size or plan changed. Nothing in the directory is unpickled before its
checksum matched meta.json, and then only with a restricted unpickler (dcp_reader.py). Checksums detect
damage, not forgery: with a signing key (anyrec.signing) meta.json is signed too, and an unsigned or
foreign one is refused. Beside the model and optimizers, a checkpoint holds
the trainer's own state (`TrainerState`, a torch.distributed.checkpoint `Stateful`) under `trainer`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

import anyrec
from anyrec.config import CheckpointConfig
from anyrec.io_checks import open_nofollow
from anyrec.runtime.distributed import DistInfo, broadcast_from_main, gather_objects
from anyrec.runtime.errors import CheckpointError
from anyrec.signing import SignatureError, SigningKey, warn_unkeyed
from anyrec.trainer.dcp_reader import SafeLoadPlanner, SafeReader
from anyrec.trainer.lineage import META, DirLock, RunIdentity, decide_start, read_meta_file, scan

logger = logging.getLogger(__name__)

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shard files


def _agree(error: str | None, info: DistInfo) -> None:
    """Collective: if any rank had an error, every rank raises the first one (nobody waits alone)."""
    first = next((e for e in gather_objects(error, info) if e), None)
    if first:
        raise CheckpointError(first)


def describe_error(e: BaseException) -> str:
    """One line for a failed checkpoint read or write: DCP wraps every rank's error, keep the cause."""
    failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if isinstance(failures, dict) and failures:
        rank, (cause, _) = sorted(failures.items(), key=lambda kv: kv[0])[0]
        return f"rank {rank}: {describe_error(cause)}"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}{f' ({e.filename})' if e.filename else ''}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


@contextmanager
def _dcp_errors(what: str) -> Iterator[None]:
    """A DCP failure as one CheckpointError line `what: cause` (DCP's CheckpointException, raised on
    every rank, is a BaseException: an interrupt or exit still passes)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise CheckpointError(f"{what}: {describe_error(e)}") from None


def _file_sizes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file() and p.name != META}


def _sha256s(path: Path, names: list[str], info: DistInfo) -> dict[str, str]:
    """SHA-256 of the files `names` in `path`, each rank hashing a share (a collective)."""
    mine = {}
    for name in sorted(names)[info.rank::info.world_size]:
        with (path / name).open("rb") as f:
            mine[name] = hashlib.file_digest(f, "sha256").hexdigest()
    return {k: v for part in gather_objects(mine, info) for k, v in part.items()}


def _dcp_metadata(path: Path) -> Any:
    """DCP's metadata of checkpoint `path` (CheckpointError in one line if missing or unreadable)."""
    with _dcp_errors(f"checkpoint {path} is corrupt or unreadable: {DCP_METADATA}"):
        return SafeReader(str(path)).read_metadata()


def _shard_files(path: Path) -> set[str]:
    """The files DCP's metadata of checkpoint `path` says hold its tensors."""
    return {info.relative_path for info in (_dcp_metadata(path).storage_data or {}).values()}


def signature_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why a checkpoint with signature `saved` cannot be loaded into a model with `current`, or None."""
    if saved.get("optimizer") != current.get("optimizer"):
        return f"optimizer {saved.get('optimizer')!r} there, {current.get('optimizer')!r} here"
    st, ct = saved.get("tables", {}), current.get("tables", {})
    if set(st) != set(ct):
        return f"{len(st)} tables there, {len(ct)} here"
    for name in ct:
        if st[name] != ct[name]:
            return (f"table {name} is {st[name][0]} rows x dim {st[name][1]} there, "
                    f"{ct[name][0]} x {ct[name][1]} here")
    sd, cd = saved.get("dense", {}), current.get("dense", {})
    for name in sorted(set(sd) | set(cd)):
        if sd.get(name) != cd.get(name):
            return f"dense parameter {name} has shape {sd.get(name)} there, {cd.get(name)} here"
    return None


@dataclass
class TrainerState(Stateful):
    """The Trainer's own state, each value stored once: steps done (also the data position: every
    source's batch(step) is a pure function of it), batches skipped for a non-finite loss, and this
    rank's RNG (`rng.rank<r>`, so a run at another world size finds its own or none)."""

    rank: int
    step: int = 0
    skipped_batches: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step, dtype=torch.int64),
                "skipped_batches": torch.tensor(self.skipped_batches, dtype=torch.int64),
                "rng": {f"rank{self.rank}": torch.get_rng_state()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved; a state without this rank's RNG keeps the current one."""
        self.step, self.skipped_batches = int(state["step"]), int(state["skipped_batches"])
        rng = state.get("rng", {}).get(f"rank{self.rank}")
        if rng is not None:
            torch.set_rng_state(rng)


# Checkpoints of anyrec 0.1.0 kept the step twice, as `progress` = [step, data step, skipped] beside a
# top-level `rng`. Read for one release (until 0.3.0), never written.
LEGACY_PROGRESS = "progress"


def legacy_template(state: TrainerState) -> dict[str, Any]:
    """What a 0.1.0 checkpoint holds of the trainer's state, shaped for DCP to load into."""
    return {LEGACY_PROGRESS: torch.zeros(3, dtype=torch.int64), "rng": state.state_dict()["rng"]}


def from_legacy(saved: dict[str, Any]) -> dict[str, Any]:
    """A 0.1.0 checkpoint's trainer state as `TrainerState.load_state_dict` takes it."""
    step, data_step, skipped = (int(x) for x in saved[LEGACY_PROGRESS])
    if step != data_step:
        raise CheckpointError(f"checkpoint is corrupt: its step ({step}) and data position ({data_step}) "
                              "differ")
    return {"step": step, "skipped_batches": skipped, **({"rng": saved["rng"]} if "rng" in saved else {})}


class CheckpointManager:
    """Saves and finds the checkpoints of one run directory (collective: every rank calls each method).
    `identity` is the run's settings (lineage.identity_config); with `signing_key`, meta.json is signed
    when written and its signature checked when read."""

    def __init__(self, cfg: CheckpointConfig, signature: dict[str, Any], info: DistInfo,
                 identity: dict[str, Any] | None = None, signing_key: SigningKey | None = None) -> None:
        self.cfg, self.root, self.signature, self.info = cfg, Path(cfg.dir), signature, info
        self.is_main = info.is_main
        self.identity = identity or {}
        self.signing_key = signing_key
        self.run: RunIdentity | None = None  # set by start()
        self._replace: tuple[str, ...] = ()
        self._lock: DirLock | None = None

    def start(self) -> Path | None:
        """Lock the directory (rank 0) and decide where this run starts: the checkpoint to load or None.
        Raises CheckpointError on every rank when the directory is in use or holds another run."""
        decision: Any = None  # (lineage.Start, run id), or an error
        if self.is_main:
            try:
                # this launch: torchrun's run id (shared by its ranks and restarts), else a fresh one
                run_id = os.environ.get("TORCHELASTIC_RUN_ID") or f"local-{uuid.uuid4().hex[:12]}"
                self.root.mkdir(parents=True, exist_ok=True)
                self._lock = DirLock(self.root, run_id)
                decision = (decide_start(self.root, self.cfg, self.identity,
                                         lambda saved: signature_mismatch(saved, self.signature)), run_id)
            except CheckpointError as e:
                decision = str(e)
            except OSError as e:
                decision = f"trainer.checkpoint.dir {self.root}: {describe_error(e)}"
        decision = broadcast_from_main(decision, self.info)
        if isinstance(decision, str):
            self.close()
            raise CheckpointError(decision)
        start, run_id = decision
        self.run = RunIdentity(start.lineage, run_id, self.identity, start.parent)
        self._replace = start.replace
        if self.is_main:
            for line in start.skipped:
                logger.warning("%s", line)
        if self.is_main and start.replace:
            logger.warning("trainer.checkpoint.overwrite: %d checkpoint(s) in %s are deleted after this "
                           "run's first save", len(start.replace), self.root)
        return Path(start.load) if start.load else None

    def close(self) -> None:
        """Release the directory lock (the kernel does it too, however the process ends)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def save(self, step: int, state: dict[str, Any], extra_meta: dict[str, Any]) -> Path:
        """Write `state` as checkpoint `step_<step>` atomically (collective, after `start()`); a failure on
        any rank (a full disk, a permission error) is one CheckpointError on every rank."""
        token = broadcast_from_main(uuid.uuid4().hex[:12] if self.is_main else "", self.info)
        tmp = self.root / f"step_{step}{self._tmp_tag}{token}"
        final = self.root / f"step_{step}"
        try:
            self._write(step, state, extra_meta, tmp, final)
        except CheckpointError:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _write(self, step: int, state: dict[str, Any], extra_meta: dict[str, Any], tmp: Path,
               final: Path) -> None:
        where = f"checkpoint step_{step} could not be written to {self.root}"
        error = None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            error = f"{where}: {describe_error(e)}"
        _agree(error, self.info)
        with _dcp_errors(where):
            dcp.save(state, checkpoint_id=str(tmp))
        digests = _sha256s(tmp, list(_file_sizes(tmp)), self.info)
        error = None
        if self.is_main:
            try:
                self._publish(step, extra_meta, tmp, final, digests)
            except (OSError, CheckpointError) as e:
                error = f"{where}: {describe_error(e) if isinstance(e, OSError) else e}"
        error = broadcast_from_main(error, self.info)
        if error:
            raise CheckpointError(error)

    def _publish(self, step: int, extra_meta: dict[str, Any], tmp: Path, final: Path,
                 digests: dict[str, str]) -> None:
        """Rank 0: meta.json, the rename to the final name, then pruning."""
        meta = {"step": step, "signature": self.signature, "anyrec_version": anyrec.__version__,
                "files": _file_sizes(tmp), "sha256": digests, "saved_at": time.time(), **extra_meta,
                "run": self.run.to_meta()}
        if self.signing_key is not None:  # signed as it reads back (JSON: tuples become lists)
            meta = self.signing_key.signed(json.loads(json.dumps(meta)))
        with open_nofollow(tmp / META, "x") as f:  # a new file: never one planted in tmp
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # the same step saved again after a restart, or one being replaced
            owner = next((f.lineage for f in scan(self.root) if f.path == final), None)
            if owner != self.run.lineage and str(final) not in self._replace:
                raise CheckpointError(f"{final} belongs to another run")
            self._discard(final)
        os.replace(tmp, final)
        self._prune(keep_tmp=tmp.name)

    def _discard(self, path: Path) -> None:
        """Delete a checkpoint so that no final-named half of it can outlive a kill: renamed to a
        temporary name of this lineage first (atomic), which its next save removes if this one dies."""
        doomed = path.with_name(f"{path.name}{self._tmp_tag}deleting-{uuid.uuid4().hex[:6]}")
        try:
            os.replace(path, doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def _prune(self, keep_tmp: str) -> None:
        """Older checkpoints of this lineage beyond `keep`, its stale temporaries, and what it replaces."""
        mine = [f for f in scan(self.root) if f.lineage == self.run.lineage]
        for f in mine[:-self.cfg.keep]:
            self._discard(f.path)
        for p in self.root.glob("step_*.tmp-*"):
            if p.name != keep_tmp and (self._tmp_tag in p.name or self._replace):
                shutil.rmtree(p, ignore_errors=True)
        if self._replace:  # overwrite: the replaced run's checkpoints go once this one has saved
            for f in scan(self.root):
                if str(f.path) in self._replace and f.lineage != self.run.lineage:
                    self._discard(f.path)
            self._replace = ()

    @property
    def _tmp_tag(self) -> str:
        """What names this lineage's temporary directories: `step_<n>.tmp-<lineage>-...`."""
        return f".tmp-{self.run.lineage[:8]}-"

    def read_meta(self, path: Path) -> dict[str, Any]:
        """meta.json of a checkpoint, checked against the signing key, this model and the files on disk
        before anything in the directory is unpickled or loaded: every file it names exists with its
        size and SHA-256 (all of them with verify or a key, else DCP's index), and DCP's shard files
        are among them."""
        meta = read_meta_file(path)
        if self.signing_key is not None:
            try:
                self.signing_key.check(meta, f"checkpoint {path}: meta.json")
            except SignatureError as e:
                raise CheckpointError(str(e)) from None
        elif self.is_main:
            warn_unkeyed(f"checkpoint {path}")
        why = signature_mismatch(meta["signature"], self.signature)
        if why:
            raise CheckpointError(f"checkpoint {path} is from an incompatible model: {why}")
        files = meta.get("files")
        if not isinstance(files, dict) or DCP_METADATA not in files:
            raise CheckpointError(f"checkpoint {path} is corrupt or incomplete: meta.json does not list "
                                  f"DCP's {DCP_METADATA}")
        for name, size in files.items():
            if not isinstance(name, str) or "/" in name or name in ("", ".", "..") or name == META:
                raise CheckpointError(f"checkpoint {path} is corrupt: meta.json lists {name!r}, not a file "
                                      "of the checkpoint")
            f = path / name
            if not f.is_file() or f.stat().st_size != size:
                have = f.stat().st_size if f.is_file() else "missing"
                raise CheckpointError(f"checkpoint {path} is corrupt: {name} is {have} bytes, "
                                      f"{size} were written")
        verify_all = self.cfg.verify or self.signing_key is not None
        sums = meta.get("sha256")
        covered = isinstance(sums, dict) and (set(sums) == set(files) if verify_all else DCP_METADATA in sums)
        if not covered:
            raise CheckpointError(f"checkpoint {path} is corrupt or incomplete: meta.json's checksums "
                                  f"do not cover the files it lists")
        if not verify_all and self.is_main:
            logger.warning("checkpoint %s is loaded unverified: the checksums of its shard files are not "
                           "checked (trainer.checkpoint.verify=false)", path)
        elif not self.cfg.verify and self.is_main:
            logger.warning("trainer.checkpoint.verify=false is ignored: with a signing key (%s) every "
                           "file of a checkpoint is checked", self.signing_key.source)
        checked = sorted(sums) if verify_all else [DCP_METADATA]
        digests = _sha256s(path, checked, self.info)
        bad = [n for n in checked if digests[n] != sums[n]]
        if bad:
            raise CheckpointError(f"checkpoint {path} is corrupt: checksum mismatch in "
                                  f"{', '.join(sorted(bad))}")
        unlisted = sorted(_shard_files(path) - set(files))  # DCP's index: checked above, unpickled now
        if unlisted:
            raise CheckpointError(f"checkpoint {path} is corrupt or incomplete: DCP's {DCP_METADATA} names "
                                  f"{', '.join(unlisted[:3])}, which meta.json does not list")
        return meta

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """Fill `state` in place from checkpoint `path`, checked by `read_meta` first (collective; DCP
        reshards as needed; nothing is unpickled unrestricted)."""
        with _dcp_errors(f"checkpoint {path} is corrupt or unreadable"):
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())

    def saved_keys(self, path: Path) -> set[str]:
        """Flattened keys stored in a checkpoint (to load only what it has, e.g. per-rank RNG)."""
        return set(_dcp_metadata(path).state_dict_metadata)
