"""Output paths checked before any work starts (a job whose results cannot be written fails in seconds),
and the one way anyrec writes a file: atomically (`atomic_write`, `write_yaml`).

Each check probes the path or its nearest existing folder by creating and removing a temporary file, so
permissions, read-only mounts and a file where a folder should be are found as the real write would.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import yaml


def _probe(folder: Path, what: str, path: Path) -> None:
    """Create and remove a file in the existing folder `folder` (the write the job will make)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".anyrec-probe-", dir=folder)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ValueError(f"{what} {path}: cannot write in {folder} ({reason})") from None


def _existing_ancestor(path: Path, what: str) -> Path:
    """The nearest folder above `path` that exists; a file on the way is an error."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{what} {path}: {parent} is a file, not a folder")
            return parent
    raise ValueError(f"{what} {path}: no existing folder above it")  # pragma: no cover (/ exists)


def writable_dir(path: str | os.PathLike | None, what: str) -> None:
    """A folder the job will create files in (created later if missing); None is not checked."""
    if path is None or str(path) == "":
        return
    p = Path(path).expanduser().absolute()
    if p.exists():
        if not p.is_dir():
            raise ValueError(f"{what} {p} is a file, not a folder")
        _probe(p, what, p)
    else:
        _probe(_existing_ancestor(p, what), what, p)


def writable_file(path: str | os.PathLike | None, what: str) -> None:
    """A file the job will write (replace if present); None is not checked."""
    if path is None or str(path) == "":
        return
    p = Path(path).expanduser().absolute()
    if p.is_dir():
        raise ValueError(f"{what} {p} is a folder, not a file")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{what} {p}: the file is not writable")
    _probe(_existing_ancestor(p, what), what, p)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a file that appears at `path` whole or not at all: a temporary file beside `path` (same
    filesystem: the rename is atomic) replaces it when the block ends, and is removed if it raises."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        # mkstemp creates the file 0600; give it the mode open() would (0666 less the umask).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_yaml(path: str | os.PathLike, data: dict, header: str = "") -> None:
    """`header` (comment lines) and `data` as YAML at `path`, in `data`'s order, whole or not at all."""
    with atomic_write(path) as f:
        f.write(header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False))
