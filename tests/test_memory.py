"""The KV pool's size when kv_cache_tokens is unset (memory.py): fixed off CUDA, from the
device's memory on CUDA. The arithmetic is checked here with made-up figures; test_cuda.py
checks it against a real device."""

from __future__ import annotations

import pytest

from shoal.config import EngineOptions
from shoal.memory import CPU_KV_CACHE_TOKENS, GPU_MEMORY_FRACTION, DeviceMemory, kv_cache_tokens
from shoal.resolve_options import resolve

GIB = 2**30
# An 8B Llama in bf16 on an 80 GB card: 32 layers x K and V x 8 heads x 128 x 2 bytes a token.
H100 = DeviceMemory(available=79 * GIB, weights=16 * GIB, workspace=2 * GIB, kv_per_token=131072)


def test_unset_off_cuda_is_the_fixed_default() -> None:
    options = EngineOptions(device="cpu")
    assert kv_cache_tokens(options, 8192, None) == CPU_KV_CACHE_TOKENS
    assert resolve(options, 8192).cache.num_pages == CPU_KV_CACHE_TOKENS // options.page_size


def test_a_given_size_wins_over_the_device() -> None:
    assert kv_cache_tokens(EngineOptions(kv_cache_tokens=4096), 8192, H100) == 4096


def test_on_cuda_the_pool_takes_what_the_weights_and_workspace_leave() -> None:
    options = EngineOptions(max_running_requests=256)
    tokens = kv_cache_tokens(options, 131072, H100)
    expected = (int(GPU_MEMORY_FRACTION * 79 * GIB) - 18 * GIB) // 131072
    assert tokens == expected and tokens > 400_000  # 53 GB of KV, 13x the CPU default


def test_on_cuda_the_pool_holds_at_most_every_row_at_full_context() -> None:
    options = EngineOptions(max_running_requests=4, context_length=1000)
    assert kv_cache_tokens(options, 8192, H100) == 4 * (1000 + options.page_size)
    resolved = resolve(options, 8192, H100)
    assert resolved.context_length == 1000
    assert resolved.cache.num_pages * options.page_size >= 4 * 1000


def test_a_device_without_room_for_the_weights_is_a_clear_error() -> None:
    full = DeviceMemory(available=16 * GIB, weights=16 * GIB, workspace=GIB, kv_per_token=131072)
    with pytest.raises(ValueError, match="no GPU memory is left for the KV cache"):
        kv_cache_tokens(EngineOptions(), 8192, full)


def test_unset_is_valid_and_zero_is_not() -> None:
    EngineOptions().validate()
    with pytest.raises(ValueError, match="kv_cache_tokens must be >= 1"):
        EngineOptions(kv_cache_tokens=0).validate()
