"""Start a server for bench/serving.py as a subprocess and stop it afterwards.

    async with launch("shoal", model=None, threads=2) as server:      # server.base_url
        ...

`shoal`: `python -m shoal serve --port P`, ready when it prints "shoal serving NAME at URL".
`llamacpp`: `python -m llama_cpp.server --model GGUF --port P --n_threads T`, ready when
`GET /v1/models` answers; `eos_ids_of` gives the ids to ban there (it has no ignore_eos).
`missing("llamacpp")` says why a system cannot start (not installed),
so the caller can skip it with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

SYSTEMS = ("shoal", "llamacpp")


@dataclass(frozen=True)
class Launched:
    system: str
    base_url: str
    startup_s: float


def missing(system: str) -> str | None:
    """Why `system` cannot be launched here, or None when it can."""
    if system == "llamacpp":
        if importlib.util.find_spec("llama_cpp") is None:
            return (
                "llama_cpp is not installed (CMAKE_ARGS=... pip install "
                "'llama-cpp-python[server]', see bench/README.md)"
            )
        if importlib.util.find_spec("llama_cpp.server") is None:
            return "llama_cpp.server is missing (install 'llama-cpp-python[server]')"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gguf_path(model: str | None) -> Path:
    """llama.cpp needs a GGUF file: the one given, or the bundled SmolLM2's."""
    if model is not None:
        if not model.endswith(".gguf"):
            raise SystemExit(f"llamacpp needs a .gguf model, got {model}")
        return Path(model)
    from shoal.kernels.loader import bundled_model_path

    return bundled_model_path()


EOG_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<eos>")


def eos_ids_of(model: str | None) -> list[int]:
    """Token ids that end generation in llama.cpp, to ban on servers without ignore_eos: the
    GGUF's eos / eot ids and the usual end-of-generation tokens of its vocabulary."""
    if model is not None and not model.endswith(".gguf"):
        return []
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path(model))
    ids = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        f = reader.fields.get(key)
        if f is not None:
            ids.add(int(f.parts[f.data[0]][0]))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        for token_id, part in enumerate(tokens.data):
            if bytes(tokens.parts[part]).decode(errors="replace") in EOG_TEXTS:
                ids.add(token_id)
    return sorted(ids)


def command(system: str, model: str | None, threads: int, port: int) -> list[str]:
    if system == "shoal":
        cmd = [sys.executable, "-m", "shoal", "serve", "--port", str(port)]
        cmd += ["--num-threads", str(threads)]
        return cmd + (["--model", model] if model else [])
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf_path(model)),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--n_ctx",
        "4096",
        "--interrupt_requests",
        "False",  # its default: a new request cuts the running one short
    ]


async def _wait_ready(base_url: str, proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(f"{base_url}/v1/models") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.25)
    raise TimeoutError(f"server at {base_url} not ready in {timeout_s}s")


async def _drain(stream: asyncio.StreamReader | None, log: list[str]) -> None:
    while stream is not None and (line := await stream.readline()):
        log.append(line.decode(errors="replace").rstrip())
        del log[:-50]  # keep the tail for error messages


@contextlib.asynccontextmanager
async def launch(
    system: str, model: str | None, threads: int, timeout_s: float = 600.0
) -> AsyncIterator[Launched]:
    assert system in SYSTEMS, system
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    began = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *command(system, model, threads, port),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    log: list[str] = []
    drain = asyncio.create_task(_drain(proc.stdout, log))
    try:
        try:
            await _wait_ready(base_url, proc, timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            tail = "\n".join(log[-20:])
            raise RuntimeError(f"{system}: {exc}\n{tail}") from exc
        yield Launched(system, base_url, time.perf_counter() - began)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        drain.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drain
