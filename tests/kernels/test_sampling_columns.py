"""kernels/sampling_columns.py: the batch's draw as columns. One uniform per row from its seed's
stream (the top bits of mix_seed, computed on the device), a row's token whatever its neighbours
and its place, the top-p cut by value (ties with the last kept token stay), and a greedy batch
as one argmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.kernels.sampling import mix_seed
from shoal.kernels.sampling_columns import (
    GREEDY,
    SamplingColumns,
    columns_host,
    columns_of,
    row_columns,
    row_uniforms,
    sample_columns,
    stream_counter,
)
from shoal.params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_row_uniforms_are_the_top_bits_of_mix_seed(device: str) -> None:
    rng = np.random.default_rng(0)
    seeds = [int(s) for s in rng.integers(0, 2**63, 500)] + [0, 1, 2**63 - 1, 2**64 - 1]
    steps = [int(s) for s in rng.integers(0, 10**6, len(seeds))]
    counters = torch.tensor(
        [stream_counter(seed, step) for seed, step in zip(seeds, steps, strict=True)],
        device=device,
    )
    got = row_uniforms(counters).tolist()
    want = [(mix_seed(seed, step) >> 39) / 2**24 for seed, step in zip(seeds, steps, strict=True)]
    assert got == want
    assert max(got) <= 1 - 2**-24
    # The next step's counter is this one plus one, wrapping at 2^64.
    assert stream_counter(5, 2**64 - 1) + 1 == stream_counter(5, 2**64) == stream_counter(5, 0)


def columns(
    params: list[SamplingParams], seeds: list[int], step: int, vocab: int
) -> SamplingColumns:
    counters = [stream_counter(seed, step) for seed in seeds]
    return columns_of(params, counters, vocab, torch.device("cpu"))


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.2, top_k=7),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0),
    ],
)
def test_a_rows_draw_is_the_same_whatever_its_neighbours_and_place(
    target: SamplingParams,
) -> None:
    vocab = 300
    generator = torch.Generator().manual_seed(1)
    target_logits = torch.randn(vocab, generator=generator) * 3
    neighbours = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, min_p=0.2),
        SamplingParams(temperature=0.5, top_p=0.3),
        SamplingParams(temperature=1.0, top_k=2),
    ]
    for step in range(8):
        draws = set()
        for place, others in [(0, []), (1, neighbours[:1]), (2, neighbours), (4, neighbours)]:
            params = [*others]
            params.insert(place, target)
            seeds = [100 + i for i in range(len(params))]
            seeds[place] = 1234
            logits = torch.randn(len(params), vocab, generator=generator) * 3
            logits[place] = target_logits
            got = sample_columns(logits, columns(params, seeds, step, vocab))
            draws.add(int(got[place]))
        assert len(draws) == 1, (step, draws)


def test_a_greedy_batch_is_its_argmax_and_its_rows_stay_greedy_beside_sampled_ones() -> None:
    vocab = 64
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 4
    greedy = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5)] * 6
    assert columns_host(np.array([row_columns(p, vocab).code for p in greedy])) is GREEDY
    assert torch.equal(
        sample_columns(logits, columns(greedy, list(range(6)), 0, vocab)), logits.argmax(-1)
    )
    mixed = [greedy[0], SamplingParams(temperature=2.0)] * 3
    got = sample_columns(logits, columns(mixed, list(range(6)), 0, vocab))
    assert torch.equal(got[0::2], logits[0::2].argmax(-1))


def test_top_p_keeps_every_token_tied_with_the_last_kept() -> None:
    """Four tokens of 0.2 and two of 0.1: top_p 0.5 reaches into the 0.2s, so all four stay
    (which of equal values a sort puts first never decides), and the 0.1s never come."""
    probs = torch.tensor([0.2, 0.1, 0.2, 0.2, 0.1, 0.2])
    logits = probs.log().repeat(2000, 1)
    params = [SamplingParams(temperature=1.0, top_p=0.5)] * 2000
    got = sample_columns(logits, columns(params, list(range(2000)), 0, 6))
    counts = torch.bincount(got, minlength=6).tolist()
    assert counts[1] == counts[4] == 0
    assert all(400 < counts[i] < 600 for i in (0, 2, 3, 5)), counts


def test_a_zero_probability_token_is_never_drawn_at_either_end() -> None:
    """u spans [0, 1 - 2^-24]: a row whose first and last tokens are filtered out never draws
    them, whatever its seed."""
    logits = torch.tensor([[0.5, 5.0, 1.0, 5.0, 0.0]]).repeat(3000, 1)
    params = [SamplingParams(temperature=1.0, top_k=3)] * 3000
    got = sample_columns(logits, columns(params, list(range(3000)), 0, 5))
    assert set(got.tolist()) == {1, 2, 3}
