"""`python -m shoal cache list | size | clean` on a fabricated cache holding one of each kind of
entry (loading/cache_inventory.py): what is live, stale (and why), busy, or not shoal's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shoal.api.cache_command import this_environment
from shoal.api.cli import main
from shoal.kernels.cache_files import FolderLock
from shoal.kernels.kernel_build import MARKER_NAME as KERNELS_MARKER
from shoal.loading.gguf_convert import CONVERTER_VERSION
from shoal.loading.model_cache import MARKER_NAME as MODEL_MARKER

LIVE = ["ok-model", "kernels/CURRENT", "kernels/shoal_cpu_kernels_avx512_0therenv0000"]
GONE_ENV = "kernels/shoal_cpu_kernels_avx512_g0neenv00000"
STALE = [
    "superseded-model", "gone-model", "half-model", ".dead-model.tmp-1-ab", ".unheld-model.lock",
    GONE_ENV, "kernels/shoal_cpu_kernels_avx512_0ldkey000000", "kernels/shoal_cpu_kernels_avx512",
]  # fmt: skip
BUSY = [".busy-model.tmp-2-cd"]
OTHER = ["notes.txt"]


def write(path: Path, data: bytes | str = b"x" * 1000) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def model(cache: Path, name: str, gguf: Path, **changes: object) -> None:
    stat = gguf.stat()
    marker = {
        "source": str(gguf.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "converter_version": CONVERTER_VERSION,
        "files": {},
        **changes,
    }
    write(cache / name / "model.safetensors")
    write(cache / name / MODEL_MARKER, json.dumps(marker))


def write_kernels(cache: Path, name: str, torch_location: str, marker: bool = True) -> None:
    folder = cache / "kernels" / name
    write(folder / f"{name}.so")
    if marker:
        write(folder / KERNELS_MARKER, json.dumps({"torch_location": torch_location}))


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    source = tmp_path / "models" / "tiny.gguf"
    write(source)
    environment = this_environment(cache)
    ours = environment.torch_location
    model(cache, "ok-model", source)
    model(cache, "superseded-model", source, size=1)
    model(cache, "gone-model", source, source=str(tmp_path / "nowhere.gguf"))
    write(cache / "half-model" / "model.safetensors")
    write(cache / ".dead-model.tmp-1-ab" / "model.safetensors")
    write(cache / ".unheld-model.lock", "pid 1 on elsewhere, converting tiny.gguf")
    write(cache / ".busy-model.tmp-2-cd" / "model.safetensors")
    [current] = environment.kernel_folders
    write_kernels(cache, current, ours)
    write_kernels(cache, "shoal_cpu_kernels_avx512_0therenv0000", str(tmp_path))  # it exists
    write_kernels(cache, "shoal_cpu_kernels_avx512_g0neenv00000", str(tmp_path / "gone-venv"))
    write_kernels(cache, "shoal_cpu_kernels_avx512_0ldkey000000", ours)
    write_kernels(cache, "shoal_cpu_kernels_avx512", ours, marker=False)  # an older shoal's
    write(cache / "notes.txt", "mine")
    return cache


def names(cache: Path, entries: list[str]) -> set[str]:
    [current] = this_environment(cache).kernel_folders
    return {entry.replace("CURRENT", current) for entry in entries}


def present(cache: Path) -> set[str]:
    found = {p.name for p in cache.iterdir() if p.name != "kernels"}
    return found | {f"kernels/{p.name}" for p in (cache / "kernels").iterdir()}


def run(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main(["cache", *args]) == 0
    return capsys.readouterr().out.splitlines()


def test_list_says_what_each_entry_is(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FolderLock.take(cache / "busy-model", exclusive=True, doing="converting", wait_s=1):
        lines = run(capsys, "--cache-dir", str(cache), "list")
    listed = {line.split()[5]: line for line in lines}  # kind, size, unit, date, time, name
    assert set(listed) == names(cache, LIVE + STALE + BUSY + OTHER) | {".busy-model.lock"}
    for name in names(cache, LIVE):
        assert "complete" in listed[name] and "stale" not in listed[name], listed[name]
    for name in names(cache, STALE):
        assert " stale: " in listed[name], listed[name]
    assert "in use" in listed[".busy-model.tmp-2-cd"]
    assert "superseded" in listed["superseded-model"]
    assert "source file is gone" in listed["gone-model"]
    assert "torch installation that is gone" in listed[GONE_ENV]
    assert "tiny.gguf" in listed["ok-model"]


def test_size_counts_everything(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    [line] = run(capsys, "--cache-dir", str(cache), "size")
    total = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    assert line.startswith(f"{total / 1024:.1f} KB in {cache}"), line
    assert "stale" in line


def test_clean_removes_the_stale_then_all_but_what_is_in_use(
    cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    everything = names(cache, LIVE + STALE + BUSY + OTHER)
    assert present(cache) == everything
    busy = FolderLock.take(cache / "busy-model", exclusive=True, doing="converting", wait_s=1)
    try:
        out = run(capsys, "--cache-dir", str(cache), "clean", "--dry-run")
        assert present(cache) == everything | {".busy-model.lock"}
        assert len([line for line in out if line.startswith("would remove")]) == len(STALE)
        monkeypatch.setenv("SHOAL_CACHE_DIR", str(cache))  # the default --cache-dir
        run(capsys, "clean")
        assert present(cache) == names(cache, LIVE + BUSY + OTHER) | {".busy-model.lock"}
        run(capsys, "clean", "--all")
        assert present(cache) == set(BUSY + OTHER) | {".busy-model.lock"}
    finally:
        busy.release()
    run(capsys, "clean")  # its writer is gone now
    assert present(cache) == set(OTHER)
    assert os.listdir(cache / "kernels") == []


def test_no_cache_yet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "--cache-dir", str(tmp_path / "none"), "list") == [
        f"{tmp_path / 'none'}: no cache yet"
    ]
