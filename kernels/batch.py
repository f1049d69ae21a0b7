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
    sequence i brings extend_lens[i] new tokens at positions prefix_lens[i] .. of row rows[i].
    `drafts`: how many of its tokens are drafts it verifies (a speculating decode is one entry
    a position, its row's last token and then its drafts: step_inputs._shape)."""

    rows: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    drafts: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def kernel_rows(self) -> int | None:
        """The rows the step stands for where a linear picks its kernel by size (int8's,
        kernels/int8_rows.py): its tokens less its drafts, so that a verification's positions
        take the kernel of its row's one decode and keep that decode's bits; None without
        drafts (every token a row)."""
        return self.num_tokens - self.drafts if self.drafts else None


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
