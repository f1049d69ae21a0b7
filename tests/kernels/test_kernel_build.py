"""The kernel build (kernels/kernel_build.py) cannot wedge a start (issue 29): a build killed
midway leaves nothing that blocks the next, stale locks and folders are swept, a start that must
wait says for whom and gives up after a bound, a cancelled build takes its compilers with it, two
environments keep two builds, and a read-only cache loads what is built.

All but the read-only test build a stand-in extension (one C function, no torch headers: ~4 s,
most of it the build child's imports) instead of the real kernels (~1 min on 2 cores): what they
test is the build's locks, folders and processes, not the sources. A compiler wrapper named by
$CXX (which the key includes, so it has builds of its own) can make the compile step hang: it
first writes its process group into a file, which the test waits for, kills or cancels, and
then checks that the group is gone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import read_only_hook
import torch
from processes import group_is_gone, wait_for

from shoal.kernels import cpu_kernels
from shoal.kernels.cache_files import FolderLock, StartCancelled, lock_path, temporaries
from shoal.kernels.kernel_build import (
    ExtensionSpec,
    KernelUnavailable,
    build_folder,
    build_key,
    built_library,
)

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

WRAPPER = """#!{python}
import os, sys, time
started = os.environ.get("STAND_IN_STARTED")
if started and os.environ.get("STAND_IN_HANG") and "-c" in sys.argv:  # the compile step
    with open(started + ".part", "w") as note:
        note.write(str(os.getpgrp()))
    os.rename(started + ".part", started)
    time.sleep(3600)
os.execvp("c++", ["c++", *sys.argv[1:]])
"""

BUILD_IN_A_CHILD = """
import sys
from pathlib import Path
from shoal.kernels.kernel_build import ExtensionSpec, built_library
spec = ExtensionSpec("stand_in", (Path(sys.argv[1]),), (), ("-O0",), (), what="the stand-in")
built_library(spec, Path(sys.argv[2]))
"""


def stand_in_spec(folder: Path) -> ExtensionSpec:
    source = folder / "stand_in.cpp"
    if not source.exists():
        source.write_text('extern "C" int shoal_stand_in() { return 7; }\n')
    return ExtensionSpec("stand_in", (source,), (), ("-O0",), (), what="the stand-in")


@pytest.fixture
def slow_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$CXX: a wrapper of c++ whose compile step hangs while STAND_IN_HANG is set, after
    writing its process group into the file returned."""
    wrapper = tmp_path / "bin" / "slow-g++"  # a name torch's compiler check accepts
    wrapper.parent.mkdir()
    wrapper.write_text(WRAPPER.format(python=sys.executable))
    wrapper.chmod(0o755)
    started = tmp_path / "compiler-started"
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("STAND_IN_STARTED", str(started))
    monkeypatch.setenv("STAND_IN_HANG", "1")
    return started


def assert_nothing_left_but_the_build(folder: Path) -> None:
    assert temporaries(folder) == []
    assert not lock_path(folder).exists()


