"""`benchmarks/scale_out.py`: a run cut by its timeout takes its ranks with it (a rank left running kept 53 GiB on an
H100 and put the next two runs out of memory)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from scale_out import _kill_group

# A launcher that starts a "rank" (a grandchild of the test) and waits on it, as `accelerate launch` does.
LAUNCHER = "import subprocess, sys, time; p = subprocess.Popen(['sleep', '120']); print(p.pid, flush=True); p.wait()"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) is not running
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_timed_out_launcher_is_killed_with_the_ranks_it_started():
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    rank = int(proc.stdout.readline())
    assert _alive(rank)
    _kill_group(proc)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(rank), "the launcher's child outlived the kill"
    _kill_group(proc)  # a second kill of a group that is gone is harmless
