"""Sampling a batch from its parameters as columns: one tensor per parameter, one entry per row,
so a step costs the host the same few tensor operations whatever its batch size.

    columns = SamplingColumns(temperature, top_p, min_p, top_k, counter, host)
    next_tokens = sample_columns(logits, columns)     # int64 [B] on logits' device

    greedy rows (temperature 0): argmax
    sampled rows: / T ─ softmax ─ top-k ─ top-p ─ min-p ─ inverse CDF at the row's uniform

`ColumnsHost` is what the host knows of the same rows (which stages any row turns on, from each
row's `row_code`), so no choice of path reads the device.

Invariants:
- A row's token depends only on its own logits and parameters: every operation is per row
  (softmax, the sort, the cumulative sum), and the stages a neighbour turns on leave a row that
  does not use them as it was (top-k off is k = V, top-p off is p = 1, min-p off is 0).
- A row's draw is one uniform, `row_uniforms(counter)` with counter = stream_counter(seed,
  step): the top 24 bits of kernels/sampling.py's mix_seed(seed, step), computed on the device
  in int64 arithmetic (the same bits on every device), scaled into [0, 1 - 2^-24]. The token is
  the first whose cumulative probability passes u times the row's total, so u < 1 never runs
  off the end and a token of probability 0 is never drawn (its cumulative probability does not
  rise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from shoal.kernels.device_copy import to_device
from shoal.kernels.greedy import greedy_tokens
from shoal.params import SamplingParams

MIN_TEMPERATURE = 1e-5

_MASK64 = (1 << 64) - 1
_UNIFORM_BITS = 24  # exact in float32; u * total stays below total (module doc)
# A row's code (`row_code`): its top-k (when it uses one) in the low 32 bits, then flags.
_TOP_K_BITS = (1 << 32) - 1
_SAMPLED = 1 << 32
_TOP_P = 1 << 33
_MIN_P = 1 << 34


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


@dataclass(frozen=True, slots=True)
class ColumnsHost:
    """What the host knows of a batch's sampling parameters, to choose the stages to run; only
    the sampled rows' filters count (a greedy row's are never applied)."""

    any_sampled: bool  # some row has temperature >= MIN_TEMPERATURE
    all_sampled: bool  # every row has
    max_top_k: int  # the largest top_k of a sampled row that uses one (0 < k < V), else 0
    any_top_p: bool  # a sampled row has top_p < 1
    any_min_p: bool  # a sampled row has min_p > 0


GREEDY = ColumnsHost(False, False, 0, False, False)


@dataclass(frozen=True, slots=True)
class SamplingColumns:
    """A batch's sampling parameters, one entry per row, on the logits' device: temperature
    (`greedy_as_zero`), top_k (`effective_top_k`: V when off), and the row's place in its
    seed's stream (`stream_counter`)."""

    temperature: torch.Tensor  # float32 [B]
    top_p: torch.Tensor  # float32 [B]
    min_p: torch.Tensor  # float32 [B]
    top_k: torch.Tensor  # int64 [B]
    counter: torch.Tensor  # int64 [B]
    host: ColumnsHost


class RowColumns(NamedTuple):
    """One row's entries of a SamplingColumns (but its counter), and its code for the host."""

    floats: tuple[float, float, float]  # temperature (greedy: 0), top_p, min_p
    top_k: int  # V when off (0, or no smaller than V)
    code: int  # what columns_host needs of the row: 0 for a greedy row


def row_columns(params: SamplingParams, vocab_size: int) -> RowColumns:
    top_k = params.top_k if 0 < params.top_k < vocab_size else vocab_size
    if params.temperature < MIN_TEMPERATURE:  # as 0, so that host and device agree on it
        return RowColumns((0.0, params.top_p, params.min_p), top_k, 0)
    code = _SAMPLED | (_TOP_P if params.top_p < 1.0 else 0) | (_MIN_P if params.min_p > 0 else 0)
    code |= top_k if top_k < vocab_size else 0
    return RowColumns((params.temperature, params.top_p, params.min_p), top_k, code)


