"""Triton kernels: decode attention over paged KV, grouped by KV head, split over the context.

Reference: the decode part of `shoal.kernels.attention.paged_attention`.

Stage 1, one program per (sequence, KV head, split): the GROUP query heads that share the KV
head (padded to at least 16 rows, the smallest tensor-core tile) attend to the split's share
of the sequence (of its last `window` keys, with a sliding window: keys before are never
read, their pages may be reused), reading each K/V page once for the whole group. It writes
a partial output normalized within the split and the split's log-sum-exp.
Stage 2, one program per (sequence, query head): merges the splits by their log-sum-exp.

A sequence of length 0 (padding in a CUDA graph) gets a zero output. The number of splits
is fixed per call, so a captured graph stays valid for any lengths it later sees.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.triton.paged import load_kv_block, online_softmax_step


@triton.jit
def _decode_partial_kernel(
    Q,
    K_cache,
    V_cache,
    page_table,
    rows,
    seq_lens,
    token_index,
    Partial_out,
    Partial_lse,
    stride_qt,
    stride_qh,
    stride_cache_slot,
    stride_cache_head,
    stride_table_row,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_lse_seq,
    stride_lse_head,
    scale,
    window,
    softcap,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    row = tl.load(rows + seq).to(tl.int64)
    token = tl.load(token_index + seq).to(tl.int64)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # keys before: never read
    split_len = tl.cdiv(seq_len - first, NUM_SPLITS)
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    head_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=head_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = page_table + row * stride_table_row
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k, v = load_kv_block(
            K_cache, V_cache, table_row, pos, valid, kv_head, stride_cache_slot,
            stride_cache_head, offs_d, d_mask, PAGE_SIZE,
        )  # fmt: skip
        acc, m, denom = online_softmax_step(q, k, v, valid[None, :], acc, m, denom, scale, softcap)

    has_keys = denom > 0.0
    out = acc / tl.where(has_keys, denom, 1.0)[:, None]
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, denom, 1.0)), float("-inf"))
    po = (
        Partial_out
        + seq * stride_po_seq
        + heads[:, None] * stride_po_head
        + split * stride_po_split
        + offs_d[None, :]
    )
    tl.store(po, out, mask=head_mask[:, None] & d_mask[None, :])
    tl.store(
        Partial_lse + seq * stride_lse_seq + heads * stride_lse_head + split, lse, mask=head_mask
    )


@triton.jit
def _decode_merge_kernel(
    Partial_out,
    Partial_lse,
    Out,
    token_index,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_lse_seq,
    stride_lse_head,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(token_index + seq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(
        Partial_lse + seq * stride_lse_seq + head * stride_lse_head + offs_s,
        mask=s_mask,
        other=float("-inf"),
    )
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(lse - top)  # 0 for empty splits
    parts = tl.load(
        Partial_out
        + seq * stride_po_seq
        + head * stride_po_head
        + offs_s[:, None] * stride_po_split
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + token * stride_ot + head * stride_oh + offs_d, out, mask=d_mask)


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    token_index: torch.Tensor,
    page_size: int,
    scale: float,
    num_splits: int,
    block_n: int = 64,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Attend for the decode sequences, writing out[token_index[i]] ([H, D] each).

    q, out: [T, H, D]; caches: [slots, Hkv, D]; page_table: [num_rows, max_pages];
    rows, seq_lens, token_index: [B] int32 on q's device, one per decode sequence.
    window > 0: a sequence of length L attends to (and reads) only its keys L - window ..
    L - 1; softcap > 0: logits become softcap * tanh(logits / softcap).
    """
    num_seqs = rows.shape[0]
    if num_seqs == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and q.stride(2) == 1 and out.stride(2) == 1
    partial_out = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    partial_lse = torch.empty(
        (num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device
    )
    block_d = triton.next_power_of_2(head_dim)
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        rows,
        seq_lens,
        token_index,
        partial_out,
        partial_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        page_table.stride(0),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        scale,
        window,
        softcap,
        PAGE_SIZE=page_size,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
    )
    _decode_merge_kernel[(num_seqs, num_heads)](
        partial_out,
        partial_lse,
        out,
        token_index,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
    )
