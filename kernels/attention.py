"""Paged attention, torch reference (the CPU path; Triton kernels must match these).

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
page into padded length groups and attended with SDPA. Multi-token chunks always take SDPA.

A layer may attend through a sliding window of W keys (a query at position p sees the keys
p - W < k <= p; Mistral, Gemma, Phi-3) and soft-cap its logits (Gemma 2: scores become
c * tanh(scores / c) before the mask). Pages wholly before a sequence's window may already be
freed and reused, so nothing reads them: the gathers start at the window's first page
(`window_views`, built once per step and window) and the compiled kernel at its first key.
Soft-capped logits take an explicit softmax (`capped_attention`), as SDPA has no cap.
A bfloat16 cache (`kv_cache_dtype`): stores round into it, the gathers widen what they read
(docs/cpu-step.md: why not SDPA in bfloat16); the compiled decode kernel reads it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shoal.kernels.attention_views import (
    DecodePages,
    ExtendSeq,
    Views,
    length_groups,
    window_views,
)
from shoal.kernels.batch import BatchShape
from shoal.kernels.cpu_kernels import DecodeKernel, StoreKernel


@dataclass(frozen=True)
class KernelDecodes:
    """All of a step's decode sequences, for a compiled kernel reading the pages in place."""

    kernel: DecodeKernel
    token_index: torch.Tensor  # [B_dec] int64: which of the T tokens each decode is
    page_ids: torch.Tensor  # [B_dec, P_max] int64: each sequence's pages (past its last: any)
    seq_lens: torch.Tensor  # [B_dec] int64


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
        return paged_attention(
            q, k_cache, v_cache, views, self.kernel_decodes, self.page_size, scale, window,
            softcap,
        )  # fmt: skip


class TorchAttention:
    """The reference backend: gathers each sequence's pages and calls SDPA (any device); with
    a decode kernel (the "cpu" backend), decodes go to the kernel instead."""

    def __init__(
        self,
        page_size: int,
        decode_kernel: DecodeKernel | None = None,
        store_kernel: StoreKernel | None = None,
    ) -> None:
        self.page_size = page_size
        self.decode_kernel = decode_kernel
        self.store_kernel = store_kernel
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
        )


def build_metadata(
    page_table_rows: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    page_size: int,
    decode_kernel: DecodeKernel | None = None,
    store_kernel: StoreKernel | None = None,
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
        ids = torch.tensor(decode_ids, dtype=torch.int64, device=device)
        max_pages = -(-max(seq_lens[i] for i in decode_ids) // page_size)
        kernel_decodes = KernelDecodes(
            kernel=decode_kernel,
            token_index=first_token[ids],
            page_ids=pages[ids, :max_pages].contiguous(),
            seq_lens=torch.tensor([seq_lens[i] for i in decode_ids], device=device),
        )
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
    return AttentionMetadata(
        slot_mapping, page_size, tuple(decodes), tuple(extends), kernel_decodes, store_kernel,
        max(seq_lens, default=0),
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


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    views: Views,
    kernel_decodes: KernelDecodes | None,
    page_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, H, D] for the new tokens; returns [T, H, D]. K/V of new tokens already stored.
    `views` are already trimmed to `window`, which only the compiled kernel still needs."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # dense even when q is a view
    fused = kernel_decodes
    if fused is not None:
        fused.kernel(
            q, k_cache, v_cache, fused.page_ids, fused.seq_lens, fused.token_index,
            page_size, scale, out, window or 0, softcap or 0.0,
        )  # fmt: skip
    for dec in views.decodes:
        qd = q[dec.token_index].unsqueeze(2)  # [B, H, 1, D]
        kd = gather_pages(k_cache, dec.page_ids, page_size).to(q.dtype).transpose(1, 2)
        vd = gather_pages(v_cache, dec.page_ids, page_size).to(q.dtype).transpose(1, 2)
        if softcap is None:
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=dec.key_mask, scale=scale, enable_gqa=True
            )
        else:
            od = capped_attention(qd, kd, vd, dec.key_mask, scale, softcap)
        out[dec.token_index] = od.squeeze(2)
    for ext in views.extends:
        end = ext.token_start + ext.num_new
        num_keys = ext.seq_len - ext.key_start
        qe = q[ext.token_start : end].transpose(0, 1)  # [H, n, D]
        ke = gather_pages(k_cache, ext.page_ids[None], page_size)[0, :num_keys]
        ve = gather_pages(v_cache, ext.page_ids[None], page_size)[0, :num_keys]
        ke, ve = ke.to(q.dtype).transpose(0, 1), ve.to(q.dtype).transpose(0, 1)  # [Hkv, L, D]
        if softcap is None:
            # Batched as [1, H, n, D]: given 3-D tensors SDPA takes its math path on the CPU
            # (2.3x slower here for a 128-token chunk after 128 cached, 3.7x for a whole
            # 256-token prompt); given 4-D, its flash kernel.
            oe = F.scaled_dot_product_attention(
                qe[None], ke[None], ve[None],  # K, V: [1, Hkv, L, D]
                attn_mask=ext.mask, is_causal=ext.mask is None, scale=scale, enable_gqa=True,
            )[0]  # fmt: skip
        else:
            mask = ext.mask
            if mask is None:
                mask = torch.ones(ext.num_new, num_keys, dtype=torch.bool, device=q.device).tril()
            oe = capped_attention(qe, ke, ve, mask, scale, softcap)
        out[ext.token_start : end] = oe.transpose(0, 1)
    return out


def capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Attention with soft-capped logits, which SDPA cannot do, as Gemma 2's eager forward:
    q [..., H, n, D], k and v [..., Hkv, L, D], mask (broadcast to [..., 1, n, L]) bool.
    The query heads sharing a KV head are folded into its rows, so K/V are not repeated."""
    *batch, heads, num_q, dim = q.shape
    kv_heads = k.shape[-3]
    grouped = q.reshape(*batch, kv_heads, heads // kv_heads * num_q, dim)
    scores = torch.matmul(grouped, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.unflatten(-2, (heads // kv_heads, num_q))  # [..., Hkv, G, n, L]
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).flatten(-3, -2)
    return torch.matmul(probs, v).reshape(q.shape)


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """The tokens of whole pages: cache [slots, Hkv, D], page_ids [B, P] -> [B, P * page, Hkv, D]
    (one index_select of page-sized blocks, far faster than one per token)."""
    paged = cache.view(-1, page_size, *cache.shape[1:])
    blocks = paged.index_select(0, page_ids.reshape(-1))
    return blocks.view(page_ids.shape[0], -1, *cache.shape[1:])
