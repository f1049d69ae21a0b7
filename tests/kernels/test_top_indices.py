"""The compiled top_rows op (csrc/top_rows.cpp, kernels/top_indices.py) against torch: each
row's k largest logits' indices as a stable descending sort gives them (the lower index first
among equal values, a NaN before any number), on rows of lengths around the vector width, with
many ties, NaNs, infinities and signed zeros; and its refusals."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.cpu_kernels import CpuKernels
from shoal.kernels.top_indices import top_indices


def stable_top(logits: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]


@pytest.fixture(scope="module", autouse=True)
def built(kernels: CpuKernels) -> CpuKernels:
    assert hasattr(torch.ops.shoal_cpu, "top_rows")
    return kernels


LENGTHS = (1, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 1000, 49152)


@pytest.mark.parametrize(("n", "k"), [(n, k) for n in LENGTHS for k in (1, 2, 8, 13, 64) if k <= n])
def test_top_rows_is_a_stable_descending_sorts_first_k(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 100 + k)
    spread = torch.randn(5, n, generator=gen) * 4
    ties = torch.randint(0, 6, (5, n), generator=gen).float()  # most logits tie with others
    rounded = spread.to(torch.bfloat16).float()  # what the bfloat16 head hands over
    for logits in (spread, ties, rounded, -ties, torch.zeros(2, n)):
        got = torch.ops.shoal_cpu.top_rows(logits, k)
        assert torch.equal(got, stable_top(logits, k))
        assert torch.equal(got, top_indices(logits, k))
        torch.testing.assert_close(
            logits.gather(1, got), logits.topk(k, dim=-1).values, rtol=0, atol=0
        )


@pytest.mark.parametrize("n", [5, 16, 40, 1000])
def test_nan_infinities_and_signed_zeros_order_as_torchs_sort(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    rows = torch.randn(6, n, generator=gen)
    rows[0, n // 2] = float("nan")  # one NaN past the first vector
    rows[1, [0, n - 1]] = float("nan")  # NaNs first and last: in index order
    rows[2, :] = -0.0
    rows[2, 1::2] = 0.0  # equal zeros: by index
    rows[3, n // 3] = float("inf")
    rows[3, -1] = float("inf")
    rows[4, :] = float("-inf")
    rows[5, :] = float("nan")
    for k in (1, min(4, n), n):
        if k <= 64:
            assert torch.equal(torch.ops.shoal_cpu.top_rows(rows, k), stable_top(rows, k)), k


def test_rows_that_are_views_and_the_empty_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 300, generator=gen)
    view = wide[:, 10:250]  # rows strided by 300
    assert torch.equal(torch.ops.shoal_cpu.top_rows(view, 8), stable_top(view, 8))
    assert torch.ops.shoal_cpu.top_rows(torch.empty(0, 50), 8).shape == (0, 8)
    # top_indices hands what the op cannot read to torch: the same values
    columns = wide.T[:8]  # stride(1) != 1
    torch.testing.assert_close(
        columns.gather(1, top_indices(columns, 3)), columns.topk(3).values, rtol=0, atol=0
    )
    assert torch.equal(top_indices(wide, 65), wide.topk(65).indices)  # past the op's 64


def test_refusals() -> None:
    op = torch.ops.shoal_cpu.top_rows
    with pytest.raises(RuntimeError, match="k must be"):
        op(torch.randn(2, 5), 6)
    with pytest.raises(RuntimeError, match="k must be"):
        op(torch.randn(2, 100), 0)
    with pytest.raises(RuntimeError, match="k must be"):
        op(torch.randn(2, 100), 65)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(2, 5).double(), 2)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(5, 2).T, 2)
