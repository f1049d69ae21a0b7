"""The KV cache's tensors: K and V of every layer, one token a slot (pages are the cache
manager's bookkeeping over these slots; kernels/attention.py reads them)."""

from __future__ import annotations

import torch

from shoal.loading.config import ModelConfig


class KVPool:
    """K and V tensors for every layer (or a pipeline stage's `num_layers` of them):
    [num_slots, num_kv_heads, head_dim] each. Stages share the slots: a page is the same
    page in every stage's pool."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        num_layers: int | None = None,
    ) -> None:
        shape = (num_slots, config.num_kv_heads, config.head_dim)
        layers = config.num_layers if num_layers is None else num_layers
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.num_slots = num_slots
