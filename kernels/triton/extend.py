"""Triton kernel: extend attention for prefill and chunked prefill over paged KV.

Reference: the extend part of `shoal.kernels.attention.paged_attention`.

One program per (sequence, query head, block of BLOCK_M new tokens). The new tokens' K/V are
already stored, so every key is read from the pages: new token j of a sequence (position
prefix_len + j) attends to positions 0 .. prefix_len + j, or with a sliding window of W keys
to prefix_len + j - W + 1 .. prefix_len + j. The key loop runs from the block's first window
start to its causal bound, so a block never reads keys that none of its tokens sees (those
before a window may have been freed and reused).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.triton.paged import load_kv_block, online_softmax_step


@triton.jit
def _extend_kernel(
    Q,
    K_cache,
    V_cache,
    Out,
    page_table,
    rows,
    prefix_lens,
    extend_lens,
    extend_starts,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_slot,
    stride_cache_head,
    stride_table_row,
    scale,
    window,
    softcap,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2)
    extend_len = tl.load(extend_lens + seq)
    prefix_len = tl.load(prefix_lens + seq)
    row = tl.load(rows + seq).to(tl.int64)
    first_token = tl.load(extend_starts + seq).to(tl.int64)
    kv_head = head // GROUP

    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < extend_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    tokens = first_token + offs_m
    q = tl.load(
        Q + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    query_pos = prefix_len + offs_m

    # Keys up to the last query of this block; none at all for a block past the sequence.
    end = tl.minimum(prefix_len + extend_len, prefix_len + (block + 1) * BLOCK_M)
    end = tl.where(block * BLOCK_M < extend_len, end, 0)
    # With a window, keys from the first query's window on: none before is read.
    start = tl.where(window > 0, tl.maximum(prefix_len + block * BLOCK_M - window + 1, 0), 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = page_table + row * stride_table_row
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k, v = load_kv_block(
            K_cache, V_cache, table_row, pos, valid, kv_head, stride_cache_slot,
            stride_cache_head, offs_d, d_mask, PAGE_SIZE,
        )  # fmt: skip
        causal = valid[None, :] & (pos[None, :] <= query_pos[:, None])
        in_window = (window <= 0) | (pos[None, :] > query_pos[:, None] - window)
        acc, m, denom = online_softmax_step(
            q, k, v, causal & in_window, acc, m, denom, scale, softcap
        )

    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    tl.store(
        Out + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out,
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    max_extend_len: int,
    page_size: int,
    scale: float,
    block_m: int = 64,
    block_n: int = 64,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Attend for the extend sequences, writing their rows of out.

    q, out: [T, H, D]; caches: [slots, Hkv, D]; page_table: [num_rows, max_pages];
    rows, prefix_lens, extend_lens, extend_starts (first token in T): [B] int32.
    window > 0: token at position p attends to keys p - window < k <= p only;
    softcap > 0: logits become softcap * tanh(logits / softcap).
    """
    num_seqs = rows.shape[0]
    if num_seqs == 0 or max_extend_len == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and q.stride(2) == 1 and out.stride(2) == 1
    grid = (num_seqs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        rows,
        prefix_lens,
        extend_lens,
        extend_starts,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        page_table.stride(0),
        scale,
        window,
        softcap,
        PAGE_SIZE=page_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
