"""The console policy: what a job prints, and what only its per-rank log file keeps.

The console shows anyrec's INFO, everyone's warnings and errors, each message once per process; ranks other
than 0 add only their own anyrec warnings and everyone's errors (a library warns alike on every rank, as
every rank runs the same code: rank 0 shows it, each rank's file keeps it). The log file keeps every
record, libraries' INFO and anyrec's DEBUG detail included. A job run inside another (a calibration's
training points, the quick calibration inside a training job) logs as any job does, inside
`log_file_only()`: its INFO goes to the log file, its warnings still to the console. No logger's level is
changed to keep the console quiet, and every module logs under its own name. configs/hydra/job_logging/
anyrec.yaml puts `ConsoleFilter` on the console; `capture_warnings` routes Python warnings and torch's own
log (which prints to stderr through a handler of its own) through the same policy."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

OWN = "anyrec"
# Set inside log_file_only(). A context variable, not an argument: the filter is built by the logging
# config and sees only records; it is read in the context (thread) that logs.
_FILE_ONLY: ContextVar[bool] = ContextVar("anyrec_console_file_only", default=False)


@contextmanager
def log_file_only() -> Iterator[None]:
    """Inside: anyrec's INFO goes to the log file only (a job nested in another, whose set-up lines would
    bury the outer job's); warnings and errors show as ever."""
    token = _FILE_ONLY.set(True)
    try:
        yield
    finally:
        _FILE_ONLY.reset(token)


class ConsoleFilter(logging.Filter):
    """Passes anyrec's INFO (rank 0 only, outside log_file_only()), its warnings, and everyone's WARNING
    (rank 0) and ERROR and above, each message once."""

    def __init__(self) -> None:
        super().__init__()
        self.main = os.environ.get("RANK", "0") == "0"
        self.seen: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == OWN or record.name.startswith(f"{OWN}.")
        floor = logging.INFO if own and not _FILE_ONLY.get() else logging.WARNING
        if not self.main:
            floor = logging.WARNING if own else logging.ERROR
        if record.levelno < floor:
            return False
        key = hash((record.name, record.levelno, record.getMessage()))
        if key in self.seen:  # e.g. a library's warning at every module it builds: the file has each
            return False
        self.seen.add(key)
        return True


# Libraries that print their log records themselves instead of handing them to the root logger.
SELF_PRINTING = ("torch",)


def capture_warnings() -> None:
    """Python warnings become one-line `py.warnings` log records, and torch's own log records go to the
    root logger: on the console once (ConsoleFilter), in the log file each time."""
    for name in SELF_PRINTING:
        lib = logging.getLogger(name)
        lib.handlers.clear()  # torch's stderr handler (`[rank1]:W1205 ... file.py:56] text`)
        lib.propagate = True
    warnings.formatwarning = format_warning
    # Off, then on: logging keeps capturing "on" even after a warnings.catch_warnings() block restored
    # the original showwarning (its exit does not tell logging), and then on alone would not install it.
    logging.captureWarnings(False)
    logging.captureWarnings(True)


def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   line: str | None = None) -> str:
    """A warning in one line: where, its category, its text (not the source line that raised it)."""
    return f"{filename}:{lineno}: {category.__name__}: {message}"