@needs_compiler
def test_a_start_after_a_build_killed_midway_comes_up(
    tmp_path: Path, slow_compiler: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL the process that builds while its compiler runs: the compiler's group dies with
    it, and the next build neither waits for a lock nor trips on the dead private folder."""
    spec, cache = stand_in_spec(tmp_path), tmp_path / "cache"
    child = subprocess.Popen(
        [sys.executable, "-c", BUILD_IN_A_CHILD, str(spec.sources[0]), str(cache)],
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(slow_compiler.exists, 120, "the compiler to start")
        child.kill()
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    assert child.stderr is not None
    child.stderr.close()
    pgid = int(slow_compiler.read_text())
    wait_for(lambda: group_is_gone(pgid), 10, "the build's process group to die with its parent")
    folder = build_folder(spec, cache)
    assert len(temporaries(folder)) == 1  # the dead build's private folder

    monkeypatch.delenv("STAND_IN_HANG")
    began = time.monotonic()
    library = built_library(spec, cache, wait_s=5.0)
    assert library.is_file() and library.parent == folder
    assert time.monotonic() - began < 90
    assert_nothing_left_but_the_build(folder)


@needs_compiler
def test_stale_locks_and_folders_do_not_block_a_build(tmp_path: Path) -> None:
    """What a kill leaves in place (torch's own `lock` file in a build folder, which made every
    later start wait forever; a private folder; an unheld lock file) is swept, not waited for."""
    spec, cache = stand_in_spec(tmp_path), tmp_path / "cache"
    folder = build_folder(spec, cache)
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # torch's FileBaton, left by a SIGKILL
    dead = folder.parent / f".{folder.name}.tmp-999999-dead"
    dead.mkdir()
    (dead / "lock").touch()
    lock_path(folder).write_text("pid 999999 on elsewhere, building the stand-in")

    library = built_library(spec, cache, wait_s=5.0)
    assert library.is_file()
    assert not (folder / "lock").exists()
    assert_nothing_left_but_the_build(folder)


def test_a_start_that_must_wait_says_for_whom_and_gives_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec, cache = stand_in_spec(tmp_path), tmp_path / "cache"
    folder = build_folder(spec, cache)
    folder.parent.mkdir(parents=True)
    holder = FolderLock.take(folder, exclusive=True, doing="building the stand-in", wait_s=1)
    try:
        with (
            caplog.at_level(logging.INFO, logger="shoal.startup"),
            pytest.raises(KernelUnavailable, match=rf"pid {os.getpid()} .*gave up waiting"),
        ):
            built_library(spec, cache, wait_s=0.5)
        assert f"waiting for pid {os.getpid()}" in caplog.text

        cancel = threading.Event()
        threading.Timer(0.3, cancel.set).start()
        began = time.monotonic()
        with pytest.raises(StartCancelled):
            built_library(spec, cache, wait_s=600, cancel=cancel)
        assert time.monotonic() - began < 5
    finally:
        holder.release()
    assert not lock_path(folder).exists()


@needs_compiler
def test_a_cancelled_build_kills_its_compilers_and_removes_its_folder(
    tmp_path: Path, slow_compiler: Path
) -> None:
    spec, cache = stand_in_spec(tmp_path), tmp_path / "cache"
    cancel = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        build = pool.submit(built_library, spec, cache, cancel=cancel)
        wait_for(slow_compiler.exists, 120, "the compiler to start")
        pgid = int(slow_compiler.read_text())
        cancel.set()
        began = time.monotonic()
        with pytest.raises(StartCancelled):
            build.result(timeout=10)
        assert time.monotonic() - began < 5
    assert group_is_gone(pgid)
    folder = build_folder(spec, cache)
    assert not folder.exists()
    assert_nothing_left_but_the_build(folder)


def test_every_input_of_a_build_changes_its_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    header = tmp_path / "ops.h"
    header.write_text("// v1\n")
    spec = stand_in_spec(tmp_path)
    spec = ExtensionSpec(spec.name, spec.sources, (header,), spec.cflags, spec.ldflags)
    keys = {build_key(spec)}

    def changed(**fields: object) -> None:
        keys.add(build_key(ExtensionSpec(**{**spec.__dict__, **fields})))  # type: ignore[arg-type]

    changed(cflags=("-O1",))
    changed(ldflags=("-lm",))
    changed(units=2)
    header.write_text("// v2\n")
    changed()
    header.write_text("// v1\n")
    for target, value in (
        ("torch.__version__", "9.9.9"),
        ("torch.__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py")),
        ("sys.version", "3.99.0 (another build)"),
    ):
        with monkeypatch.context() as patch:
            patch.setattr(target, value)
            changed()
    with monkeypatch.context() as patch:
        patch.setenv("CXX", "clang++")
        changed()
    assert build_key(spec) in keys
    assert len(keys) == 9, "each change gives a key of its own"


@needs_compiler
def test_sources_built_as_one_unit_give_one_library_with_all_of_them(tmp_path: Path) -> None:
    """units=1: the builder compiles one generated file that includes both sources (each of
    which keeps a helper of its own), and the library has both functions."""
    sources = []
    for name, value in (("seven", 7), ("eight", 8)):
        source = tmp_path / f"{name}.cpp"
        source.write_text(
            f"namespace {{ int {name}_value() {{ return {value}; }} }}\n"
            f'extern "C" int shoal_{name}() {{ return {name}_value(); }}\n'
        )
        sources.append(source)
    spec = ExtensionSpec("stand_in", tuple(sources), (), ("-O0",), (), what="the stand-in", units=1)
    library = built_library(spec, tmp_path / "cache")
    assert sorted(p.name for p in library.parent.glob("*.cpp")) == ["unit_0.cpp"]
    loaded = ctypes.CDLL(str(library))
    assert (loaded.shoal_seven(), loaded.shoal_eight()) == (7, 8)
    assert_nothing_left_but_the_build(library.parent)


def test_the_cpu_kernels_key_covers_every_source_and_header() -> None:
    spec = cpu_kernels.spec()
    hashed = {path.name for path in (*spec.sources, *spec.depends)}
    assert hashed == {p.name for p in cpu_kernels.CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert spec.name.endswith(cpu_kernels.build_isa())
    assert cpu_kernels.build_isa().startswith(cpu_kernels.capability().lower())


@needs_compiler
def test_two_environments_keep_two_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second torch installation (another venv) builds into a folder of its own and leaves
    the first's alone; back in the first, nothing is rebuilt."""
    spec, cache = stand_in_spec(tmp_path), tmp_path / "cache"
    first = built_library(spec, cache)
    first_stat = first.stat()
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__file__", str(tmp_path / "venv-b" / "torch" / "__init__.py"))
        second = built_library(spec, cache)
    assert second.parent != first.parent
    assert second.is_file() and first.is_file()
    assert (first.stat().st_ino, first.stat().st_mtime_ns) == (
        first_stat.st_ino,
        first_stat.st_mtime_ns,
    )

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt a build that is there")

    monkeypatch.setattr(subprocess, "Popen", no_build)
    assert built_library(spec, cache) == first


READ_ONLY_LOAD = """
import json, sys
from pathlib import Path
import read_only_hook
from shoal.kernels.cpu_kernels import load_cpu_kernels
read_only_hook.install(sys.argv[1])
kernels = load_cpu_kernels(Path(sys.argv[1]))
print(json.dumps({"refused": read_only_hook.refused(), "op": str(kernels.rms_norm)}))
"""


@needs_compiler
def test_a_read_only_cache_loads_the_built_kernels(prebuilt_cpu_kernels: Path) -> None:
    """The real kernels, in a process where nothing under the cache may be created, changed or
    removed (read_only_hook: an audit hook, since the tests may run as root, which ignores
    permission bits): they load with no write even tried. torch's builder, used to load them
    before, had to create its lock file there, and the start fell back to the reference."""
    before = sorted(p.relative_to(prebuilt_cpu_kernels) for p in prebuilt_cpu_kernels.rglob("*"))
    result = subprocess.run(
        [sys.executable, "-c", READ_ONLY_LOAD, str(prebuilt_cpu_kernels)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(read_only_hook.__file__).parent)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert '"refused": []' in result.stdout, result.stdout
    assert "shoal_cpu" in result.stdout
    after = sorted(p.relative_to(prebuilt_cpu_kernels) for p in prebuilt_cpu_kernels.rglob("*"))
    assert after == before


@needs_compiler
@pytest.mark.skipif(
    cpu_kernels.capability() != "AVX512",
    reason="this CPU's own build is AVX2's or narrower, which every other test runs already",
)
def test_the_avx2_build_compiles_and_gives_its_bits_on_an_avx512_cpu(
    prebuilt_cpu_kernels: Path,
) -> None:
    """The kernels as an AVX2 CPU builds them (ATen's vectors of 8), built and run here: code
    for AVX-512 CPUs only (the bfloat16 panels' gated epilogue took ATen's 16-lane vector) once
    broke that build, which no test on an AVX-512 machine compiled. Here the bfloat16 panels
    still run (the CPU has AVX512-BF16) and must give that build's silu_mul's bits."""
    tests = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "ATEN_CPU_CAPABILITY": "avx2",
        "SHOAL_CACHE_DIR": str(prebuilt_cpu_kernels),
    }
    check = "from shoal.kernels import cpu_kernels; print(cpu_kernels.capability())"
    assert (
        subprocess.run(
            [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120
        ).stdout.strip()
        == "AVX2"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(tests / "test_bf16_gated.py"), str(tests / "test_cpu_kernels.py"),
         "-k", "bits_of_the_product or silu or decode"],
        env=env, capture_output=True, text=True, timeout=1200, cwd=tests.parent.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
