"""What the model cache and the kernel build share: a lock per cache folder that only a live
process can hold, private folders published whole, and the sweep of the ones whose writer died.

    <parent>/
        <name>/                      a finished folder: it appears whole (a rename) or not at all
        .<name>.lock                 flock(2): exclusive while <name> is written or removed,
                                     shared while it is read; present only while held
        .<name>.tmp-<pid>-<hex>/     <name> being written by process <pid>, which holds the
                                     exclusive lock; so any such folder seen by a process that
                                     holds the exclusive lock is dead, and is removed

The kernel drops an flock when the last descriptor of it closes, which a SIGKILL does too, so a
lock never outlives its holders and never wedges a later start. A waiter waits a bounded time,
says every 10 s whom it waits for, and stops at once when its start is cancelled.

Lock files are unlinked only by an exclusive holder, and a taker checks after locking that the
path still names the file it locked (else it locks the new one), so two processes never both
believe they hold one lock through two files.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger("shoal.startup")

NOTE_EVERY_S = 10.0  # how often a waiter says what it still waits for


class StartCancelled(Exception):
    """The start was cancelled (SIGTERM, SIGINT, SIGHUP): what it was writing is removed."""


class LockBusy(Exception):
    """Another process held a cache folder's lock for longer than the caller would wait."""


def raise_if_cancelled(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise StartCancelled("the start was cancelled")


def lock_path(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.lock"


def temporaries(folder: Path) -> list[Path]:
    """The private folders of `folder` (live or dead) beside it."""
    return sorted(folder.parent.glob(f".{glob.escape(folder.name)}.tmp-*"))


def owner_of(temporary: Path) -> Path:
    """The folder a private folder `.<name>.tmp-...` is (or was) written for."""
    name = temporary.name[1:].rsplit(".tmp-", 1)[0]
    return temporary.parent / name


class FolderLock:
    """An flock on `.<name>.lock` beside `folder`, held by this process until release()."""

    def __init__(self, folder: Path, fd: int, exclusive: bool) -> None:
        self.folder = folder
        self.fd = fd
        self.exclusive = exclusive

    @classmethod
    def try_take(cls, folder: Path, *, exclusive: bool, create: bool = True) -> FolderLock | None:
        """The lock, or None when another process holds it in a conflicting mode. OSError when
        the lock file cannot be opened (a read-only cache; FileNotFoundError with create=False
        when nobody holds it)."""
        path = lock_path(folder)
        flags = (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY
        while True:
            fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            if _names_file(path, fd):
                return cls(folder, fd, exclusive)
            os.close(fd)  # its last holder unlinked it before we locked it: lock the new file

    @classmethod
    def take(
        cls,
        folder: Path,
        *,
        exclusive: bool,
        doing: str,
        wait_s: float,
        cancel: threading.Event | None = None,
        poll_s: float = 0.1,
    ) -> FolderLock:
        """Wait up to `wait_s` for the lock (LockBusy after), saying every NOTE_EVERY_S whom it
        waits for; StartCancelled as soon as `cancel` is set. `doing` is what this process
        does with the folder (written into the lock file for other waiters)."""
        began = time.monotonic()
        noted = began - NOTE_EVERY_S
        while True:
            raise_if_cancelled(cancel)
            lock = cls.try_take(folder, exclusive=exclusive)
            if lock is not None:
                if exclusive:
                    lock._write_note(doing)
                return lock
            waited_s = time.monotonic() - began
            if waited_s >= wait_s:
                raise LockBusy(
                    f"{folder} is busy ({holder(folder)}, lock {lock_path(folder)}); "
                    f"gave up waiting after {waited_s:.0f} s"
                )
            if time.monotonic() - noted >= NOTE_EVERY_S:
                noted = time.monotonic()
                log.info(
                    "%s: waiting for %s (%.0f s so far, at most %.0f s)",
                    doing, holder(folder), waited_s, wait_s,
                )  # fmt: skip
            if cancel is not None:
                cancel.wait(poll_s)
            else:
                time.sleep(poll_s)

    def _write_note(self, doing: str) -> None:
        """Who holds the lock and why, for the log lines of those who wait for it."""
        note = f"pid {os.getpid()} on {socket.gethostname()}, {doing}"
        note += time.strftime(" since %Y-%m-%d %H:%M:%S")
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, note.encode(), 0)

    def release(self) -> None:
        """Unlock; the last holder (one that can lock it exclusively) unlinks the lock file."""
        if self.fd < 0:
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # other readers hold it still: the last of them unlinks it
        else:
            path = lock_path(self.folder)
            if _names_file(path, self.fd):
                with contextlib.suppress(OSError):  # a read-only cache keeps its lock file
                    path.unlink()
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def holder(folder: Path) -> str:
    """What the lock file of `folder` says about its exclusive holder (readers write nothing)."""
    try:
        note = lock_path(folder).read_text(errors="replace").strip()
    except OSError:
        note = ""
    return note or "a process reading it"


def is_busy(folder: Path) -> bool:
    """Whether a process holds the lock of `folder` now. Creates nothing (`shoal cache list`)."""
    try:
        lock = FolderLock.try_take(folder, exclusive=True, create=False)
    except OSError:
        return False  # no lock file: nobody holds it
    if lock is None:
        return True
    os.close(lock.fd)  # not release(): looking must not unlink
    return False


def _names_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def make_private(folder: Path) -> Path:
    """A new private folder for writing `folder` (the caller holds its exclusive lock)."""
    private = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    private.mkdir(mode=0o755)
    return private


def sweep_temporaries(folder: Path) -> None:
    """Remove the private folders of `folder`: dead, since the caller holds its exclusive lock."""
    for temporary in temporaries(folder):
        log.info("removing %s, left by a process that died while writing it", temporary)
        shutil.rmtree(temporary, ignore_errors=True)


def sweep_dead(parent: Path) -> None:
    """Remove every private folder under `parent` whose writer is gone (its lock is free).
    Cheap when there is none; in a read-only cache it removes nothing."""
    for temporary in sorted(parent.glob(".*.tmp-*")):
        folder = owner_of(temporary)
        try:
            lock = FolderLock.try_take(folder, exclusive=True)
        except OSError:
            return  # read-only: nothing here can be removed anyway
        if lock is not None:
            with lock:
                sweep_temporaries(folder)


def fsync_folder(folder: Path) -> None:
    """fsync each file of `folder`, then the folder itself (its entries)."""
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as file:
                os.fsync(file.fileno())
    fsync_dir(folder)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(private: Path, folder: Path) -> None:
    """Rename a finished private folder into place, durably (the caller holds the exclusive
    lock of `folder`, and `folder` does not exist)."""
    private.chmod(0o755)
    os.rename(private, folder)
    fsync_dir(folder.parent)


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A folder's marker (what a build or a conversion was made from) as written, or None when
    the file is missing, unreadable or not a JSON object."""
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def remove_folder(folder: Path) -> None:
    """Remove `folder` (the caller holds its exclusive lock): renamed aside first, so a reader
    never sees it half removed, and a crash midway leaves a private folder the sweep removes."""
    aside = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)
