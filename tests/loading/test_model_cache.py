"""The converted-model cache (loading/gguf_convert.py, model_cache.py) keeps itself whole
and small (issue 29): a conversion killed midway is swept by the next start, which comes up; a
cancelled or failed one leaves nothing; a full disk is the CLI's one-line error; files are
fsynced and checksummed, and a folder zeroed in place is refused with what to delete; older
conversions of the same file are pruned unless in use; a read-only cache loads.

A tiny GGUF (support/tiny_gguf.py) converts in about a second; a conversion that must be
caught midway is held there by a patched save_file, never by timing.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import read_only_hook
import safetensors.torch
from processes import wait_for
from tiny_gguf import write_tiny_gguf

from shoal.api.cli import main
from shoal.kernels.cache_files import FolderLock, StartCancelled, lock_path, temporaries
from shoal.loading.gguf_convert import convert_gguf, converted_folder
from shoal.loading.loader import resolve_model_folder
from shoal.loading.model_cache import MARKER_NAME, CorruptCacheError
from shoal.models.load import load_model


@pytest.fixture
def gguf_path(tiny_folder: Path, tmp_path: Path) -> Path:
    return write_tiny_gguf(tiny_folder, tmp_path / "tiny.gguf", quantize=False)


def cache_names(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


CONVERT_AND_HANG = """
import sys, time
from pathlib import Path
import safetensors.torch
from shoal.loading.loader import resolve_model_folder

real_save = safetensors.torch.save_file

def save_then_hang(*args, **kwargs):
    real_save(*args, **kwargs)
    Path(sys.argv[3]).write_text("saved")
    time.sleep(3600)

