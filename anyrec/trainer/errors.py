"""Errors the entry point turns into one `anyrec-train: error: ...` line and a non-zero exit.

Kept free of torch imports so `anyrec.train` can name them cheaply.
"""

from __future__ import annotations

import json
import os
import sys
import time


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf (raised on every rank at the same step)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: corrupt, incomplete, or from an incompatible model."""


class PeerLostError(RuntimeError):
    """Another rank stopped answering (gone, stopped or stuck): raised instead of waiting forever."""


def write_error_file(message: str) -> None:
    """Hand `message` to torchrun (its error file), which shows it in its root-cause report.

    torchrun (torch.distributed.elastic) sets TORCHELASTIC_ERROR_FILE for each worker; without it
    (no torchrun) there is nothing to do.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the report then says "error_file: <N/A>"; the message is on stderr anyway


def exit_now(line: str, code: int) -> None:
    """Leave at once from any thread (a peer or the launcher is gone, so nothing is left to wait for):
    `line` as the one error line on stderr and in torchrun's report, no teardown, no stack dump."""
    message = f"anyrec-train: error: {line}"
    try:
        print(message, file=sys.stderr, flush=True)
        write_error_file(message)
    finally:
        os._exit(code)
