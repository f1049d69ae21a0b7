"""`python -m shoal serve` during its start-up (issue 29): a SIGTERM, SIGINT or SIGHUP while the
CPU kernels build or the GGUF converts ends the start within 5 s, with no process of the build
and no temporary folder left (they used to be acted on only after both finished, so a
container's grace period ended in a SIGKILL, which left the build's lock behind); a busy port
fails before the model loads. SIGHUP while serving: test_http_cli.py.

Each server gets a fresh cache, so that the real kernels must build (it is stopped long before
they finish) or the bundled GGUF must convert.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from processes import group_is_gone
from tiny_gguf import write_tiny_gguf

from shoal.loading.loader import bundled_model_path


async def start_serve(cache: Path, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shoal", "serve", "--port", "0", *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "SHOAL_CACHE_DIR": str(cache)},
    )  # fmt: skip


async def read_until(stream: asyncio.StreamReader, pattern: str, timeout_s: float) -> re.Match:
    """Read `stream` (in chunks: a progress bar ends its updates with \\r, not \\n) until
    `pattern` appears in what was read."""
    seen = b""

    async def find() -> re.Match:
        nonlocal seen
        while True:
            chunk = await stream.read(4096)
            assert chunk, f"the stream ended before {pattern!r}: {seen.decode(errors='replace')}"
            seen += chunk
            found = re.search(pattern, seen.decode(errors="replace"))
            if found:
                return found

    return await asyncio.wait_for(find(), timeout_s)


def processes_working_in(folder: Path) -> list[int]:
    """Live processes whose working directory is under `folder` (ninja and the compilers run in
    the build's private folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cwd = os.readlink(entry / "cwd")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if cwd.startswith(str(folder)) and state != "Z":
            found.append(int(entry.name))
    return found


async def stopped_within_5_s(proc: asyncio.subprocess.Process, sig: signal.Signals) -> str:
    assert proc.stderr is not None
    proc.send_signal(sig)
    began = time.monotonic()
    code = await asyncio.wait_for(proc.wait(), 30)
    took_s = time.monotonic() - began
    rest = (await proc.stderr.read()).decode(errors="replace")
    assert took_s < 5, f"{sig.name} took {took_s:.1f} s to stop the start: {rest}"
    assert code == 0, rest
    assert "start-up cancelled" in rest, rest
    assert "Traceback" not in rest, rest
    return rest


def leftovers(cache: Path) -> list[Path]:
    return [p for p in cache.rglob(".*") if ".tmp-" in p.name or p.name.endswith(".lock")]


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: no kernel build")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_during_the_kernel_build_stops_the_start_within_5_s(
    tiny_folder: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    cache = tmp_path / "cache"
    proc = await start_serve(cache, "--model", str(tiny_folder), "--attention", "cpu")
    try:
        assert proc.stderr is not None
        found = await read_until(
            proc.stderr, r"building the CPU kernels into \S+ \(process group (\d+)", 120
        )
        await stopped_within_5_s(proc, sig)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert group_is_gone(int(found[1]))
    assert processes_working_in(cache) == []
    assert leftovers(cache) == []
    assert list((cache / "kernels").iterdir()) == []


async def test_a_signal_during_the_conversion_stops_the_start_within_5_s(tmp_path: Path) -> None:
    """SIGHUP, which killed the process at once before, now stops the start as SIGTERM does."""
    try:
        bundled_model_path()
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    cache = tmp_path / "cache"
    proc = await start_serve(cache, "--attention", "torch")
    try:
        assert proc.stderr is not None
        await read_until(proc.stderr, r"dequantizing", 120)
        await stopped_within_5_s(proc, signal.SIGHUP)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert list(cache.iterdir()) == []  # no temporary folder, no lock, nothing converted


async def test_a_busy_port_fails_before_the_model_loads(tiny_folder: Path, tmp_path: Path) -> None:
    """A GGUF model in a fresh cache: had the start loaded it, its conversion would be there."""
    gguf_path = write_tiny_gguf(tiny_folder, tmp_path / "tiny.gguf", quantize=False)
    cache = tmp_path / "cache"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shoal", "serve", "--model", str(gguf_path),
            "--port", str(port), "--attention", "torch",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "SHOAL_CACHE_DIR": str(cache)},
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 2
    assert err.decode() == f"error: cannot listen on 127.0.0.1:{port}: address already in use\n"
    assert not cache.exists() or list(cache.iterdir()) == []
