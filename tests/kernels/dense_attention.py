"""The attention every backend is held to: an explicit softmax(q k^T) v in float64 over each
sequence's own K/V (`dense_attention`), that over a paged step (`dense_outputs`), and the pages
before each window overwritten, as if freed and reused (`poison_before_windows`).
test_attention_reference.py, test_cpu_kernels.py and test_triton_kernels.py compare with it.
"""

from __future__ import annotations

import torch

from shoal.kernels.batch import BatchShape


def dense_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_pos: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """softmax(q k^T) v in float64 as transformers' eager attention: q [n, H, D] at positions
    query_pos, keys and values [L, Hkv, D] at positions 0 .. L - 1; query p sees keys k with
    p - window < k <= p; logits capped to softcap * tanh(logits / softcap)."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, 1)
    values = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(keys.shape[0], device=q.device)[None, :]
    visible = key_pos <= query_pos[:, None]
    if window is not None:
        visible &= key_pos > query_pos[:, None] - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, values)


def dense_outputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    shape: BatchShape,
    page_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`dense_attention` of every sequence of a step over its K/V read from the pages
    ([T, H, D] float64)."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    start = 0
    for row, prefix, n_new in zip(shape.rows, shape.prefix_lens, shape.extend_lens, strict=True):
        positions = torch.arange(prefix + n_new, device=q.device)
        slots = page_table[row, positions // page_size] * page_size + positions % page_size
        out[start : start + n_new] = dense_attention(
            q[start : start + n_new], k_cache[slots], v_cache[slots], positions[prefix:], scale,
            window, softcap,
        )  # fmt: skip
        start += n_new
    return out


def poison_before_windows(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    shape: BatchShape,
    page_size: int,
    window: int,
    value: float,
) -> int:
    """Fill every page that lies wholly before the windows of all of a sequence's new tokens
    with `value`, as if it had been freed and reused; returns how many pages that was."""
    poisoned = 0
    for row, prefix in zip(shape.rows, shape.prefix_lens, strict=True):
        first_visible = max(0, prefix - window + 1)  # of its first new token
        for page in page_table[row, : first_visible // page_size].tolist():
            k_cache[page * page_size : (page + 1) * page_size] = value
            v_cache[page * page_size : (page + 1) * page_size] = value
            poisoned += 1
    return poisoned
