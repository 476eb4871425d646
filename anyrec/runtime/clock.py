"""When a job began, as its entry point reads it before anything heavy loads (no torch here)."""

from __future__ import annotations

import os
import time


def launch_started() -> float:
    """time.monotonic() when this job began: its launcher's start under torchrun, else this process's
    (an entry point's: what a user has waited since the command); now where /proc cannot tell."""
    pid = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
    now = time.monotonic()
    try:
        with open(f"/proc/{pid}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22 of proc(5): starttime
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return now
    return now - max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
