"""`python tests/exit_threads.py ARGS`: `anyrec.train` with ARGS, and at interpreter exit one stderr line
naming anyrec's threads still alive (a thread left in C++ code while the interpreter finalizes aborts
the process: "terminate called without an active exception")."""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading

WATCHED = ("anyrec-heartbeat",)  # the launcher watch only sleeps in Python: harmless at exit


def _report() -> None:
    alive = sorted(t.name for t in threading.enumerate() if t.name in WATCHED and t.is_alive())
    sys.stderr.write(f"rank {os.environ.get('RANK', '0')} threads at exit: {alive}\n")


if __name__ == "__main__":
    atexit.register(_report)
    sys.argv = ["anyrec.train", *sys.argv[1:]]
    runpy.run_module("anyrec.train", run_name="__main__", alter_sys=True)