def columns_of(
    params: Sequence[SamplingParams],
    counters: Sequence[int],
    vocab_size: int,
    device: torch.device,
) -> SamplingColumns:
    """A batch's columns from its rows' parameters and counters (two host-to-device copies)."""
    rows = [row_columns(p, vocab_size) for p in params]
    n = len(rows)
    floats = to_device([x for row in rows for x in row.floats], torch.float32, device).view(n, 3)
    ints = to_device([*(row.top_k for row in rows), *counters], torch.int64, device)
    codes = np.fromiter((row.code for row in rows), dtype=np.int64, count=n)
    f = floats.unbind(1)
    return SamplingColumns(f[0], f[1], f[2], ints[:n], ints[n:], columns_host(codes))


def columns_host(codes: np.ndarray) -> ColumnsHost:
    """A batch's ColumnsHost from its rows' codes (int64 [B], `row_code`)."""
    if codes.size == 0:
        return GREEDY
    any_code = int(np.bitwise_or.reduce(codes))
    if not any_code & _SAMPLED:
        return GREEDY
    return ColumnsHost(
        any_sampled=True,
        all_sampled=bool(int(np.bitwise_and.reduce(codes)) & _SAMPLED),
        max_top_k=int((codes & _TOP_K_BITS).max()),
        any_top_p=bool(any_code & _TOP_P),
        any_min_p=bool(any_code & _MIN_P),
    )


def sample_columns(logits: torch.Tensor, columns: SamplingColumns) -> torch.Tensor:
    """The next token of each row of logits [B, V]: int64 [B] on logits' device. The caller's
    logits are never written to."""
    host = columns.host
    if not host.any_sampled:
        return greedy_tokens(logits)
    logits = logits.float()
    temperature = columns.temperature
    greedy = None
    if not host.all_sampled:  # greedy rows divide by 1 here and take the argmax below
        greedy = temperature == 0.0
        temperature = temperature.masked_fill(greedy, 1.0)
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    probs = _filtered(probs, columns)
    tokens = _inverse_cdf(probs, row_uniforms(columns.counter))
    if greedy is None:
        return tokens
    return torch.where(greedy, greedy_tokens(logits), tokens)


def target_probs(logits: torch.Tensor, columns: SamplingColumns) -> torch.Tensor:
    """float32 [B, V]: the distribution `sample_columns` draws each row's token from, summing
    to 1 (every row sampled: `columns.host.all_sampled`)."""
    assert columns.host.all_sampled
    probs = torch.softmax(logits.float() / columns.temperature.unsqueeze(1), dim=-1)
    probs = _filtered(probs, columns)
    return probs / probs.sum(dim=-1, keepdim=True)


def row_uniforms(counter: torch.Tensor) -> torch.Tensor:
    """float32 [B] in [0, 1 - 2^-24]: (mix_seed(seed, step) >> 39) / 2^24 for each row's
    counter = stream_counter(seed, step) (int64 arithmetic wraps, as the 64-bit hash wants)."""
    mixed = _splitmix64_(counter)  # mix_seed's 63 bits are these 64 shifted by one
    return _shift_right(mixed, 64 - _UNIFORM_BITS).float() * (2.0**-_UNIFORM_BITS)


def stream_counter(seed: int, step: int) -> int:
    """splitmix64(seed) + step as the int64 a SamplingColumns' counter holds; the next step's
    is this one plus 1 (wrapping)."""
    return _signed((splitmix64(seed) + step) & _MASK64)


