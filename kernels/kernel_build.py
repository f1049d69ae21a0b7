"""Build a torch C++ extension into the cache once per key, so that no kill can wedge a start.

    <cache_dir>/kernels/
        <name>_<key>/                  a finished build, renamed into place whole:
            <name>_<key>.so            loaded with torch.ops.load_library: no builder, no lock,
                                       nothing written, so a read-only cache loads it too
            shoal-kernels.json         what it was built from (`shoal cache list` shows it)
            unit_<i>.cpp               what was compiled, where the spec asks for units: each
                                       #includes a share of the sources (build_units.py)
        .<name>_<key>.lock             held while a process builds that key (cache_files.py)
        .<name>_<key>.tmp-<pid>-<hex>/ a build in progress: torch's builder works here, its
                                       `lock` file included, so that one never blocks anybody

The key hashes everything that makes two builds differ: the sources and headers, the flags,
the units they are compiled as, the compiler ($CXX), torch's version and install location,
Python's version and BUILD_SCHEME. Two checkouts or environments on one machine therefore keep
a build each instead of taking turns rebuilding one folder, and a changed source builds into a
new folder.

The compile runs in a child process (build_child.py) that leads its own process group:
cancelling the start stops the group (Python, ninja, and through ninja the compilers) and
removes the private folder, and the child stops the same way when its parent dies, however.
While it builds, a line every NOTE_EVERY_S says how long it has taken.

Two starts that need the same key: the second waits for the first's lock (saying whom it waits
for, every 10 s, at most wait_s; then KernelUnavailable) and loads what the first built. Waiting
rather than building twice in parallel: on a small machine two builds at once take twice as
long each and one of them is thrown away, and the lock ends with its holder (its child holds it
too, until it dies), so waiting cannot wedge.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal.kernels.build_units import write_units
from shoal.kernels.cache_files import (
    NOTE_EVERY_S,
    FolderLock,
    LockBusy,
    StartCancelled,
    make_private,
    publish,
    read_json_object,
    remove_folder,
    sweep_dead,
    sweep_temporaries,
)

log = logging.getLogger("shoal.startup")

BUILD_SCHEME = 1  # bump when the layout of a build folder changes
MARKER_NAME = "shoal-kernels.json"
WAIT_S = 900.0  # the longest a start waits for another process's build of its key
BUILD_TIMEOUT_S = 1800.0  # a compile still running after this is killed
KEY_LENGTH = 12
STOP_GRACE_S = 3.0  # a stopped build's group gets this long to end before SIGKILL


class KernelUnavailable(RuntimeError):
    """The kernels could not be built or loaded here (no compiler, an unsupported CPU...)."""


@dataclass(frozen=True)
class ExtensionSpec:
    """A torch C++ extension: what the builder compiles, and how."""

    name: str  # the folder and library name, before the key
    sources: tuple[Path, ...]  # compiled
    depends: tuple[Path, ...]  # hashed into the key besides the sources (headers)
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    what: str = "the CPU kernels"  # for the log lines
    takes: str = ""  # how long a build takes, for the log line that starts it
    units: int = 0  # compiled as this many translation units (build_units.py); 0: one a source


def build_key(spec: ExtensionSpec) -> str:
    """A short hash of everything that makes a build of `spec` differ (module doc)."""
    digest = hashlib.sha256()

    def add(label: str, value: bytes) -> None:
        digest.update(f"{label}:{len(value)}:".encode())
        digest.update(value)

    add("scheme", str(BUILD_SCHEME).encode())
    for path in sorted(set(spec.sources + spec.depends)):
        add(path.name, path.read_bytes())
    add("cflags", json.dumps(spec.cflags).encode())
    add("ldflags", json.dumps(spec.ldflags).encode())
    add("units", str(spec.units).encode())
    add("torch", torch.__version__.encode())
    add("torch location", str(Path(torch.__file__).resolve().parent).encode())
    add("python", sys.version.encode())
    add("machine", platform.machine().encode())
    add("compiler", os.environ.get("CXX", "c++").encode())
    return digest.hexdigest()[:KEY_LENGTH]


def build_folder(spec: ExtensionSpec, cache_dir: Path) -> Path:
    return cache_dir / "kernels" / f"{spec.name}_{build_key(spec)}"


def library_of(folder: Path) -> Path:
    return folder / f"{folder.name}.so"


def is_built(folder: Path) -> bool:
    return library_of(folder).is_file() and (folder / MARKER_NAME).is_file()


def read_marker(folder: Path) -> dict[str, Any] | None:
    """What a build was made from (see _write_marker), or None without a readable marker."""
    return read_json_object(folder / MARKER_NAME)


def load_extension(
    spec: ExtensionSpec,
    cache_dir: Path,
    *,
    cancel: threading.Event | None = None,
    wait_s: float = WAIT_S,
    build_timeout_s: float = BUILD_TIMEOUT_S,
) -> Path:
    """Load the library of `spec` into this process, built first if its key has no build yet;
    the library's path. KernelUnavailable when it cannot be; StartCancelled when `cancel` is
    set while it waits or builds."""
    library = built_library(
        spec, cache_dir, cancel=cancel, wait_s=wait_s, build_timeout_s=build_timeout_s
    )
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as error:
        raise KernelUnavailable(
            f"{spec.what} in {library.parent} could not be loaded ({error}); "
            f"delete that folder to build them again"
        ) from error
    return library


def built_library(
    spec: ExtensionSpec,
    cache_dir: Path,
    *,
    cancel: threading.Event | None = None,
    wait_s: float = WAIT_S,
    build_timeout_s: float = BUILD_TIMEOUT_S,
) -> Path:
    """The built library of `spec` in `cache_dir`, building it under its key's lock if need be."""
    folder = build_folder(spec, cache_dir)
    if is_built(folder):
        return library_of(folder)  # the common case: nothing locked, nothing written
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = FolderLock.take(
            folder, exclusive=True, doing=f"building {spec.what}", wait_s=wait_s, cancel=cancel
        )
    except LockBusy as error:
        raise KernelUnavailable(f"{spec.what} could not be built: {error}") from error
    except OSError as error:
        raise KernelUnavailable(
            f"{spec.what} are not built in {folder.parent} and cannot be built there: {error}"
        ) from error
    with lock:
        if is_built(folder):
            return library_of(folder)  # built by the process we waited for
        try:
            sweep_temporaries(folder)  # dead: we hold the lock
            sweep_dead(folder.parent)  # other keys' whose lock is free
            remove_folder(folder)  # an incomplete one (a library or marker deleted by hand)
            private = make_private(folder)
            try:
                _compile(spec, folder.name, private, lock.fd, cancel, build_timeout_s)
                _write_marker(spec, private, key=folder.name.removeprefix(f"{spec.name}_"))
                publish(private, folder)
            finally:
                remove_folder(private)
        except OSError as error:  # a full disk, a compiler that cannot be started...
            raise KernelUnavailable(f"{spec.what} could not be built: {error}") from error
    return library_of(folder)


