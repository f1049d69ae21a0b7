"""What the model forward needs from an attention implementation, and the batch it describes.

A step's attention is prepared once from the device page table and the host's view of the
ragged batch (`BatchShape`), then used by every layer:

    attention = backend.prepare(page_table, shape)     # torch reference or Triton
    attention.store(k_cache, v_cache, k, v)            # new tokens' K/V into their slots
    out = attention.attend(q, k_cache, v_cache, scale)  # [T, H, D]
    out = attention.attend(q, k_cache, v_cache, scale, window=4096, softcap=50.0)

A layer with a sliding window of W keys lets the query at position p see the keys
p - W < k <= p (transformers' sliding_window_overlay); keys before a sequence's window are
never read, so their pages may already be freed and reused. softcap c replaces the logits
by c * tanh(logits / c) before the mask and softmax (Gemma 2's eager attention). Layers of one
step may pass different windows (Gemma alternates a window and None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class BatchShape:
    """A ragged batch as the host sees it, one entry per sequence, in token order:
    sequence i brings extend_lens[i] new tokens at positions prefix_lens[i] .. of row rows[i]."""

    rows: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


class Attention(Protocol):
    def store(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None: ...

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor: ...


class AttentionBackend(Protocol):
    name: str

    def prepare(self, page_table: torch.Tensor, shape: BatchShape) -> Attention: ...
