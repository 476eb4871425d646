"""The console policy: what a job prints, and what only its per-rank log file keeps.

The console shows anyrec's INFO, everyone's warnings and errors, each message once per process (on ranks
other than 0, warnings and errors only); the log file keeps every record, libraries' INFO and anyrec's
DEBUG detail included. configs/hydra/job_logging/anyrec.yaml puts `ConsoleFilter` on the console."""

from __future__ import annotations

import logging
import os
import warnings

OWN = "anyrec"


class ConsoleFilter(logging.Filter):
    """Passes anyrec's INFO (rank 0 only) and everyone's WARNING and above, each message once."""

    def __init__(self) -> None:
        super().__init__()
        self.main = os.environ.get("RANK", "0") == "0"
        self.seen: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == OWN or record.name.startswith(f"{OWN}.")
        if record.levelno < (logging.INFO if own and self.main else logging.WARNING):
            return False
        key = hash((record.name, record.levelno, record.getMessage()))
        if key in self.seen:  # e.g. a library's warning at every module it builds: the file has each
            return False
        self.seen.add(key)
        return True


def capture_warnings() -> None:
    """Python warnings become one-line `py.warnings` log records: on the console once (ConsoleFilter),
    in the log file each time."""
    warnings.formatwarning = format_warning
    # Off, then on: logging keeps capturing "on" even after a warnings.catch_warnings() block restored
    # the original showwarning (its exit does not tell logging), and then on alone would not install it.
    logging.captureWarnings(False)
    logging.captureWarnings(True)


def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   line: str | None = None) -> str:
    """A warning in one line: where, its category, its text (not the source line that raised it)."""
    return f"{filename}:{lineno}: {category.__name__}: {message}"
