"""The torch paged attention against plain causal attention over each sequence's own K/V.

Pages are scattered at random, decodes of very different lengths (several length groups)
share a step with chunks that extend a cached prefix and with a fresh prompt. Sliding windows
(shorter than, as long as and longer than the sequences) and soft-capped logits are checked
against `dense_attention` (dense_attention.py), an explicit softmax(q k^T) that
test_cpu_kernels.py and test_triton_kernels.py hold their backends to as well, also with the
pages before each window overwritten (they may have been freed and reused).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dense_attention import dense_outputs, poison_before_windows

from shoal.kernels.attention import TorchAttention
from shoal.kernels.attention_views import MAX_PADDING_PAGES, length_groups
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


# ---- sliding windows and soft-capped logits ------------------------------------------------

WINDOW_SHAPE = BatchShape(
    rows=tuple(range(9)),
    prefix_lens=(3, 150, 7, 0, 9, 290, 39, 40, 60),
    extend_lens=(1, 1, 1, 5, 4, 1, 1, 1, 30),
)  # lengths 4 .. 291, one of 40 (a window's length); extends with and without a prefix
WINDOW_SCALE = 0.3


def windowed_step(page: int, seed: int) -> tuple[torch.Tensor, ...]:
    """WINDOW_SHAPE with its new K/V stored: page table, K and V caches, q."""
    gen = torch.Generator().manual_seed(seed)
    shape = WINDOW_SHAPE
    seq_lens = [p + n for p, n in zip(shape.prefix_lens, shape.extend_lens, strict=True)]
    max_pages = -(-max(seq_lens) // page)
    num_pages = len(seq_lens) * max_pages + 5
    k_cache = torch.randn(num_pages * page, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_pages * page, KV_HEADS, DIM, generator=gen)
    page_ids = torch.randperm(num_pages, generator=gen)[: len(seq_lens) * max_pages]
    page_table = page_ids.view(len(seq_lens), max_pages)
    q = torch.randn(shape.num_tokens, HEADS, DIM, generator=gen)
    k_new = torch.randn(shape.num_tokens, KV_HEADS, DIM, generator=gen)
    v_new = torch.randn(shape.num_tokens, KV_HEADS, DIM, generator=gen)
    TorchAttention(page).prepare(page_table, shape).store(k_cache, v_cache, k_new, v_new)
    return page_table, k_cache, v_cache, q


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("window", [None, 1, 7, 40, 291, 4096])
@pytest.mark.parametrize("page", [1, 16])
def test_windows_and_softcap_equal_dense_attention(
    page: int, window: int | None, softcap: float | None
) -> None:
    """Windows of 1 key, shorter than most sequences, as long as one, as the longest, and
    longer than all, over decode groups and extends with and without a cached prefix."""
    page_table, k_cache, v_cache, q = windowed_step(page, seed=page)
    meta = TorchAttention(page).prepare(page_table, WINDOW_SHAPE)
    out = meta.attend(q, k_cache, v_cache, WINDOW_SCALE, window=window, softcap=softcap)
    expected = dense_outputs(
        q, k_cache, v_cache, page_table, WINDOW_SHAPE, page, WINDOW_SCALE, window, softcap
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    if window is not None and window >= 291:  # masks nothing: the unwindowed path itself
        plain = meta.attend(q, k_cache, v_cache, WINDOW_SCALE, softcap=softcap)
        assert torch.equal(out, plain)


def test_the_layers_of_one_step_attend_with_their_own_windows() -> None:
    """As Gemma alternates: one metadata, each call with its layer's window, in any order."""
    page_table, k_cache, v_cache, q = windowed_step(4, seed=7)
    meta = TorchAttention(4).prepare(page_table, WINDOW_SHAPE)
    for window in (7, None, 7, 40, None, 40):
        out = meta.attend(q, k_cache, v_cache, WINDOW_SCALE, window=window)
        expected = dense_outputs(
            q, k_cache, v_cache, page_table, WINDOW_SHAPE, 4, WINDOW_SCALE, window
        )
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert sorted(meta.windowed) == [7, 40]  # each window's views built once


@pytest.mark.parametrize("garbage", [1e4, float("nan")])
@pytest.mark.parametrize("page", [1, 16])
def test_pages_before_the_window_are_never_read(page: int, garbage: float) -> None:
    """Pages wholly before a sequence's window hold garbage, even NaN: the outputs do not
    change (nothing gathers them)."""
    window = 20
    page_table, k_cache, v_cache, q = windowed_step(page, seed=3)
    expected = {
        softcap: dense_outputs(
            q, k_cache, v_cache, page_table, WINDOW_SHAPE, page, WINDOW_SCALE, window, softcap
        )
        for softcap in (None, 3.0)
    }
    poisoned = poison_before_windows(
        k_cache, v_cache, page_table, WINDOW_SHAPE, page, window, garbage
    )
    assert poisoned > 0
    meta = TorchAttention(page).prepare(page_table, WINDOW_SHAPE)
    for softcap, dense in expected.items():
        out = meta.attend(q, k_cache, v_cache, WINDOW_SCALE, window=window, softcap=softcap)
        torch.testing.assert_close(out.double(), dense, rtol=1e-5, atol=1e-5)
