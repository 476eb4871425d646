"""Checkpoints with torch.distributed.checkpoint (DCP): written atomically, found, checked, resharded.

Layout of `trainer.checkpoint.dir`:

    step_<n>/            a complete checkpoint: DCP files (.metadata, __<rank>_0.distcp) + meta.json
    step_<n>.tmp-<id>/   one being written (or left by a crash): never read, removed by the next save

Every rank writes its shards into the temporary directory; rank 0 adds `meta.json` (step, the model
signature, world size, file sizes, anyrec version) and, after a barrier, renames the directory to
its final name, so a reader never sees half a checkpoint under a final name. The latest complete
checkpoint is the highest `step_<n>`. Loading checks the signature (tables, dense shapes, optimizer)
the file sizes and SHA-256 checksums first, so an incompatible or corrupt checkpoint fails with one
clear line on every rank;
DCP reshards ShardedTensors when the world size or plan changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import anyrec
from anyrec.config import CheckpointConfig
from anyrec.trainer.errors import CheckpointError

logger = logging.getLogger(__name__)

META = "meta.json"
_FINAL = re.compile(r"^step_(\d+)$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_str(value: str) -> str:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _file_sizes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file() and p.name != META}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather_dicts(local: dict[str, str]) -> dict[str, str]:
    rank, world = _world()
    if world == 1:
        return local
    parts: list[dict[str, str]] = [{} for _ in range(world)]
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


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


class CheckpointManager:
    """Saves and finds the checkpoints of one run directory."""

    def __init__(self, cfg: CheckpointConfig, signature: dict[str, Any], is_main: bool) -> None:
        if not cfg.dir:
            raise ValueError("CheckpointManager needs trainer.checkpoint.dir")
        if cfg.every < 0 or cfg.keep < 1:
            raise ValueError(f"trainer.checkpoint.every must be >= 0 and keep >= 1, got "
                             f"every={cfg.every}, keep={cfg.keep}")
        self.cfg, self.root, self.signature, self.is_main = cfg, Path(cfg.dir), signature, is_main

    def _complete(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _FINAL.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest final-named checkpoint directory (checked when loaded), or None."""
        found = self._complete()
        return found[-1][1] if found else None

    def save(self, step: int, state: dict[str, Any], extra_meta: dict[str, Any]) -> Path:
        """Write `state` as checkpoint `step_<step>` atomically (collective: every rank calls it)."""
        token = _broadcast_str(uuid.uuid4().hex[:12] if self.is_main else "")
        tmp = self.root / f"step_{step}.tmp-{token}"
        final = self.root / f"step_{step}"
        tmp.mkdir(parents=True, exist_ok=True)
        dcp.save(state, checkpoint_id=str(tmp))
        _barrier()  # every rank's shards are on disk
        # Checksums are spread over the ranks: each hashes a share of the files.
        rank, world = _world()
        names = sorted(_file_sizes(tmp))
        digests = _gather_dicts({n: _sha256(tmp / n) for n in names[rank::world]})
        if self.is_main:
            meta = {"step": step, "signature": self.signature, "anyrec_version": anyrec.__version__,
                    "files": _file_sizes(tmp), "sha256": digests, **extra_meta}
            with (tmp / META).open("w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():  # the same step saved again after a restart
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune(keep_tmp=tmp.name)
        _barrier()
        return final

    def _prune(self, keep_tmp: str) -> None:
        for _, path in self._complete()[:-self.cfg.keep]:
            shutil.rmtree(path, ignore_errors=True)
        for p in self.root.glob("step_*.tmp-*"):
            if p.name != keep_tmp:
                shutil.rmtree(p, ignore_errors=True)

    def read_meta(self, path: Path) -> dict[str, Any]:
        """meta.json of a checkpoint, checked against this model and the files on disk."""
        try:
            meta = json.loads((path / META).read_text(encoding="utf-8"))
            if not isinstance(meta, dict) or "step" not in meta or "signature" not in meta:
                raise ValueError("missing fields")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path} is corrupt or incomplete: unreadable {META} "
                                  f"({type(e).__name__}: {e})") from None
        why = signature_mismatch(meta["signature"], self.signature)
        if why:
            raise CheckpointError(f"checkpoint {path} is from an incompatible model: {why}")
        for name, size in meta.get("files", {}).items():
            f = path / name
            if not f.is_file() or f.stat().st_size != size:
                have = f.stat().st_size if f.is_file() else "missing"
                raise CheckpointError(f"checkpoint {path} is corrupt: {name} is {have} bytes, "
                                      f"{size} were written")
        if self.cfg.verify:
            rank, world = _world()
            names = sorted(meta.get("sha256", {}))
            bad = {n: "bad" for n in names[rank::world] if _sha256(path / n) != meta["sha256"][n]}
            bad = _gather_dicts(bad)
            if bad:
                raise CheckpointError(f"checkpoint {path} is corrupt: checksum mismatch in "
                                      f"{', '.join(sorted(bad))}")
        return meta

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """Fill `state` in place from checkpoint `path` (collective; DCP reshards as needed)."""
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:  # DCP wraps every rank's failure; keep the first line of the cause
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint {path} is corrupt or unreadable: {first[:300]}") from None

    def saved_keys(self, path: Path) -> set[str]:
        """Flattened keys stored in a checkpoint (to load only what it has, e.g. per-rank RNG)."""
        reader = dcp.FileSystemReader(str(path))
        return set(reader.read_metadata().state_dict_metadata)
