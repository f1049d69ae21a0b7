"""The torch paged attention against plain causal attention over each sequence's own K/V.

Pages are scattered at random, decodes of very different lengths (several length groups)
share a step with chunks that extend a cached prefix and with a fresh prompt."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.kernels.attention import MAX_PADDING_PAGES, TorchAttention, length_groups
from shoal.kernels.batch import BatchShape

PAGE = 4
HEADS, KV_HEADS, DIM = 6, 2, 8


def test_paged_attention_equals_attention_over_each_sequence() -> None:
    gen = torch.Generator().manual_seed(0)
    prefix_lens = [3, 150, 7, 0, 9, 290, 1, 40]
    extend_lens = [1, 1, 1, 5, 4, 1, 1, 1]
    num_pages = 800
    k_cache = torch.randn(num_pages * PAGE, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_pages * PAGE, KV_HEADS, DIM, generator=gen)
    max_pages = max(-(-(p + n) // PAGE) for p, n in zip(prefix_lens, extend_lens, strict=True))
    page_ids = torch.randperm(num_pages, generator=gen)[: len(prefix_lens) * max_pages]
    page_table = page_ids.view(len(prefix_lens), max_pages)
    shape = BatchShape(tuple(range(len(prefix_lens))), tuple(prefix_lens), tuple(extend_lens))
    meta = TorchAttention(PAGE).prepare(page_table, shape)
    assert len(meta.decodes) > 1  # lengths 2..291: more than one length group

    total = sum(extend_lens)
    q = torch.randn(total, HEADS, DIM, generator=gen)
    k_new = torch.randn(total, KV_HEADS, DIM, generator=gen)
    v_new = torch.randn(total, KV_HEADS, DIM, generator=gen)
    meta.store(k_cache, v_cache, k_new, v_new)
    out = meta.attend(q, k_cache, v_cache, 0.3)

    start = 0
    for row, (prefix, n_new) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        seq_len = prefix + n_new
        positions = torch.arange(seq_len)
        slots = page_table[row, positions // PAGE] * PAGE + positions % PAGE
        keys = k_cache[slots].transpose(0, 1)
        values = v_cache[slots].transpose(0, 1)
        torch.testing.assert_close(k_cache[slots[prefix:]], k_new[start : start + n_new])
        mask = torch.arange(seq_len)[None, :] <= torch.arange(prefix, seq_len)[:, None]
        expected = F.scaled_dot_product_attention(
            q[start : start + n_new].transpose(0, 1),
            keys,
            values,
            attn_mask=mask,
            scale=0.3,
            enable_gqa=True,
        ).transpose(0, 1)
        torch.testing.assert_close(out[start : start + n_new], expected)
        start += n_new


def test_length_groups_cover_every_decode_once_and_bound_padding() -> None:
    seq_lens = [5, 900, 17, 880, 300, 64, 1, 1000, 250]
    ids = [0, 1, 2, 3, 4, 5, 7, 8]  # 6 is not a decode
    groups = length_groups(ids, seq_lens, 16)
    assert sorted(i for g in groups for i in g) == sorted(ids)
    for group in groups:
        pages = [-(-seq_lens[i] // 16) for i in group]
        padding = max(pages) * len(pages) - sum(pages)
        assert padding <= max(0.25 * sum(pages), MAX_PADDING_PAGES)
    assert len(groups) > 1
    assert length_groups([0, 1], [100, 100], 16) == [[0, 1]]
