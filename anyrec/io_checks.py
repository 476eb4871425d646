"""Output paths checked before any work starts (a job whose results cannot be written fails in seconds),
and the ways anyrec writes a file, none of which follows a symbolic link planted at its path: atomically
(`atomic_write`, `write_yaml`: a new file renamed over the path), or opened with O_NOFOLLOW
(`open_nofollow`, `NoFollowFileHandler`: appends, the directory lock, log files), where a link is
refused in one line (`LinkError`).

Each check probes the path or its nearest existing folder by creating and removing a temporary file, so
permissions, read-only mounts and a file where a folder should be are found as the real write would.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
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


class LinkError(ValueError):
    """A path anyrec would write is a symbolic link (or not a regular file): refused, nothing written."""


# Modes `open_nofollow` takes: "x" creates a new file, "a"/"a+" append (creating), "w" truncates.
_FLAGS = {"x": os.O_WRONLY | os.O_CREAT | os.O_EXCL, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC}


def open_nofollow(path: str | os.PathLike, mode: str = "a", encoding: str | None = "utf-8") -> IO:
    """`open(path, mode)` for writing that refuses (LinkError) a symbolic link or a non-regular file
    (a FIFO, a device) at `path`, instead of writing through it. Modes: x, a, a+, w (text; "b" added
    for bytes, then `encoding` is ignored)."""
    binary = "b" in mode
    base = mode.replace("b", "")
    if base not in _FLAGS:
        raise ValueError(f"open_nofollow: mode {mode!r} is not one of {sorted(_FLAGS)} (b for bytes)")
    # O_NONBLOCK: a FIFO planted at the path fails here instead of blocking until someone reads it.
    flags = _FLAGS[base] | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags & ~os.O_TRUNC, 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK) or (e.errno == errno.EEXIST and os.path.islink(path)):
            raise LinkError(f"{path} is a symbolic link: anyrec does not write through links "
                            "(remove it, or write elsewhere)") from None
        if e.errno == errno.ENXIO:
            raise LinkError(f"{path} is not a regular file (a FIFO or socket): remove it") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LinkError(f"{path} is not a regular file: anyrec writes only regular files (remove it)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        if flags & os.O_TRUNC:  # only once the file is known to be a regular file of its own
            os.ftruncate(fd, 0)
        return os.fdopen(fd, mode if binary else base, encoding=None if binary else encoding)
    except BaseException:
        os.close(fd)
        raise


class NoFollowFileHandler(logging.FileHandler):
    """`logging.FileHandler` whose file is opened with `open_nofollow` (Hydra's per-rank log file)."""

    def _open(self):
        return open_nofollow(self.baseFilename, self.mode, self.encoding or "utf-8")
