"""The KV cache's tensors: K and V of every layer, one token a slot (pages are the cache
manager's bookkeeping over these slots; kernels/attention.py reads them)."""

from __future__ import annotations

import torch

from shoal.loading.config import ModelConfig
from shoal.models import huge_pages


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
        self.shape = (num_slots, config.num_kv_heads, config.head_dim)
        self.num_layers = config.num_layers if num_layers is None else num_layers
        self.dtype, self.device = dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.released = True
        self.resume()
        self.num_slots = num_slots

    def release(self) -> None:
        """Free the tensors (release_memory_occupation: the cache manager holds no page, its
        cache flushed, and nothing runs until `resume`)."""
        self.k.clear()
        self.v.clear()
        self.released = True

    def resume(self) -> None:
        """Allocate the tensors (zeros), if released; the lists stay the same objects."""
        if self.released:
            for tensors in (self.k, self.v):
                tensors.extend(self._zeros() for _ in range(self.num_layers))
            self.released = False

    def _zeros(self) -> torch.Tensor:
        if self.device.type == "cpu":  # in huge pages where Linux gives them (huge_pages.py)
            return huge_pages.zeros(self.shape, self.dtype)
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
