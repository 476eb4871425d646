"""Errors the entry point turns into one `anyrec-train: error: ...` line and a non-zero exit (no torch
imports here, so `anyrec.train` names them cheaply)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from anyrec.io_checks import LinkError, open_nofollow


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf (raised on every rank at the same step)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: corrupt, incomplete, or from an incompatible model."""


class PeerLostError(RuntimeError):
    """Another rank stopped answering (gone, stopped or stuck): raised instead of waiting forever."""


def write_error_file(message: str) -> None:
    """Hand `message` to torchrun, which shows it in its root-cause report (TORCHELASTIC_ERROR_FILE is
    set for each worker by torchrun; without it there is nothing to do)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open_nofollow(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
    except (OSError, LinkError):
        pass  # the report then says "error_file: <N/A>"; the message is on stderr anyway


def say_line(line: str) -> None:
    """`line` and its newline on stderr in one write: the ranks of a job share their launcher's stderr,
    and two ranks saying their line at the same moment must not splice them (print's separate write of
    the newline let two lines run together)."""
    text = f"{line}\n"
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured): one write
        sys.stderr.write(text)
        sys.stderr.flush()
        return
    sys.stderr.flush()  # what the process wrote before comes first
    os.write(fd, text.encode(errors="replace"))


def exit_now(line: str, code: int) -> None:
    """Leave at once from any thread (a peer or the launcher is gone, so nothing is left to wait for):
    `line` as the one error line on stderr and in torchrun's report, no teardown, no stack dump."""
    message = f"anyrec-train: error: {line}"
    try:
        say_line(message)
        write_error_file(message)
    finally:
        os._exit(code)


def watch_launcher(poll_s: float = 0.25) -> None:
    """Under torchrun, from the worker's first moment: a thread that ends the worker in one line when
    its launcher dies (the worker is orphaned), also while it imports or waits for its peers, before
    the heartbeat (shutdown.Heartbeat) watches. A no-op without torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()

    def watch() -> None:
        while parent != 1 and os.getppid() == parent:
            time.sleep(poll_s)
        who = f"the launcher (pid {parent})" if parent != 1 else "the launcher"
        exit_now(f"rank {os.environ.get('RANK', '?')}: {who} is gone: exiting", 4)

    threading.Thread(target=watch, name="anyrec-launcher-watch", daemon=True).start()
