"""Shared fixtures: a tiny random Llama (folder, loaded weights, HF reference, a second one with
other weights), engines and servers on it, the CPU kernels (built before a test starts servers
that need them). The helpers the tests import live in support/ (on sys.path: pyproject.toml's
`pythonpath`); a folder's own fixtures in its conftest.py.

The tests use a cache of their own unless SHOAL_CACHE_DIR is set: `<venv>/shoal-test-cache`
(beside the environment whose torch the kernels are built for; ~/.cache/shoal-tests outside a
virtual environment), so a test run never shares, or rebuilds, the user's ~/.cache/shoal. It is
set in the environment, so the servers the tests start as subprocesses use it too.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault(
    "SHOAL_CACHE_DIR",
    str(
        Path(sys.prefix) / "shoal-test-cache"
        if sys.prefix != sys.base_prefix
        else Path.home() / ".cache" / "shoal-tests"
    ),
)
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton kernels run on CPU only under the interpreter; it must be set before they are
    # defined (imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(2)

from engines import EngineFactory  # noqa: E402
from reference import Reference  # noqa: E402
from tiny_model import make_tiny_model_folder  # noqa: E402

from shoal.actors.scheduler import speculation  # noqa: E402
from shoal.api.engine import Engine  # noqa: E402
from shoal.api.http.server import Server, ServerOptions  # noqa: E402
from shoal.kernels.cpu_kernels import CpuKernels, KernelUnavailable, load_cpu_kernels  # noqa: E402
from shoal.loading.loader import default_cache_dir  # noqa: E402
from shoal.models.load import LoadedModel, load_model  # noqa: E402

if TYPE_CHECKING:
    from served import Served, ServeFactory


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def prebuilt_cpu_kernels() -> Path:
    """The test cache, with the CPU kernels built (once per environment: kernel_build.py's
    key), so that a server a test starts loads them instead of building them in its wait.
    Without a compiler they cannot be, and the servers fall back as the fixture does."""
    with contextlib.suppress(KernelUnavailable):
        load_cpu_kernels(default_cache_dir())
    return default_cache_dir()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_folder(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model(tiny_folder: Path) -> LoadedModel:
    return load_model(tiny_folder, progress=False)


@pytest.fixture(scope="session")
def other_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the tiny model's architecture with other weights (another seed)."""
    return make_tiny_model_folder(tmp_path_factory.mktemp("tiny-llama-other"), seed=1)


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    """The compiled CPU kernels (built once per environment; an error without a compiler)."""
    return load_cpu_kernels(default_cache_dir())


@pytest.fixture(scope="session")
def tiny_reference(tiny_folder: Path, tiny_model: LoadedModel) -> Reference:
    return Reference(tiny_folder, tiny_model.config.eos_token_ids)


@pytest.fixture
def eager_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every n-gram match worth 2 drafts at first, however long (each of speculation.py's match
    classes starting at one in two kept): the tiny random models seldom copy their prompts for
    long, and the tests of what a verification does need drafts sent."""
    monkeypatch.setattr(speculation, "PRIOR_KEPT", (1.0,) * len(speculation.PRIOR_KEPT))


@pytest.fixture
async def make_engine(tiny_model: LoadedModel) -> AsyncIterator[EngineFactory]:
    """Start engines on the tiny model; after the test each must be idle with no leaks."""
    engines: list[Engine] = []

    async def make(model: LoadedModel | None = None, **options: Any) -> Engine:
        options.setdefault("strict_integrity", True)
        options.setdefault("seed", 0)
        # The tests hold greedy tokens to transformers' in float32: on a CPU with AMX or
        # AVX512-BF16 dtype auto is bfloat16 (resolve_options.py), whose own tests ask for it
        # (tests/kernels/test_bf16.py).
        options.setdefault("dtype", "float32")
        engine = await Engine(model or tiny_model, **options).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        try:
            if engine.dead_reason is None:
                await engine.check_integrity()
                stats = await engine.cache_stats()
                assert stats.free_rows == stats.total_rows
                assert stats.request_pages == 0 and stats.locked_pages == 0
        finally:
            await engine.close()


@pytest.fixture
async def serve(make_engine: EngineFactory) -> AsyncIterator[ServeFactory]:
    """Start servers (support/served.py) on engines from make_engine; stopped after the test,
    before make_engine's checks, and no HTTP job may outlive its request."""
    # Imported here: the openai client is only the servers' (bench/gpu_check.sh runs the
    # kernel and executor tests where it is not installed).
    import openai
    from served import MODEL, SERVER_FIELDS, Served

    started: list[Served] = []

    async def start(**options: Any) -> Served:
        server_options = {k: options.pop(k) for k in list(options) if k in SERVER_FIELDS}
        server_options.setdefault("port", 0)
        server_options.setdefault("served_model_name", MODEL)
        engine = await make_engine(**options)
        server = Server(engine, ServerOptions(**server_options))
        await server.start()
        key = server_options.get("api_key") or "unused"
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        served = Served(engine, server, client, aiohttp.ClientSession())
        started.append(served)
        return served

    yield start
    for served in started:
        await served.client.close()
        await served.http.close()
        await served.server.stop()
        assert not served.server.gateway.jobs, "a job outlived its HTTP request"
