"""Paged attention on the CPU and its torch reference (Triton kernels must match these): a step's
metadata, built once and shared by its layers (the computation: paged_reference.py).

KV layout, one pair of tensors per layer::

    k_cache[layer]: [num_pages * page_size, num_kv_heads, head_dim]   (a "slot" = one token)
    slot = page_table[row, pos // page_size] * page_size + pos % page_size

A forward step carries a ragged batch of sequences. Sequence i contributes
`extend_lens[i]` new tokens at positions `prefix_lens[i] ..` and attends to all
`seq_lens[i] = prefix_lens[i] + extend_lens[i]` tokens of its row (the cached prefix
read from pages, the new tokens causally). A decode step is the case extend_len == 1.
New K/V are stored first, so attention reads everything from the pages.

Decodes go one of two ways: with a compiled kernel (cpu_kernels.py, the CPU default) all of a
step's decodes are one call that reads the pages in place; without one they are gathered page by
page into padded length groups and attended with SDPA. Multi-token chunks likewise: with the
compiled extend kernel all of a step's chunks are one call (csrc/paged_extend.cpp), except in a
layer with a sliding window or soft-capped logits; else each is gathered and given to SDPA.

A layer may attend through a sliding window of W keys (a query at position p sees the keys
p - W < k <= p; Mistral, Gemma, Phi-3) and soft-cap its logits (Gemma 2: scores become
c * tanh(scores / c) before the mask). Pages wholly before a sequence's window may already be
freed and reused, so nothing reads them: the gathers start at the window's first page
(`window_views`, built once per step and window) and the compiled kernel at its first key.
Soft-capped logits take an explicit softmax (paged_reference.py), as SDPA has no cap.
A bfloat16 cache (`kv_cache_dtype`): stores round into it, the gathers widen what they read
(docs/cpu-step.md: why not SDPA in bfloat16); the compiled kernels read it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shoal.kernels.attention_views import (
    DecodePages,
    ExtendSeq,
    Views,
    length_groups,
    window_views,
)
from shoal.kernels.batch import BatchShape
from shoal.kernels.cpu_kernels import DecodeKernel, ExtendKernel, StoreKernel
from shoal.kernels.kernel_views import KernelDecodes, KernelExtends
from shoal.kernels.paged_reference import paged_attention


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything a layer needs to attend; built once per step, shared by all layers.

    `decodes` and `extends` attend to whole sequences; a layer with a sliding window gets
    views trimmed to the window's pages, built on its first call and kept for the step."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    page_size: int
    decodes: tuple[DecodePages, ...]
    extends: tuple[ExtendSeq, ...]
    kernel_decodes: KernelDecodes | None = None  # set: `decodes` is empty
    store_kernel: StoreKernel | None = None  # compiled store_kv (cpu_kernels.py), else torch's
    max_seq_len: int = 0  # a window at least this long masks nothing
    kernel_extends: KernelExtends | None = None  # `extends` too, for an unwindowed, uncapped layer
    windowed: dict[int, Views] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.numel())

    def store(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        if self.store_kernel is not None:
            self.store_kernel(k_cache, v_cache, self.slot_mapping, k, v)
        else:
            store_kv(k_cache, v_cache, self.slot_mapping, k, v)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D] -> [T, H, D]. window W: a query at position p sees keys p - W < k <= p;
        softcap c: scores become c * tanh(scores / c) before the mask (Gemma 2)."""
        assert window is None or window >= 1, f"window {window}"
        assert softcap is None or softcap > 0, f"softcap {softcap}"
        views = Views(self.decodes, self.extends)
        if window is not None and window < self.max_seq_len:
            if window not in self.windowed:
                self.windowed[window] = window_views(views, window, self.page_size)
            views = self.windowed[window]
        else:
            window = None
        extends = self.kernel_extends if window is None and softcap is None else None
        if extends is not None:
            views = Views(views.decodes, ())
        return paged_attention(
            q, k_cache, v_cache, views, self.kernel_decodes, self.page_size, scale, window,
            softcap, extends,
        )  # fmt: skip