def splitmix64(x: int) -> int:
    """splitmix64's output function on a Python int (any int, taken modulo 2^64)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _splitmix64_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 on int64 tensors (wrapping, as the 64-bit hash wants)."""
    z = x + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical (unsigned) right shift of int64s: torch's >> keeps the sign."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds uniform * the row's total.

    On the CPU the cumulative sum runs along each row in order, so it never falls and stays
    flat over a zero; a parallel scan (CUDA) promises neither, so there a drawn zero (a chance
    of about 2^-24 where rounding opens a gap) falls back to the row's most likely token.
    A row with nothing to draw (every logit -inf: a grammar whose end min_new_tokens bans)
    sums to NaN and gets the last id, a valid one, which its row constraint then refuses."""
    cdf = probs.cumsum(dim=-1)
    target = (uniform.unsqueeze(1) * cdf[:, -1:]).contiguous()
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    tokens = tokens.clamp_(max=probs.shape[1] - 1)
    if probs.device.type == "cpu":
        return tokens
    drawn = probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return torch.where(drawn > 0, tokens, probs.argmax(dim=-1))


def _filtered(probs: torch.Tensor, columns: SamplingColumns) -> torch.Tensor:
    """top-k, top-p and min-p as zeros; not renormalized."""
    host = columns.host
    if host.any_top_p:
        probs = _top_k_top_p(probs, columns.top_k, columns.top_p)
    elif host.max_top_k > 0:
        probs = _top_k(probs, columns.top_k, host.max_top_k)
    if host.any_min_p:
        threshold = probs.amax(dim=-1, keepdim=True) * columns.min_p.unsqueeze(1)
        probs = _below_to_zero(probs, threshold)
    return probs


def _top_k(probs: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Zero all but each row's k most likely tokens (ties with the k-th all stay, as in HF).

    torch.topk up to the largest k used instead of a full sort of V."""
    vocab_size = probs.shape[1]
    largest = probs.topk(max_top_k, dim=-1).values
    k = top_k.unsqueeze(1)
    kth = largest.gather(1, (k.clamp(max=max_top_k) - 1))
    threshold = torch.where(k < vocab_size, kth, torch.zeros_like(kth))
    return _below_to_zero(probs, threshold)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero all but each row's k most likely tokens, then all but its nucleus among those.

    top-p is measured on the top-k survivors renormalized (as Hugging Face and vLLM do): a token
    stays while the mass ranked above it is below top_p of the surviving mass, so the most likely
    token always stays. Ties with the last token kept all stay (as ties with the k-th do), so
    what stays depends on the values alone, never on how a sort orders equal ones: the cut is
    a threshold found on the sorted values, and no token index is sorted.
    """
    values = _sorted_descending(probs)
    kth = values.gather(1, top_k.unsqueeze(1) - 1)  # ties with the k-th stay, as in _top_k
    values = _below_to_zero(values, kth)

    p = top_p.to(probs.dtype).unsqueeze(1)
    mass_above = values.cumsum(dim=-1) - values
    kept_mass = values.sum(dim=-1, keepdim=True)
    num_kept = (mass_above < p * kept_mass).sum(dim=-1, keepdim=True)  # a prefix, at least 1
    nucleus = values.gather(1, (num_kept - 1).clamp_(min=0))
    threshold = torch.where(p >= 1.0, kth, torch.maximum(nucleus, kth))
    return _below_to_zero(probs, threshold)


def _below_to_zero(probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """probs with each value below its row's threshold [B, 1] made 0: a product with the mask
    as bytes (on the CPU several times cheaper than masked_fill, or than a product with the
    mask as bools, which copies it to floats first); probs are finite and >= 0."""
    return probs * (probs >= threshold).view(torch.uint8)


def _sorted_descending(probs: torch.Tensor) -> torch.Tensor:
    """Each row's values, largest first. On the CPU through numpy, whose sort (vectorized, and
    without the indices torch.sort always makes) is several times faster than torch's there."""
    if probs.device.type != "cpu":
        return probs.sort(dim=-1, descending=True).values
    return torch.from_numpy(-np.sort(-probs.numpy(), axis=-1))
