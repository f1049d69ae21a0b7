"""The compiled prompt-chunk attention (kernels/csrc/paged_extend.cpp) against the torch
reference (gather and SDPA): chunks with and without a cached prefix, beside decodes, over
float32 and bfloat16 caches, heads of whole vectors and not; windowed and soft-capped layers
keep the reference; bad indices are refused before anything is read."""

from __future__ import annotations

import pytest
import torch
from dense_attention import dense_outputs
from test_cpu_kernels import random_step

from shoal.actors.device_build import attention_backend
from shoal.kernels.attention import TorchAttention
from shoal.kernels.cpu_kernels import CpuKernels

PREFIX_LENS = [0, 150, 7, 0, 9, 299, 1, 40, 0, 31]
EXTEND_LENS = [1, 1, 37, 5, 100, 1, 2, 64, 190, 33]


def backends(kernels: CpuKernels, page: int) -> tuple[TorchAttention, TorchAttention]:
    reference = TorchAttention(page, kernels.paged_decode, kernels.store_kv)
    fused = TorchAttention(page, kernels.paged_decode, kernels.store_kv, kernels.paged_extend)
    return reference, fused


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page"),
    [(9, 3, 64, 16), (6, 2, 8, 4), (4, 4, 20, 1), (8, 1, 128, 16), (32, 2, 64, 16)],
)
def test_extend_kernel_equals_the_reference(
    kernels: CpuKernels, kv_dtype: torch.dtype, heads: int, kv_heads: int, dim: int, page: int
) -> None:
    """Fresh prompts (5 .. 190 tokens: one to several key blocks and position blocks), chunks
    after a cached prefix of 1 .. 40 tokens, two-token chunks, beside decodes. Query heads a KV
    head of 3 (SmolLM2), 3, 1, 8 and 16 (more rows than a pass's vectors hold); heads of 8 and
    20 (not whole vectors: zero padded), 64 and 128."""
    gen = torch.Generator().manual_seed(heads * dim + page)
    step = random_step(gen, PREFIX_LENS, EXTEND_LENS, heads, kv_heads, dim, page)
    k_cache, v_cache = step.k_cache.to(kv_dtype), step.v_cache.to(kv_dtype)
    reference, fused = (b.prepare(step.page_table, step.shape) for b in backends(kernels, page))
    assert fused.kernel_extends is not None and reference.kernel_extends is None
    fused.store(k_cache, v_cache, step.k_new, step.v_new)
    expected = reference.attend(step.q, k_cache, v_cache, dim**-0.5)
    got = fused.attend(step.q, k_cache, v_cache, dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(("window", "softcap"), [(7, None), (None, 5.0), (41, 5.0)])
def test_windowed_or_capped_layers_keep_the_reference(
    kernels: CpuKernels, window: int | None, softcap: float | None
) -> None:
    """A layer with a sliding window or soft-capped logits (Mistral, Gemma 2) attends its chunks
    through the reference, which the kernel cannot do: the same answer as dense attention."""
    page, dim = 4, 16
    gen = torch.Generator().manual_seed(5)
    step = random_step(gen, PREFIX_LENS, EXTEND_LENS, 6, 2, dim, page)
    meta = backends(kernels, page)[1].prepare(step.page_table, step.shape)
    meta.store(step.k_cache, step.v_cache, step.k_new, step.v_new)
    got = meta.attend(step.q, step.k_cache, step.v_cache, dim**-0.5, window, softcap)
    expected = dense_outputs(step.q, step.k_cache, step.v_cache, step.page_table, step.shape,
                             page, dim**-0.5, window or 10**6, softcap)  # fmt: skip
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_bad_indices_are_refused(kernels: CpuKernels) -> None:
    """A page id out of range, more new tokens than the sequence holds, token rows past q:
    refused with a message, before anything is read."""
    page, dim = 4, 16
    gen = torch.Generator().manual_seed(3)
    step = random_step(gen, [3, 0], [5, 9], 6, 2, dim, page)
    extends = backends(kernels, page)[1].prepare(step.page_table, step.shape).kernel_extends
    assert extends is not None
    out = torch.empty(step.q.shape)

    def run(page_ids: torch.Tensor, seq_lens: torch.Tensor, num_new: torch.Tensor,
            starts: torch.Tensor) -> None:  # fmt: skip
        kernels.paged_extend(step.q, step.k_cache, step.v_cache, page_ids, seq_lens, num_new,
                             starts, page, dim**-0.5, out)  # fmt: skip

    run(extends.page_ids, extends.seq_lens, extends.num_new, extends.token_start)
    bad_page = extends.page_ids.clone()
    bad_page[1, 0] = 10**9
    with pytest.raises(RuntimeError, match="page id out of range"):
        run(bad_page, extends.seq_lens, extends.num_new, extends.token_start)
    with pytest.raises(RuntimeError, match="new tokens out of range"):
        run(extends.page_ids, extends.seq_lens, extends.seq_lens + 1, extends.token_start)
    with pytest.raises(RuntimeError, match="token rows out of range"):
        run(extends.page_ids, extends.seq_lens, extends.num_new, extends.token_start + 5)


def test_the_cpu_backend_attends_chunks_with_the_kernel(kernels: CpuKernels) -> None:
    """The engine's "cpu" backend carries the extend kernel; the torch backend does not."""
    backend = attention_backend("cpu", 16, 3, kernels)
    assert isinstance(backend, TorchAttention)
    assert backend.extend_kernel is kernels.paged_extend
    assert attention_backend("torch", 16, 3, None).extend_kernel is None  # type: ignore[attr-defined]
