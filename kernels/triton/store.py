"""Triton kernel: store the new tokens' K and V into the paged cache by slot mapping.

Reference: `shoal.kernels.attention.store_kv`. One program per token copies its
[num_kv_heads * head_dim] row of K and of V. A negative slot is padding (a CUDA graph
replayed for a larger batch than the live one) and writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K,
    V,
    K_cache,
    V_cache,
    slot_mapping,
    stride_kt,
    stride_vt,
    stride_cache_slot,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < tl.where(slot >= 0, ROW, 0)  # padding copies nothing
    k = tl.load(K + token * stride_kt + offs, mask=mask)
    v = tl.load(V + token * stride_vt + offs, mask=mask)
    tl.store(K_cache + slot * stride_cache_slot + offs, k, mask=mask)
    tl.store(V_cache + slot * stride_cache_slot + offs, v, mask=mask)


def store_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k, v: [T, Hkv, D], each token's heads contiguous; caches: [slots, Hkv, D] contiguous."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and k.stride(1) == head_dim, "each token's K row must be contiguous"
    assert v.stride(2) == 1 and v.stride(1) == head_dim, "each token's V row must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    row = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        k_cache.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )
