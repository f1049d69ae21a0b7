"""The compiled argmax of greedy rows (kernels/csrc/argmax.cpp, kernels/greedy.py) against
torch.argmax: the same index on random rows of every length around the vector width, on ties
(the first), NaN (the first NaN), -inf rows and signed zeros, rows with a stride; refusals of
what it cannot read; greedy_tokens falls back to torch where the op does not apply."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.cpu_kernels import CpuKernels
from shoal.kernels.greedy import greedy_tokens

LENGTHS = [1, 2, 7, 8, 15, 16, 17, 31, 33, 64, 100, 1000, 49152, 49155]


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return torch.ops.shoal_cpu.argmax_rows(logits)


@pytest.mark.parametrize("length", LENGTHS)
def test_random_rows_take_torchs_index(kernels: CpuKernels, length: int) -> None:
    gen = torch.Generator().manual_seed(length)
    logits = torch.randn(13, length, generator=gen) * 5
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    rounded = torch.round(logits)  # many ties: the first of the largest
    assert torch.equal(argmax_rows(rounded), rounded.argmax(dim=-1))


@pytest.mark.parametrize("length", [1, 5, 16, 17, 40, 49152])
def test_nan_inf_and_signed_zeros_as_torch(kernels: CpuKernels, length: int) -> None:
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(9, length, generator=gen)
    rows[0] = float("-inf")  # every logit masked: the first
    rows[1, length // 2 :] = float("inf")  # the first of several +inf
    rows[2, -1] = float("nan")  # a NaN counts as largest
    rows[3, length // 3] = float("nan")
    rows[3, -1] = float("nan")  # the first NaN
    rows[4] = 0.0
    rows[4, length // 2] = -0.0  # -0.0 and 0.0 equal: the first
    rows[5] = -0.0
    rows[6, : length - 1] = float("-inf")  # only the last is a number
    rows[7] = float("nan")
    rows[8, 0] = float("inf")
    assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))


def test_rows_with_a_stride_and_no_rows(kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 300, generator=gen)
    part = wide[:, 10:250]  # rows 300 floats apart, each contiguous
    assert torch.equal(argmax_rows(part), part.argmax(dim=-1))
    every_other = wide[::2, :]
    assert torch.equal(argmax_rows(every_other), every_other.argmax(dim=-1))
    none = torch.empty(0, 50)
    assert argmax_rows(none).shape == (0,) and argmax_rows(none).dtype == torch.int64


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(3, 4, dtype=torch.float64),
        torch.zeros(12),
        torch.zeros(4, 3).t(),  # columns, not rows, contiguous
        torch.zeros(3, 0),
        torch.zeros(2, 3, 4),
    ],
)
def test_what_it_cannot_read_is_refused(kernels: CpuKernels, bad: torch.Tensor) -> None:
    with pytest.raises(RuntimeError, match="argmax_rows: logits must be"):
        argmax_rows(bad)


def test_greedy_tokens_takes_torchs_argmax_where_the_op_does_not_apply(
    kernels: CpuKernels,
) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 70, generator=gen)
    for other in (logits.t().contiguous().t(), logits.to(torch.bfloat16), logits.double()):
        assert torch.equal(greedy_tokens(other), other.argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
