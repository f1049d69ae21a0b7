"""A converted model folder's marker: written last, it says the folder is complete and what each
file must hold, so a corrupted folder is refused instead of served.

    shoal-converted.json
        source, size, mtime_ns   the GGUF file it was converted from (absolute path)
        converter_version        gguf_convert.CONVERTER_VERSION
        files                    {name: {"bytes": n, "sha256": hex}} for every other file

seal() fsyncs every file, records its size and SHA-256, writes the marker, and fsyncs the
folder: after the rename into place nothing of it is only in the page cache. verify() checks
every file against the marker at each load: SHA-256 runs at ~1.4 GB/s here (SHA-NI), ~0.4 s for
SmolLM2-135M's 517 MB of float32 safetensors. prune_superseded() removes older conversions of
the same source once a new one is in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, NoReturn

from shoal.kernels.cache_files import FolderLock, fsync_dir, read_json_object, remove_folder

log = logging.getLogger("shoal.startup")

MARKER_NAME = "shoal-converted.json"
CHUNK_BYTES = 1 << 24


class CorruptCacheError(ValueError):
    """A converted folder whose files differ from what its marker recorded."""


def is_converted(folder: Path) -> bool:
    return (folder / MARKER_NAME).is_file()


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The folder's marker, or None when it has none or it is unreadable."""
    return read_json_object(folder / MARKER_NAME)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def seal(folder: Path, source: Path, converter_version: int) -> None:
    """Make a fully written folder durable and checkable: fsync and checksum every file, then
    write the marker (last) and fsync it and the folder."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.iterdir()):
        path.chmod(0o644)
        with open(path, "rb") as file:
            os.fsync(file.fileno())
        files[path.name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    stat = source.stat()
    marker = {
        "source": str(source.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "converter_version": converter_version,
        "files": files,
    }
    with open(folder / MARKER_NAME, "w") as file:
        file.write(json.dumps(marker, indent=2) + "\n")
        file.flush()
        os.fsync(file.fileno())
    fsync_dir(folder)


def verify(folder: Path) -> None:
    """Raise CorruptCacheError, saying which folder to delete, unless every file the marker
    lists is there with its recorded size and SHA-256."""
    marker = read_marker(folder)
    files = marker.get("files") if marker else None
    if not isinstance(files, dict) or not files:
        _refuse(folder, f"{MARKER_NAME} is unreadable or lists no files")
    for name, expected in files.items():  # sizes first: cheap, and most damage shows there
        try:
            size = (folder / name).stat().st_size
        except OSError:
            _refuse(folder, f"{name} is missing")
        if size != expected.get("bytes"):
            _refuse(folder, f"{name} has {size} bytes, {expected.get('bytes')} were written")
    for name, expected in files.items():
        if file_sha256(folder / name) != expected.get("sha256"):
            _refuse(folder, f"{name} does not hold what was written (SHA-256 differs)")


def _refuse(folder: Path, why: str) -> NoReturn:
    raise CorruptCacheError(
        f"the converted model {folder} is corrupted ({why}): delete that folder "
        f"(rm -r '{folder}') and start again to convert the model anew"
    )


def supersedes(marker: dict[str, Any], old: dict[str, Any]) -> bool:
    """Whether a conversion with `marker` makes the one with `old` useless: the same source
    file converted by this or an older converter, which is not what that file holds now (so
    no process of any version would load it again). A newer converter's is never superseded,
    so two versions sharing a cache do not keep removing each other's."""
    source = old.get("source")
    same_source = isinstance(source, str) and Path(source).resolve() == Path(marker["source"])
    if not same_source or not isinstance(old.get("converter_version"), int):
        return False
    if old["converter_version"] < marker["converter_version"]:
        return True
    return old["converter_version"] == marker["converter_version"] and (
        (old.get("size"), old.get("mtime_ns")) != (marker["size"], marker["mtime_ns"])
    )


def prune_superseded(folder: Path) -> None:
    """Remove the conversions `folder` supersedes (same stem, see supersedes) unless a process
    holds them: one loading it now holds its lock shared, and is left alone."""
    marker = read_marker(folder)
    if marker is None:
        return
    stem = folder.name.rsplit("-", 1)[0]
    for other in sorted(folder.parent.glob(f"{stem}-*")):
        old = read_marker(other) if other != folder and other.is_dir() else None
        if old is None or not supersedes(marker, old):
            continue
        try:
            lock = FolderLock.try_take(other, exclusive=True)
        except OSError:
            continue
        if lock is None:
            log.info("keeping %s, superseded but in use", other)
            continue
        with lock:
            try:
                remove_folder(other)
            except OSError as error:  # the new conversion stands; the old one stays
                log.warning("could not remove the superseded %s: %s", other, error)
                continue
        log.info("removed %s, superseded by %s", other, folder.name)
