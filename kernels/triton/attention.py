"""The Triton attention backend: a step's batch as device tensors, and the kernels run on it.

`TritonAttention.prepare` sends the host's batch description to the device in one int32
copy (from pinned memory on CUDA, so it does not block) and splits it
into the decode part (one new token: split-K decode kernel) and the extend part (prefill and
chunked prefill: extend kernel). Slots are computed on the device from the page table, so
preparing a step never waits for the device. A step's layers may attend with different
sliding windows and soft-caps: both are arguments of the kernels, nothing is prepared per
window (a windowed layer only cuts its decodes into fewer splits when the window is short).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.kernels.batch import BatchShape
from shoal.kernels.device_copy import to_device_many
from shoal.kernels.triton.decode import decode_attention_triton
from shoal.kernels.triton.extend import extend_attention_triton
from shoal.kernels.triton.store import store_kv_triton

MAX_DECODE_SPLITS = 16
TOKENS_PER_SPLIT = 256  # a split shorter than this costs more to merge than it saves


def decode_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int) -> int:
    """How many pieces to cut each decode sequence's context into: enough programs to fill
    the GPU when the batch is small, never pieces shorter than TOKENS_PER_SPLIT."""
    by_length = -(-max_seq_len // TOKENS_PER_SPLIT)
    by_occupancy = -(-256 // max(1, num_seqs * num_kv_heads))
    return max(1, min(MAX_DECODE_SPLITS, by_length, by_occupancy))


@dataclass(frozen=True)
class DecodePart:
    rows: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32; 0 = padding
    token_index: torch.Tensor  # [B] int32: which of the T tokens is this sequence's
    num_splits: int


@dataclass(frozen=True)
class ExtendPart:
    rows: torch.Tensor  # [B] int32
    prefix_lens: torch.Tensor  # [B] int32
    extend_lens: torch.Tensor  # [B] int32
    extend_starts: torch.Tensor  # [B] int32: first of the T tokens
    max_extend_len: int


@dataclass(frozen=True)
class TritonBatch:
    page_table: torch.Tensor  # [num_rows, max_pages] (the executor's whole table)
    page_size: int
    slot_mapping: torch.Tensor  # [T] int64; -1 = padding, stores nothing
    decode: DecodePart | None
    extend: ExtendPart | None

    def store(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        store_kv_triton(k_cache, v_cache, self.slot_mapping, k, v)

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
        out = torch.empty_like(q)
        if self.decode is not None:
            d = self.decode
            splits = d.num_splits
            if window is not None:  # a split covers at least TOKENS_PER_SPLIT of the window
                splits = max(1, min(splits, -(-window // TOKENS_PER_SPLIT)))
            decode_attention_triton(
                q, k_cache, v_cache, out, self.page_table, d.rows, d.seq_lens, d.token_index,
                self.page_size, scale, splits, window=window or 0, softcap=softcap or 0.0,
            )  # fmt: skip
        if self.extend is not None:
            e = self.extend
            extend_attention_triton(
                q, k_cache, v_cache, out, self.page_table, e.rows, e.prefix_lens, e.extend_lens,
                e.extend_starts, e.max_extend_len, self.page_size, scale, window=window or 0,
                softcap=softcap or 0.0,
            )  # fmt: skip
        return out


def slot_mapping_of(
    page_table: torch.Tensor, token_rows: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Cache slot of each token ([T] int64), computed on the table's device."""
    token_rows = token_rows.long()
    positions = positions.long()
    pages = page_table[token_rows, positions // page_size].long()
    return pages * page_size + positions % page_size


class TritonAttention:
    name = "triton"

    def __init__(self, page_size: int, num_kv_heads: int) -> None:
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads

    def prepare(self, page_table: torch.Tensor, shape: BatchShape) -> TritonBatch:
        decode = [i for i, n in enumerate(shape.extend_lens) if n == 1]
        extend = [i for i, n in enumerate(shape.extend_lens) if n > 1]
        starts: list[int] = []
        token_rows: list[int] = []
        positions: list[int] = []
        for row, prefix, n in zip(shape.rows, shape.prefix_lens, shape.extend_lens, strict=True):
            starts.append(len(positions))
            token_rows.extend([row] * n)
            positions.extend(range(prefix, prefix + n))
        seq_lens = [p + n for p, n in zip(shape.prefix_lens, shape.extend_lens, strict=True)]
        fields = (
            [shape.rows[i] for i in decode],
            [seq_lens[i] for i in decode],
            [starts[i] for i in decode],
            [shape.rows[i] for i in extend],
            [shape.prefix_lens[i] for i in extend],
            [shape.extend_lens[i] for i in extend],
            [starts[i] for i in extend],
            token_rows,
            positions,
        )
        parts = to_device_many(fields, torch.int32, page_table.device)
        decode_part = extend_part = None
        if decode:
            max_len = max(seq_lens[i] for i in decode)
            splits = decode_splits(max_len, len(decode), self.num_kv_heads)
            decode_part = DecodePart(parts[0], parts[1], parts[2], splits)
        if extend:
            max_extend = max(shape.extend_lens[i] for i in extend)
            extend_part = ExtendPart(parts[3], parts[4], parts[5], parts[6], max_extend)
        slots = slot_mapping_of(page_table, parts[7], parts[8], self.page_size)
        return TritonBatch(page_table, self.page_size, slots, decode_part, extend_part)
