"""anyrec.proc.run_session: output captured, and a timeout takes the whole session down."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from anyrec.proc import run_session

pytestmark = pytest.mark.integration  # every test here starts processes


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_output_and_merged_stderr():
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    got = run_session([sys.executable, "-c", code], 60)
    assert (got.returncode, got.stdout, got.stderr) == (3, "out\n", "err\n")
    merged = run_session([sys.executable, "-c", code], 60, merge_stderr=True)
    assert sorted(merged.stdout.split()) == ["err", "out"] and merged.stderr is None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_timeout_kills_the_children_of_the_child(tmp_path):
    """What torchrun leaves when only torchrun is killed: its workers. Here a child that starts a
    grandchild and both sleep (the grandchild holds none of the captured pipes, so nothing but the
    kill can end it); past the timeout neither runs."""
    pidfile = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    with pytest.raises(subprocess.TimeoutExpired):
        run_session([sys.executable, "-c", code], 3)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
