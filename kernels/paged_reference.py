"""A step's attention computed from its metadata (attention.py): the compiled kernels for all of
its decodes and, where the layer allows, all of its chunks; the rest gathered page by page and
given to SDPA (the torch reference; soft-capped logits through an explicit softmax)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.kernels.attention_views import Views
from shoal.kernels.kernel_views import KernelDecodes, KernelExtends


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
    kernel_extends: KernelExtends | None = None,
) -> torch.Tensor:
    """q: [T, H, D] for the new tokens; returns [T, H, D]. K/V of new tokens already stored.
    `views` are already trimmed to `window`, which only the compiled kernel still needs;
    `kernel_extends`: the chunks, when `views` holds none."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # dense even when q is a view
    if kernel_extends is not None:
        kernel_extends.kernel(
            q, k_cache, v_cache, kernel_extends.page_ids, kernel_extends.seq_lens,
            kernel_extends.num_new, kernel_extends.token_start, page_size, scale, out,
        )  # fmt: skip
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
