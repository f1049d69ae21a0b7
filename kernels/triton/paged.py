"""Triton helpers shared by the attention kernels (inlined where they are called).

`load_kv_block` reads the K and V of a block of key positions through one row of the page
table; `online_softmax_step` folds that block into a running softmax-weighted sum (flash
attention's update: the running max `m`, the running denominator and the accumulator),
soft-capping the logits first where asked (Gemma 2).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_block(
    K_cache,
    V_cache,
    table_row,
    pos,
    valid,
    kv_head,
    stride_cache_slot,
    stride_cache_head,
    offs_d,
    d_mask,
    PAGE_SIZE: tl.constexpr,
):
    """K and V ([BLOCK_N, BLOCK_D] each) of key positions `pos`; zeros where not `valid`."""
    page = tl.load(table_row + pos // PAGE_SIZE, mask=valid, other=0)
    slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
    offs = slot[:, None] * stride_cache_slot + kv_head * stride_cache_head + offs_d[None, :]
    mask = valid[:, None] & d_mask[None, :]
    k = tl.load(K_cache + offs, mask=mask, other=0.0)
    v = tl.load(V_cache + offs, mask=mask, other=0.0)
    return k, v


@triton.jit
def online_softmax_step(q, k, v, visible, acc, m, denom, scale, softcap):
    """Attend the queries q [M, D] to one block of keys; `visible` [M, N] masks the scores.
    softcap > 0 caps the logits at +-softcap (softcap * tanh(logits / softcap)). A row that
    has seen no visible key yet (a sliding window starting past the block) keeps m = -inf,
    denom = 0 and acc = 0."""
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    if softcap > 0:
        scores = softcap * tanh(scores / softcap)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp(-inf - 0) = 0, never NaN
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, denom


@triton.jit
def tanh(x):
    """tanh through exp (Triton has no portable tanh): +-1 where exp(2x) overflows or
    vanishes, never NaN."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
