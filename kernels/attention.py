"""Paged attention, torch reference (the CPU path; Triton kernels must match these).

KV layout, one pair of tensors per layer::

    k_cache[layer]: [num_pages * page_size, num_kv_heads, head_dim]   (a "slot" = one token)
    slot = page_table[row, pos // page_size] * page_size + pos % page_size

A forward step carries a ragged batch of sequences. Sequence i contributes
`extend_lens[i]` new tokens at positions `prefix_lens[i] ..` and attends to all
`seq_lens[i] = prefix_lens[i] + extend_lens[i]` tokens of its row (the cached prefix
read from pages, the new tokens causally). A decode step is the case extend_len == 1.
New K/V are stored first, so attention reads everything from the pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal.kernels.batch import BatchShape


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything a layer needs to attend; built once per step, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    extend_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    kv_slots: tuple[torch.Tensor, ...]  # per sequence: [seq_len] int64 slots of its tokens
    decode_index: torch.Tensor | None  # [B_dec, L_max] slots of decode sequences (padded)
    decode_mask: torch.Tensor | None  # [B_dec, 1, 1, L_max] bool: key is valid
    decode_token_index: torch.Tensor | None  # [B_dec] which of the T tokens each decode is
    extend_masks: tuple[torch.Tensor | None, ...]  # per sequence with extend_len > 1

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.numel())

    def store(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        store_kv(k_cache, v_cache, self.slot_mapping, k, v)

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, self, scale)


class TorchAttention:
    """The reference backend: gathers each sequence's slots and calls SDPA (any device)."""

    name = "torch"

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    def prepare(self, page_table: torch.Tensor, shape: BatchShape) -> AttentionMetadata:
        rows = torch.tensor(shape.rows, dtype=torch.int64, device=page_table.device)
        return build_metadata(
            page_table[rows], list(shape.prefix_lens), list(shape.extend_lens), self.page_size
        )


def build_metadata(
    page_table_rows: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    page_size: int,
) -> AttentionMetadata:
    """page_table_rows: [B, max_pages] page ids of each sequence's row (host tensor)."""
    device = page_table_rows.device
    offsets = torch.arange(page_size, device=device)
    kv_slots: list[torch.Tensor] = []
    new_slots: list[torch.Tensor] = []
    seq_lens: list[int] = []
    extend_masks: list[torch.Tensor | None] = []
    decode_ids: list[int] = []
    decode_tokens: list[int] = []
    token_start = 0
    for i, (prefix, n_new) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        seq_len = prefix + n_new
        num_pages = -(-seq_len // page_size)
        pages = page_table_rows[i, :num_pages].to(torch.int64)
        slots = (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:seq_len]
        kv_slots.append(slots)
        new_slots.append(slots[prefix:])
        seq_lens.append(seq_len)
        if n_new == 1:
            decode_ids.append(i)
            decode_tokens.append(token_start)
            extend_masks.append(None)
        else:
            query_pos = torch.arange(prefix, seq_len, device=device)
            key_pos = torch.arange(seq_len, device=device)
            extend_masks.append(key_pos[None, :] <= query_pos[:, None])
        token_start += n_new
    decode_index = decode_mask = decode_token_index = None
    if decode_ids:
        max_len = max(seq_lens[i] for i in decode_ids)
        decode_index = torch.zeros(len(decode_ids), max_len, dtype=torch.int64, device=device)
        decode_mask = torch.zeros(len(decode_ids), 1, 1, max_len, dtype=torch.bool, device=device)
        for j, i in enumerate(decode_ids):
            decode_index[j, : seq_lens[i]] = kv_slots[i]
            decode_mask[j, 0, 0, : seq_lens[i]] = True
        decode_token_index = torch.tensor(decode_tokens, dtype=torch.int64, device=device)
    return AttentionMetadata(
        slot_mapping=torch.cat(new_slots) if new_slots else torch.zeros(0, dtype=torch.int64),
        extend_lens=tuple(extend_lens),
        seq_lens=tuple(seq_lens),
        kv_slots=tuple(kv_slots),
        decode_index=decode_index,
        decode_mask=decode_mask,
        decode_token_index=decode_token_index,
        extend_masks=tuple(extend_masks),
    )


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write the new tokens' K/V ([T, Hkv, D]) into their slots."""
    k_cache[slot_mapping] = k
    v_cache[slot_mapping] = v


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D] for the new tokens; returns [T, H, D]. K/V of new tokens already stored."""
    out = torch.empty_like(q)
    if meta.decode_index is not None:
        assert meta.decode_mask is not None and meta.decode_token_index is not None
        qd = q[meta.decode_token_index].unsqueeze(2)  # [B, H, 1, D]
        kd = gather(k_cache, meta.decode_index).transpose(1, 2)  # [B, Hkv, L, D]
        vd = gather(v_cache, meta.decode_index).transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        out[meta.decode_token_index] = od.squeeze(2)
    start = 0
    for n_new, slots, mask in zip(meta.extend_lens, meta.kv_slots, meta.extend_masks, strict=True):
        if mask is not None:
            qe = q[start : start + n_new].transpose(0, 1)  # [H, n, D]
            ke = k_cache.index_select(0, slots).transpose(0, 1)  # [Hkv, L, D]
            ve = v_cache.index_select(0, slots).transpose(0, 1)
            oe = F.scaled_dot_product_attention(
                qe, ke, ve, attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[start : start + n_new] = oe.transpose(0, 1)
        start += n_new
    return out


def gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[index] for a 2-D index: [B, L] -> [B, L, Hkv, D] (index_select is far faster)."""
    rows = cache.index_select(0, index.reshape(-1))
    return rows.view(*index.shape, *cache.shape[1:])