class TorchAttention:
    """The reference backend: gathers each sequence's pages and calls SDPA (any device); with
    a decode kernel (the "cpu" backend), decodes go to the kernel instead, and with an extend
    kernel, chunks."""

    def __init__(
        self,
        page_size: int,
        decode_kernel: DecodeKernel | None = None,
        store_kernel: StoreKernel | None = None,
        extend_kernel: ExtendKernel | None = None,
    ) -> None:
        self.page_size = page_size
        self.decode_kernel = decode_kernel
        self.store_kernel = store_kernel
        self.extend_kernel = extend_kernel
        self.name = "torch" if decode_kernel is None else "cpu"

    def prepare(self, page_table: torch.Tensor, shape: BatchShape) -> AttentionMetadata:
        rows = torch.tensor(shape.rows, dtype=torch.int64, device=page_table.device)
        return build_metadata(
            page_table[rows],
            list(shape.prefix_lens),
            list(shape.extend_lens),
            self.page_size,
            self.decode_kernel,
            self.store_kernel,
            self.extend_kernel,
        )


def build_metadata(
    page_table_rows: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    page_size: int,
    decode_kernel: DecodeKernel | None = None,
    store_kernel: StoreKernel | None = None,
    extend_kernel: ExtendKernel | None = None,
) -> AttentionMetadata:
    """page_table_rows: [B, max_pages] page ids of each sequence's row (host tensor).

    No per-token Python work: the slots of the new tokens are computed as tensors, decodes are
    gathered as whole pages, and only sequences with more than one new token are visited."""
    device = page_table_rows.device
    num_seqs = len(extend_lens)
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    new_counts = torch.tensor(extend_lens, dtype=torch.int64, device=device)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), new_counts)
    first_token = torch.cumsum(new_counts, 0) - new_counts
    prefix_t = torch.tensor(prefix_lens, dtype=torch.int64, device=device)
    token = torch.arange(len(seq_of_token), device=device)
    positions = prefix_t[seq_of_token] + token - first_token[seq_of_token]
    pages = page_table_rows.to(torch.int64)
    slot_mapping = pages[seq_of_token, positions // page_size] * page_size + positions % page_size

    decode_ids = [i for i, n in enumerate(extend_lens) if n == 1]
    kernel_decodes = None
    if decode_kernel is not None and decode_ids:
        kernel_decodes = KernelDecodes.of(decode_kernel, decode_ids, pages, first_token, seq_lens,
                                          page_size)  # fmt: skip
        decode_ids = []
    decodes = []
    for group in length_groups(decode_ids, seq_lens, page_size):
        dec_lens = torch.tensor([seq_lens[i] for i in group], device=device)
        max_pages = -(-max(seq_lens[i] for i in group) // page_size)
        ids = torch.tensor(group, dtype=torch.int64, device=device)
        key_pos = torch.arange(max_pages * page_size, device=device)
        decodes.append(
            DecodePages(
                token_index=first_token[ids],
                page_ids=pages[ids, :max_pages],
                key_mask=(key_pos[None, :] < dec_lens[:, None]).view(len(group), 1, 1, -1),
                seq_lens=dec_lens,
            )
        )
    extends = []
    token_start = 0
    for i, (prefix, n_new) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        if n_new > 1:
            seq_len = seq_lens[i]
            mask = None
            if prefix > 0:
                query_pos = torch.arange(prefix, seq_len, device=device)
                key_pos = torch.arange(seq_len, device=device)
                mask = key_pos[None, :] <= query_pos[:, None]
            page_ids = pages[i, : -(-seq_len // page_size)]
            extends.append(ExtendSeq(token_start, n_new, seq_len, page_ids, mask))
        token_start += n_new
    kernel_extends = None
    if extend_kernel is not None and extends:
        chunk_ids = [i for i, n in enumerate(extend_lens) if n > 1]
        kernel_extends = KernelExtends.of(extend_kernel, chunk_ids, pages, first_token, new_counts,
                                          seq_lens, page_size)  # fmt: skip
    return AttentionMetadata(
        slot_mapping, page_size, tuple(decodes), tuple(extends), kernel_decodes, store_kernel,
        max(seq_lens, default=0), kernel_extends=kernel_extends,
    )  # fmt: skip


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write the new tokens' K/V ([T, Hkv, D]) into their slots (rounded to the cache's dtype)."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
