"""Shared fixtures: a tiny random Llama (folder, loaded weights, HF reference), engines, the
CPU kernels built before a test starts servers that need them.

The tests use a cache of their own unless SHOAL_CACHE_DIR is set: `<venv>/shoal-test-cache`
(beside the environment whose torch the kernels are built for; ~/.cache/shoal-tests outside a
virtual environment), so a test run never shares, or rebuilds, the user's ~/.cache/shoal. It is
set in the environment, so the servers the tests start as subprocesses use it too.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

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

from tiny_model import make_tiny_model_folder  # noqa: E402

from shoal.api.engine import Engine  # noqa: E402
from shoal.kernels.cpu_kernels import KernelUnavailable, load_cpu_kernels  # noqa: E402
from shoal.loading.loader import default_cache_dir  # noqa: E402
from shoal.models.load import LoadedModel, load_model  # noqa: E402


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


class Reference:
    """Greedy continuations from transformers `generate(do_sample=False)`, memoized."""

    def __init__(self, folder: Path, eos_token_ids: Sequence[int]) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
        self.model.eval()
        self.eos = list(eos_token_ids)
        self.memo: dict[tuple[Any, ...], list[int]] = {}

    def greedy(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        ignore_eos: bool = False,
        logit_bias: Mapping[int, float] | None = None,
    ) -> list[int]:
        """logit_bias: added to each token's logit at every step (OpenAI's meaning), by HF's
        sequence_bias over single tokens."""
        bias = tuple(sorted((logit_bias or {}).items()))
        key = (tuple(prompt), max_new_tokens, ignore_eos, bias)
        if key not in self.memo:
            ids = torch.tensor([list(prompt)])
            with torch.no_grad():
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=None if ignore_eos else self.eos,
                    pad_token_id=self.eos[0] if self.eos else 0,
                    sequence_bias={(token,): value for token, value in bias} or None,
                )
            new = out[0, ids.shape[1] :].tolist()
            if not ignore_eos:
                for i, t in enumerate(new):
                    if t in self.eos:
                        new = new[: i + 1]
                        break
            self.memo[key] = new
        return self.memo[key]


@pytest.fixture(scope="session")
def tiny_reference(tiny_folder: Path, tiny_model: LoadedModel) -> Reference:
    return Reference(tiny_folder, tiny_model.config.eos_token_ids)


EngineFactory = Callable[..., Any]


@pytest.fixture
async def make_engine(tiny_model: LoadedModel) -> AsyncIterator[EngineFactory]:
    """Start engines on the tiny model; after the test each must be idle with no leaks."""
    engines: list[Engine] = []

    async def make(model: LoadedModel | None = None, **options: Any) -> Engine:
        options.setdefault("strict_integrity", True)
        options.setdefault("seed", 0)
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
