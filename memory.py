"""How many tokens the KV pool holds when `kv_cache_tokens` is unset: a fixed number off CUDA,
on CUDA what the device's memory leaves after the weights and a step's working memory.

    pool   = GPU_MEMORY_FRACTION x available - weights - workspace           (bytes)
    tokens = pool // kv_per_token, at most max_running_requests full contexts

`measure_device_memory` reads the device once at start, before the weights are uploaded;
`kv_cache_tokens` is plain arithmetic over what it read (tested on CPU with made-up figures).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shoal.config import EngineOptions
    from shoal.loading.config import ModelConfig

CPU_KV_CACHE_TOKENS = 32768  # kv_cache_tokens unset, off CUDA
GPU_MEMORY_FRACTION = 0.9  # kv_cache_tokens unset, on CUDA: of the memory the device can give
WORKSPACE_SLACK_BYTES = 2**30  # graph pools, Triton's split buffers, allocator fragmentation


@dataclass(frozen=True)
class DeviceMemory:
    """In bytes. available: free device memory plus what torch's allocator holds unused;
    weights: the model's parameters in the engine's dtype; workspace: a step's activations
    and logits, RoPE tables, WORKSPACE_SLACK_BYTES; kv_per_token: K and V of one token over
    every layer."""

    available: int
    weights: int
    workspace: int
    kv_per_token: int

    def kv_tokens(self) -> int:
        pool = int(GPU_MEMORY_FRACTION * self.available) - self.weights - self.workspace
        return max(0, pool) // self.kv_per_token


def kv_cache_tokens(options: EngineOptions, model_context: int, memory: DeviceMemory | None) -> int:
    """The pool's tokens: as given; unset, CPU_KV_CACHE_TOKENS without `memory` (off CUDA),
    else what `memory` leaves, capped at a full context for every running request (more
    could only ever hold prefix-cached pages)."""
    if options.kv_cache_tokens is not None:
        return options.kv_cache_tokens
    if memory is None:
        return CPU_KV_CACHE_TOKENS
    fits = memory.kv_tokens()
    if fits < 2 * options.page_size:
        gib = 2**30
        raise ValueError(
            f"no GPU memory is left for the KV cache ({memory.available / gib:.1f} GiB "
            f"available, weights {memory.weights / gib:.1f} GiB, working memory "
            f"{memory.workspace / gib:.1f} GiB): set kv_cache_tokens"
        )
    context = min(options.context_length or model_context, model_context)
    full = options.max_running_requests * (context + options.page_size)
    return min(fits, full)


def measure_device_memory(
    config: ModelConfig,
    options: EngineOptions,
    num_weights: int,
    dtype: torch.dtype,
    device: torch.device,
) -> DeviceMemory:
    """The device's memory before the weights are uploaded (`num_weights` parameters, each
    stored in `dtype`). Collects garbage first: an engine closed in this process may hold
    its pool until then."""
    gc.collect()
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    width = dtype.itemsize
    rows = options.max_running_requests
    tokens = max(options.max_batch_tokens, rows)
    activations = 8 * tokens * (config.hidden_size + config.intermediate_size) * width
    logits = 4 * 4 * rows * config.vocab_size  # float32: logits, their copy, probs, noise
    rope = 2 * config.max_position_embeddings * config.head_dim * width
    workspace = WORKSPACE_SLACK_BYTES + activations + logits + rope
    kv_per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * width
    return DeviceMemory(free + idle, num_weights * width, workspace, kv_per_token)
