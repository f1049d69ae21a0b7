"""Run code as if a folder were on a read-only filesystem, even as root (root ignores permission
bits, so chmod -R a-w proves nothing there): an audit hook refuses with EROFS every call that
would create, change or remove something under the folder, and records it.

    python -c "import read_only_hook; read_only_hook.install(ROOT); ..."

(with tests/support/ on sys.path: PYTHONPATH).

refused() lists what was refused, as (event, path).
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_CHANGES = {
    "os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.chmod", "os.chown",
    "os.truncate", "os.utime", "os.link", "os.symlink", "shutil.rmtree",
}  # fmt: skip
_refused: list[tuple[str, str]] = []


def refused() -> list[tuple[str, str]]:
    return list(_refused)


def install(root: str) -> None:
    root = os.path.realpath(root) + os.sep

    def under_root(path: Any) -> str | None:
        if isinstance(path, int) or path is None:
            return None
        text = os.path.realpath(os.fsdecode(os.fspath(path)))
        return text if (text + os.sep).startswith(root) else None

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
        elif event in _CHANGES:
            path, writes = args[0], True
        else:
            return
        where = under_root(path) if writes else None
        if where is not None:
            _refused.append((event, where))
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), where)

    sys.addaudithook(hook)