def _compile(
    spec: ExtensionSpec,
    name: str,
    private: Path,
    lock_fd: int,
    cancel: threading.Event | None,
    timeout_s: float,
) -> None:
    """Run the builder in a child process group into `private`, reporting progress; on any way
    out but success (a failure, a cancellation, an exception here) the group is killed."""
    sources = spec.sources
    if spec.units:
        try:
            sources = write_units(spec.sources, spec.units, private)
        except ValueError as error:
            raise KernelUnavailable(f"{spec.what} could not be built: {error}") from error
    request = {
        "name": name,
        "sources": [str(source) for source in sources],
        "cflags": list(spec.cflags),
        "ldflags": list(spec.ldflags),
        "folder": str(private),
        "parent_pid": os.getpid(),
    }
    build_log = private / "build.log"
    with open(build_log, "wb") as output:
        child = subprocess.Popen(
            [sys.executable, "-m", "shoal.kernels.build_child", json.dumps(request)],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed as one
            pass_fds=(lock_fd,),  # the lock is held until the child is gone too
        )
    log.info(
        "building %s into %s (process group %d%s; once per key)",
        spec.what, private.parent / name, child.pid, f"; {spec.takes}" if spec.takes else "",
    )  # fmt: skip
    began = time.monotonic()
    noted = began
    cancelled = cancel or threading.Event()
    try:
        while child.poll() is None:
            if cancelled.wait(0.2):
                raise StartCancelled(f"the build of {spec.what} was cancelled")
            elapsed_s = time.monotonic() - began
            if elapsed_s > timeout_s:
                raise KernelUnavailable(f"{spec.what}: the build took over {timeout_s:.0f} s")
            if time.monotonic() - noted >= NOTE_EVERY_S:
                noted = time.monotonic()
                log.info("building %s: %.0f s", spec.what, elapsed_s)
    finally:
        if child.returncode is None or child.returncode < 0:
            _kill_group(child)
    if child.returncode != 0:
        tail = build_log.read_text(errors="replace").strip()[-2000:]
        raise KernelUnavailable(f"{spec.what} could not be built: {tail}")
    log.info("built %s in %.0f s", spec.what, time.monotonic() - began)


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM the child's group (build_child.py: ninja passes it to its compile jobs), then
    SIGKILL whatever of the group is left after STOP_GRACE_S."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _write_marker(spec: ExtensionSpec, private: Path, key: str) -> None:
    marker = {
        "what": spec.what,
        "key": key,
        "sources": [str(source) for source in spec.sources],
        "cflags": list(spec.cflags),
        "torch": torch.__version__,
        "torch_location": str(Path(torch.__file__).resolve().parent),
        "python": sys.version.split()[0],
        "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (private / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
