"""Waiting on what another thread or process does, by polling: a condition to become true
within a bound, a process group to be gone (as /proc shows it).

    wait_for(started.exists, 120, "the compiler to start")
    assert group_is_gone(pgid)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def group_is_gone(pgid: int) -> bool:
    """No live process is in the group (zombies count as gone: the machine's init may not reap
    the orphans it inherits)."""
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == pgid and fields[0] != "Z":  # state, ppid, pgrp, ...
            return False
    return True
