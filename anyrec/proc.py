"""Child jobs (torchrun and its workers) that a timeout takes down whole."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def run_session(cmd: list[str], timeout_s: float, *, env: dict[str, str] | None = None,
                cwd: Path | str | None = None, merge_stderr: bool = False) -> subprocess.CompletedProcess:
    """Run `cmd` in its own session and capture its output (stderr into stdout with `merge_stderr`).
    Past `timeout_s` every process of the session (a torchrun and its workers) is killed and
    subprocess.TimeoutExpired raised: killing torchrun alone would leave its workers running."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
