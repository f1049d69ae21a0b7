"""What a shoal cache folder holds, and removing what nothing will load again (the data of
`python -m shoal cache list | size | clean`, api/cache_command.py).

    <cache_dir>/<stem>-<key>/            a converted model (model_cache.py's marker)
    <cache_dir>/kernels/<name>_<key>/    a kernel build (kernel_build.py's marker)
    .<name>.tmp-<pid>-<hex>/             a private folder: being written, or its writer died
    .<name>.lock                         a lock file (cache_files.py): present while held
    anything else                        "other": listed, never removed

An entry is stale, with the reason, when no start would load it again:
    temporary   its writer is gone (its lock is free)
    lock        nobody holds it
    model       no marker (half-written by an older version), its source file is gone, or it
                is not what that file converts to now (model_cache.supersedes: the file
                changed, or an older converter made it)
    kernels     incomplete (a library or marker missing; a build folder of an older shoal, which
                had no key), built for a torch installation that is gone, or built for this
                environment's torch under another key (the sources or flags changed since)
Kernel builds of other environments that still exist are kept: removing them would make the
environments take turns rebuilding. Nothing busy (its lock held: being written or read) is
removed, stale or not.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shoal.kernels import kernel_build
from shoal.kernels.cache_files import FolderLock, is_busy, owner_of, remove_folder
from shoal.loading import model_cache
from shoal.loading.gguf_convert import CONVERTER_VERSION


@dataclass(frozen=True)
class Environment:
    """What this process would load: the names of its kernel build folders, its torch."""

    kernel_folders: frozenset[str]
    torch_location: str


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    kind: str  # "model", "kernels", "temporary", "lock" or "other"
    size_bytes: int
    modified: float  # the newest mtime in it (seconds since the epoch)
    source: str  # what it was made from or by, for the listing
    complete: bool
    busy: bool  # its lock is held now: it is being written or read
    stale: str  # why no start would load it again; "" if one would


def inventory(cache_dir: Path, environment: Environment) -> list[CacheEntry]:
    """Every entry of `cache_dir` and its kernels/ folder. Reads only: creates no file."""
    entries: list[CacheEntry] = []
    for parent in (cache_dir, cache_dir / "kernels"):
        for path in _children(parent):
            if parent == cache_dir and path.name == "kernels" and path.is_dir():
                continue
            entries.append(_entry(path, parent == cache_dir, environment))
    return entries


def remove(entry: CacheEntry) -> bool:
    """Remove `entry` under its lock; False when it is busy now (left as it is)."""
    if entry.kind == "other":
        return False
    folder = owner_of(entry.path) if entry.kind in ("temporary", "lock") else entry.path
    if entry.kind == "lock":
        folder = entry.path.parent / entry.path.name[1:].removesuffix(".lock")
    lock = FolderLock.try_take(folder, exclusive=True)
    if lock is None:
        return False
    with lock:  # releasing it unlinks the lock file
        if entry.kind == "temporary":
            shutil.rmtree(entry.path, ignore_errors=True)
        elif entry.kind != "lock":
            remove_folder(entry.path)
    return True


def _children(parent: Path) -> Iterator[Path]:
    try:
        yield from sorted(parent.iterdir())
    except FileNotFoundError:
        return


def _entry(path: Path, in_root: bool, environment: Environment) -> CacheEntry:
    size, modified = _size_and_mtime(path)
    name = path.name
    if name.startswith(".") and ".tmp-" in name and path.is_dir():
        busy = is_busy(owner_of(path))
        pid = name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
        stale = "" if busy else "left by a process that died while writing it"
        return CacheEntry(path, "temporary", size, modified, f"pid {pid}", False, busy, stale)
    if name.startswith(".") and name.endswith(".lock") and path.is_file():
        folder = path.parent / name[1:].removesuffix(".lock")
        busy = is_busy(folder)
        return CacheEntry(path, "lock", size, modified, "", True, busy, "" if busy else "unheld")
    if not path.is_dir() or name.startswith("."):
        return CacheEntry(path, "other", size, modified, "", True, False, "")
    busy = is_busy(path)
    if in_root:
        return _model_entry(path, size, modified, busy)
    return _kernels_entry(path, size, modified, busy, environment)


def _model_entry(path: Path, size: int, modified: float, busy: bool) -> CacheEntry:
    marker = model_cache.read_marker(path)
    if marker is None:
        return CacheEntry(path, "model", size, modified, "", False, busy, "half-written")
    source = Path(str(marker.get("source", "")))
    stale = ""
    try:
        stat = source.stat()
    except OSError:
        stale = "its source file is gone"
    else:
        current = {
            "source": str(source.resolve()),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "converter_version": CONVERTER_VERSION,
        }
        if model_cache.supersedes(current, marker):
            stale = "superseded: its source changed since, or an older converter made it"
    return CacheEntry(path, "model", size, modified, str(source), True, busy, stale)


def _kernels_entry(
    path: Path, size: int, modified: float, busy: bool, environment: Environment
) -> CacheEntry:
    marker = kernel_build.read_marker(path)
    if marker is None or not kernel_build.is_built(path):
        why = "incomplete, or built by an older shoal"
        return CacheEntry(path, "kernels", size, modified, "", False, busy, why)
    location = str(marker.get("torch_location", ""))
    source = f"torch {marker.get('torch', '?')} at {location}, Python {marker.get('python', '?')}"
    stale = ""
    if path.name not in environment.kernel_folders:
        if location == environment.torch_location:
            stale = "superseded: sources, flags or versions changed since it was built"
        elif not Path(location).is_dir():
            stale = "built for a torch installation that is gone"
    return CacheEntry(path, "kernels", size, modified, source, True, busy, stale)


def _size_and_mtime(path: Path) -> tuple[int, float]:
    try:
        stat = path.lstat()
    except OSError:
        return 0, 0.0
    if not path.is_dir():
        return stat.st_size, stat.st_mtime
    size, newest = 0, stat.st_mtime
    for root, _, files in os.walk(path):
        for file in files:
            try:
                file_stat = os.lstat(os.path.join(root, file))
            except OSError:
                continue
            size += file_stat.st_size
            newest = max(newest, file_stat.st_mtime)
    return size, newest


def describe_age(modified: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(modified)) if modified else "?"
