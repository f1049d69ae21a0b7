"""The kernel build's child process (kernel_build.py starts it in a process group of its own):

    python -m shoal.kernels.build_child REQUEST_JSON

runs torch's extension builder into the private folder the request names and exits 0, or
prints why not and exits 1. Not imported by the package (-m would run a second copy of it).

Stopping it: SIGTERM to its process group (this process and ninja). ninja puts each compile
job in a process group of its own and, on SIGTERM, passes it to each job's group and exits;
this process then kills whatever the builder left running (compile jobs orphaned by a ninja
that was SIGKILLed: a child subreaper, it inherits them) and exits. Its parent's death, a
SIGKILL included, sends it that SIGTERM (PR_SET_PDEATHSIG), so it never outlives the start.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    request: dict[str, Any] = json.loads(argv[0])
    signal.signal(signal.SIGTERM, _stop_group)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != request["parent_pid"]:  # it died before the prctl above
        return 1
    from torch.utils.cpp_extension import load  # imports setuptools: only here

    try:
        load(
            request["name"],
            sources=request["sources"],
            extra_cflags=request["cflags"],
            extra_ldflags=request["ldflags"],
            build_directory=request["folder"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # the builder raises whatever the compiler or ninja did
        print(error, file=sys.stderr)
        return 1
    finally:
        _kill_strays()
    return 0


def _stop_group(signum: int, frame: FrameType | None) -> None:
    """SIGTERM once to the whole group (ninja passes it on to its jobs); the builder's wait
    then ends with ninja's failure and main() returns."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)


def _kill_strays() -> None:
    """SIGKILL every child still running (orphaned compile jobs), with its process group."""
    for pid in _children():
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)


def _children() -> list[int]:
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        if int(fields[1]) == me:
            found.append(int(entry.name))
    return found


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