safetensors.torch.save_file = save_then_hang
resolve_model_folder(Path(sys.argv[1]), cache_dir=Path(sys.argv[2]), progress=False)
"""


def test_a_start_after_a_conversion_killed_midway_comes_up_and_sweeps_it(
    gguf_path: Path, tmp_path: Path
) -> None:
    """SIGKILL a conversion after it wrote the weights: its private folder stays (nothing can
    remove it then), and the next start converts, loads, and removes it (before, it was kept
    for an hour, so a crash loop filled the disk)."""
    cache, saved = tmp_path / "cache", tmp_path / "saved"
    child = subprocess.Popen(
        [sys.executable, "-c", CONVERT_AND_HANG, str(gguf_path), str(cache), str(saved)]
    )
    try:
        wait_for(saved.exists, 120, "the conversion to write its weights")
    finally:
        child.kill()
        child.wait()
    folder = converted_folder(gguf_path, cache)
    [dead] = temporaries(folder)
    assert f".tmp-{child.pid}-" in dead.name  # its writer, for a human reading the cache

    began = time.monotonic()
    loaded = load_model(gguf_path, cache_dir=cache, progress=False)
    assert time.monotonic() - began < 60
    assert loaded.path == folder
    assert cache_names(cache) == [folder.name]  # no private folder, no lock file


def test_a_cancelled_conversion_leaves_nothing(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, cancel = tmp_path / "cache", threading.Event()
    real_save = safetensors.torch.save_file

    def save_then_cancel(*args: object, **kwargs: object) -> None:
        real_save(*args, **kwargs)  # type: ignore[arg-type]
        cancel.set()  # as the SIGTERM handler does, while the conversion runs

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_cancel)
    with pytest.raises(StartCancelled):
        load_model(gguf_path, cache_dir=cache, progress=False, cancel=cancel)
    assert cache_names(cache) == []


def test_a_full_disk_is_a_one_line_error(
    gguf_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def disk_full(tensors: object, path: str, metadata: object = None) -> None:
        Path(path).write_bytes(b"\0" * 4096)  # what got written before the disk filled
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    cache = tmp_path / "cache"
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(cache))
    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    assert main(["generate", "--model", str(gguf_path), "hi"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.split("\n") if line and not line.startswith("\r")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err  # besides the progress bar
    assert "no space left on the device" in err and "SHOAL_CACHE_DIR" in err
    assert "Traceback" not in err
    assert cache_names(cache) == []


def test_conversions_are_fsynced_and_checksummed(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    folder = resolve_model_folder(gguf_path, cache_dir=tmp_path / "cache", progress=False)
    marker = json.loads((folder / MARKER_NAME).read_text())
    files = {p.name for p in folder.iterdir()} - {MARKER_NAME}
    assert set(marker["files"]) == files
    for name, recorded in marker["files"].items():
        data = (folder / name).read_bytes()
        assert recorded == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    private = {Path(path).name for path in synced if ".tmp-" in path}
    assert files | {MARKER_NAME} <= private  # every file, before the rename
    assert any(Path(path).name.startswith(f".{folder.name}.tmp-") for path in synced)  # its dir
    assert str(folder.parent) in synced  # the rename itself


def test_a_zeroed_conversion_is_refused_with_what_to_delete(
    gguf_path: Path, tmp_path: Path
) -> None:
    """Zero the tensor data of the converted weights in place, same size, header intact: it
    loaded and served zeros without a word; now the load refuses it and names the folder."""
    cache = tmp_path / "cache"
    folder = resolve_model_folder(gguf_path, cache_dir=cache, progress=False)
    weights = folder / "model.safetensors"
    header_bytes = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    with open(weights, "r+b") as file:
        file.seek(header_bytes)
        file.write(b"\0" * (weights.stat().st_size - header_bytes))
    with pytest.raises(CorruptCacheError) as refused:
        load_model(gguf_path, cache_dir=cache, progress=False)
    message = str(refused.value)
    assert "\n" not in message
    assert f"rm -r '{folder}'" in message and "model.safetensors" in message

    (folder / "tokenizer.json").write_text("{}")  # another size: caught before any hashing
    with pytest.raises(CorruptCacheError, match=r"tokenizer\.json has \d+ bytes"):
        resolve_model_folder(gguf_path, cache_dir=cache, progress=False)


def test_a_new_conversion_prunes_the_ones_it_supersedes_unless_in_use(
    gguf_path: Path, tmp_path: Path
) -> None:
    """Each reinstall of a model package gives its GGUF a new mtime, so a new key and another
    converted folder; the older ones of that file go, except one a process is loading."""
    cache = tmp_path / "cache"

    def touched() -> Path:
        later = time.time() + len(cache_names(cache)) + 10
        os.utime(gguf_path, (later, later))
        return resolve_model_folder(gguf_path, cache_dir=cache, progress=False)

    first = resolve_model_folder(gguf_path, cache_dir=cache, progress=False)
    second = touched()
    assert cache_names(cache) == [second.name]  # the first is pruned

    reading = FolderLock.take(second, exclusive=False, doing="loading it", wait_s=1)
    try:
        third = touched()
        assert cache_names(cache) == sorted([f".{second.name}.lock", second.name, third.name])
    finally:
        reading.release()
    assert first != second != third
    fourth = touched()
    assert cache_names(cache) == [fourth.name]


def test_another_file_of_the_same_name_is_not_pruned(tiny_folder: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = write_tiny_gguf(tiny_folder, tmp_path / "a" / "tiny.gguf", quantize=False)
    two = write_tiny_gguf(tiny_folder, tmp_path / "b" / "tiny.gguf", quantize=False)
    os.utime(two, (time.time() + 50, time.time() + 50))
    first = resolve_model_folder(one, cache_dir=cache, progress=False)
    second = resolve_model_folder(two, cache_dir=cache, progress=False)
    assert first != second
    assert cache_names(cache) == sorted([first.name, second.name])


def test_a_waiting_conversion_says_for_whom_and_can_be_cancelled(
    gguf_path: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    folder = converted_folder(gguf_path, cache)
    holder = FolderLock.take(folder, exclusive=True, doing="converting tiny.gguf", wait_s=1)
    try:
        cancel = threading.Event()
        threading.Timer(0.3, cancel.set).start()
        with pytest.raises(StartCancelled):
            convert_gguf(gguf_path, folder, progress=False, cancel=cancel)
    finally:
        holder.release()
    assert not lock_path(folder).exists()


READ_ONLY_LOAD = """
import json, sys
from pathlib import Path
import read_only_hook
from shoal.models.load import load_model
read_only_hook.install(sys.argv[2])
loaded = load_model(Path(sys.argv[1]), cache_dir=Path(sys.argv[2]), progress=False)
print(json.dumps({"layers": loaded.config.num_layers, "refused": read_only_hook.refused()}))
"""


def test_a_read_only_cache_loads_its_conversion(gguf_path: Path, tmp_path: Path) -> None:
    """In a process where nothing under the cache may be written (read_only_hook: an audit
    hook, since root ignores permission bits), the converted model loads; the reader's lock
    file, which it cannot create, is all it tried."""
    cache = tmp_path / "cache"
    folder = resolve_model_folder(gguf_path, cache_dir=cache, progress=False)
    before = cache_names(cache)
    result = subprocess.run(
        [sys.executable, "-c", READ_ONLY_LOAD, str(gguf_path), str(cache)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(read_only_hook.__file__).parent)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["layers"] == 2
    assert [path for _, path in report["refused"]] == [str(lock_path(folder))]
    assert cache_names(cache) == before


def test_a_weight_update_from_a_corrupted_conversion_is_refused_without_our_paths(
    gguf_path: Path, tmp_path: Path
) -> None:
    """A weight update names a GGUF: a corrupted conversion of it is a CheckpointError (the
    update is refused, the old weights stay) whose message, for the client, names no folder of
    the server's cache."""
    from shoal.loading.checkpoint import CheckpointError
    from shoal.loading.loader import checkpoint_folder

    cache = tmp_path / "cache"
    folder = resolve_model_folder(gguf_path, cache_dir=cache, progress=False)
    (folder / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as refused:
        checkpoint_folder(gguf_path, cache_dir=cache)
    assert str(cache) not in str(refused.value)
