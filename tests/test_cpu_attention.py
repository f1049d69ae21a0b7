"""The compiled CPU decode kernel (kernels/csrc/paged_decode.cpp) against the torch reference,
its refusals of bad indices, and how the engine picks it or falls back."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from shoal.actors.wiring import attention_backend
from shoal.api.engine import Engine
from shoal.kernels import cpu_attention
from shoal.kernels.attention import TorchAttention
from shoal.kernels.batch import BatchShape
from shoal.kernels.cpu_attention import DecodeKernel, KernelUnavailable, load_decode_kernel
from shoal.kernels.loader import LoadedModel, default_cache_dir
from shoal.params import SamplingParams


@pytest.fixture(scope="module")
def kernel() -> DecodeKernel:
    return load_decode_kernel(default_cache_dir())


class Step(NamedTuple):
    page_table: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    shape: BatchShape
    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor


def random_step(
    gen: torch.Generator, prefix_lens: list[int], extend_lens: list[int], heads: int,
    kv_heads: int, dim: int, page: int,
) -> Step:  # fmt: skip
    num_pages = 1200
    k_cache = torch.randn(num_pages * page, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_pages * page, kv_heads, dim, generator=gen)
    max_pages = max(-(-(p + n) // page) for p, n in zip(prefix_lens, extend_lens, strict=True))
    page_ids = torch.randperm(num_pages, generator=gen)[: len(prefix_lens) * max_pages]
    page_table = page_ids.view(len(prefix_lens), max_pages)
    shape = BatchShape(tuple(range(len(prefix_lens))), tuple(prefix_lens), tuple(extend_lens))
    total = sum(extend_lens)
    # q as the model hands it over: a view of the rotated [T, H + Hkv, D] tensor.
    q = torch.randn(total, heads + kv_heads, dim, generator=gen)[:, :heads]
    k_new = torch.randn(total, kv_heads, dim, generator=gen)
    v_new = torch.randn(total, kv_heads, dim, generator=gen)
    return Step(page_table, k_cache, v_cache, shape, q, k_new, v_new)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page"),
    [(9, 3, 64, 16), (6, 2, 8, 4), (4, 4, 20, 8), (8, 1, 128, 16)],
)
def test_kernel_equals_the_reference(
    kernel: DecodeKernel, heads: int, kv_heads: int, dim: int, page: int
) -> None:
    """Decodes of lengths 1..300 (several of the reference's length groups), beside a prefill
    chunk with a cached prefix and a fresh prompt that the kernel must leave alone."""
    gen = torch.Generator().manual_seed(heads * dim + page)
    prefix_lens = [0, 150, 7, 0, 9, 299, 1, 40, 63]
    extend_lens = [1, 1, 1, 5, 4, 1, 1, 1, 1]
    table, k_cache, v_cache, shape, q, k_new, v_new = random_step(
        gen, prefix_lens, extend_lens, heads, kv_heads, dim, page
    )
    reference = TorchAttention(page).prepare(table, shape)
    fused = TorchAttention(page, kernel).prepare(table, shape)
    assert fused.kernel_decodes is not None and not fused.decodes and len(reference.decodes) > 1
    reference.store(k_cache, v_cache, k_new, v_new)
    expected = reference.attend(q, k_cache, v_cache, dim**-0.5)
    got = fused.attend(q, k_cache, v_cache, dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bad_indices_are_refused_before_any_read(kernel: DecodeKernel) -> None:
    gen = torch.Generator().manual_seed(1)
    step = random_step(gen, [5, 20], [1, 1], 6, 2, 8, 4)
    q, k_cache, v_cache = step.q, step.k_cache, step.v_cache
    meta = TorchAttention(4, kernel).prepare(step.page_table, step.shape)
    fused = meta.kernel_decodes
    assert fused is not None
    out = torch.empty(q.shape)
    cases = {
        "page id out of range": (fused.page_ids + 10_000, fused.seq_lens, fused.token_index),
        "length out of range": (fused.page_ids, fused.seq_lens + 1_000, fused.token_index),
        "token index out of range": (fused.page_ids, fused.seq_lens, fused.token_index + 7),
    }
    for message, (pages, lens, tokens) in cases.items():
        with pytest.raises(RuntimeError, match=message):
            kernel(q, k_cache, v_cache, pages, lens, tokens, 4, 0.5, out)
    with pytest.raises(RuntimeError, match="int64"):
        kernel(q, k_cache, v_cache, fused.page_ids.int(), fused.seq_lens, fused.token_index, 4,
               0.5, out)  # fmt: skip


def test_a_failed_build_falls_back_under_auto_and_fails_when_asked_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    def no_compiler(cache_dir: Path) -> DecodeKernel:
        raise KernelUnavailable("the CPU attention kernel could not be built: no compiler")

    monkeypatch.setattr("shoal.actors.wiring.load_decode_kernel", no_compiler)
    with caplog.at_level(logging.WARNING, logger="shoal"):
        backend = attention_backend("cpu", 16, 3, tmp_path, asked="auto")
    assert backend.name == "torch" and "no compiler" in caplog.text
    with pytest.raises(ValueError, match=r"attention cpu: .*no compiler"):
        attention_backend("cpu", 16, 3, tmp_path, asked="cpu")


def test_the_build_names_the_cpu_capability() -> None:
    assert cpu_attention.capability() in cpu_attention.CAPABILITY_FLAGS
    assert cpu_attention.SOURCE.is_file()  # shipped with the package (package-data)


async def test_the_engine_decodes_with_the_kernel_as_with_the_reference(
    tiny_model: LoadedModel,
) -> None:
    """Greedy tokens of a few prompts, the kernel against the torch reference, in one engine
    each; the kernel's sums differ from SDPA's only in the last bits."""
    prompts = [[5, 6, 7], list(range(10, 60)), [3] * 17]
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    results = {}
    for attention in ("cpu", "torch"):
        async with Engine(tiny_model, attention=attention) as engine:
            assert engine.resolved is not None and engine.resolved.attention == attention
            outs = [await engine.generate(input_ids=p, sampling=params).result() for p in prompts]
            results[attention] = [o.token_ids for o in outs]
    assert results["cpu"] == results["torch"]
