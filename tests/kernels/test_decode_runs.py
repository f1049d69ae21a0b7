"""A speculating row's positions in the CPU decode kernel (csrc/decode_runs.h): sequences of a
step with the same pages and one key more each are taken together, a KV head and a block of
keys at a time; each position must keep the bits it has decoded alone (a verification's tokens
are then exactly those of decoding one at a time), and sequences that only look like a run
(one key more on other pages) must not be taken as one."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.cpu_kernels import CpuKernels


def row_batch(
    gen: torch.Generator, rows: list[tuple[int, int]], pages: int, page: int, max_pages: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page_ids, seq_lens) for `rows`, each (its first length, its positions): a row's
    positions share one random page list, their lengths one apart."""
    tables, lens = [], []
    for first, positions in rows:
        table = torch.randperm(pages, generator=gen)[:max_pages]
        for i in range(positions):
            tables.append(table)
            lens.append(first + i)
    return torch.stack(tables).contiguous(), torch.tensor(lens, dtype=torch.long)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page"),
    [(9, 3, 64, 16), (8, 1, 128, 16), (16, 2, 64, 1), (6, 2, 20, 4)],
)
def test_each_position_of_a_row_keeps_the_bits_it_has_alone(
    kernels: CpuKernels, heads: int, kv_heads: int, dim: int, page: int, dtype: torch.dtype
) -> None:
    """Rows of 13, 5, 2 and 1 positions (lengths from 1 to 412: blocks of 16 keys whole and
    cut, a run shorter than one block), a look-alike sequence (one key more than the row before
    it, one page changed), the token rows shuffled, over 1, 2 and 3 threads: every position's
    output equals its decode alone, bit for bit. Heads of 20 never take runs (the control)."""
    gen = torch.Generator().manual_seed(heads + dim + page)
    pages, max_pages = 1024, -(-440 // page)
    slots = pages * page
    k_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    page_ids, lens = row_batch(gen, [(400, 13), (1, 5), (77, 1), (15, 2), (30, 1)], pages, page,
                               max_pages)  # fmt: skip
    look_alike = page_ids[-1].clone()
    look_alike[0] = (look_alike[0] + 1) % pages
    page_ids = torch.cat([page_ids, look_alike[None]]).contiguous()
    lens = torch.cat([lens, torch.tensor([31])])
    rows = lens.numel()
    tokens = torch.randperm(rows, generator=gen)
    q = torch.randn(rows, heads, dim, generator=gen)
    alone = torch.zeros(rows, heads, dim)
    for b in range(rows):
        kernels.paged_decode(q, k_cache, v_cache, page_ids[b : b + 1], lens[b : b + 1],
                             tokens[b : b + 1], page, dim**-0.5, alone)  # fmt: skip
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            together = torch.full((rows, heads, dim), float("nan"))
            kernels.paged_decode(q, k_cache, v_cache, page_ids, lens, tokens, page, dim**-0.5,
                                 together)  # fmt: skip
            for b in range(rows):
                assert torch.equal(together[tokens[b]], alone[tokens[b]]), (threads, b)
    finally:
        torch.set_num_threads(before)
