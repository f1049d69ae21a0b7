"""kernels/sampling.py: greedy limits, seeded reproducibility, penalties, and the sampled law.

EXAMPLES (tests/support/sampling_examples.py) must hold a valid value, not the default, for
every SamplingParams field: tests/api/test_sampling_doors.py sends them all through every door
(OpenAI, /generate, the websocket, the command line, Engine.generate, Session.turn).
"""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from sampling_examples import EXAMPLES, GRAMMAR_EXAMPLES

from shoal.kernels.sampling import SamplingRow, compute_logprobs, mix_seed, sample
from shoal.params import GRAMMAR_KINDS, SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def row(
    seed: int = 0,
    prompt_ids: tuple[int, ...] = (),
    output_ids: tuple[int, ...] = (),
    **params: object,
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, prompt_ids, output_ids, len(output_ids))  # type: ignore[arg-type]


def random_logits(batch: int, vocab: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, vocab, generator=generator) * 3).to(device)


def test_every_field_has_an_example_other_than_its_default() -> None:
    fields = msgspec.structs.fields(SamplingParams)
    named = set(EXAMPLES) | set(GRAMMAR_EXAMPLES)
    assert named == {f.name for f in fields}, "give the new field a value in EXAMPLES"
    for info in fields:
        assert {**GRAMMAR_EXAMPLES, **EXAMPLES}[info.name] != info.default, info.name
    SamplingParams(**EXAMPLES).validate(vocab_size=512)
    assert set(GRAMMAR_EXAMPLES) == set(GRAMMAR_KINDS)
    for kind, source in GRAMMAR_EXAMPLES.items():
        swapped = {**EXAMPLES, "regex": None, kind: source}
        SamplingParams(**swapped).validate(vocab_size=512)


def test_mix_seed_is_a_63_bit_hash() -> None:
    values = {mix_seed(seed, step) for seed in range(50) for step in range(50)}
    assert len(values) == 2500
    assert all(0 <= v < 2**63 for v in values)
    assert mix_seed(2**63 - 1, 10**6) < 2**63
    assert mix_seed(7, 3) == mix_seed(7, 3)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device: str) -> None:
    logits = random_logits(16, 100, device=device)
    rows = [row(seed=i, temperature=0.0) for i in range(16)]
    out = sample(logits, rows, eos_token_ids=(3,))
    assert out.dtype == torch.int64 and out.device == logits.device
    assert torch.equal(out, logits.argmax(dim=-1))


def test_greedy_fast_path_does_not_touch_logits() -> None:
    logits = random_logits(4, 50)
    rows = [row(temperature=0.0, repetition_penalty=1.5, output_ids=(1, 2)) for _ in range(4)]
    rows += [row(temperature=1.0, top_k=3, min_p=0.1, min_new_tokens=5)]
    logits = torch.cat([logits, random_logits(1, 50, seed=1)])
    before = logits.clone()
    sample(logits, rows, eos_token_ids=(0,))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1e-3},
        {"temperature": 1.0, "top_k": 1},
        {"temperature": 1.5, "top_p": 1e-6},
        {"temperature": 2.0, "min_p": 1.0},
        {"temperature": 1.0, "top_k": 5, "top_p": 1e-6, "min_p": 0.5},
    ],
)
def test_degenerate_filters_are_greedy(device: str, params: dict[str, float]) -> None:
    # Logits spaced >= 0.05 apart so temperature 1e-3 leaves no room for a second token.
    vocab = 64
    logits = torch.stack(
        [
            torch.randperm(vocab, generator=torch.Generator().manual_seed(i)).float() * 0.05 * vocab
            for i in range(32)
        ]
    ).to(device)
    rows = [row(seed=1000 + i, **params) for i in range(32)]
    for step in range(3):
        rows = [SamplingRow(r.params, r.seed, (), (0,) * step, step) for r in rows]
        assert torch.equal(sample(logits, rows), logits.argmax(dim=-1))


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens_whatever_the_neighbours(device: str) -> None:
    vocab, steps = 300, 6
    target_logits = [random_logits(1, vocab, seed=100 + s, device=device)[0] for s in range(steps)]
    target = dict(seed=1234, prompt_ids=(5, 6), temperature=0.9, top_k=50, top_p=0.95)
    neighbours = [
        dict(seed=1, temperature=0.0),
        dict(seed=2, temperature=1.3, repetition_penalty=1.3, min_p=0.05),
        dict(seed=3, temperature=0.7, frequency_penalty=0.5, min_new_tokens=3),
        dict(seed=4, temperature=1.0, top_p=0.5),
    ]
    layouts: list[tuple[list[dict[str, object]], int]] = [
        ([], 0),
        (neighbours[:1], 1),
        (neighbours, 2),
        (neighbours[::-1], 4),
        (neighbours[2:] * 3, 0),
    ]
    runs = []
    for layout_index, (others, position) in enumerate(layouts):
        output: tuple[int, ...] = ()
        for step in range(steps):
            kwargs = [dict(n, output_ids=(7,) * step) for n in others]
            kwargs.insert(position, dict(target, output_ids=output))
            rows = [row(**k) for k in kwargs]  # type: ignore[arg-type]
            logits = random_logits(len(rows), vocab, seed=layout_index * 97 + step, device=device)
            logits[position] = target_logits[step]
            output += (int(sample(logits, rows, eos_token_ids=(0,))[position]),)
        runs.append(output)
    assert all(run == runs[0] for run in runs), runs
    assert len(set(runs[0])) > 1


@pytest.mark.parametrize("device", DEVICES)
def test_different_seeds_differ(device: str) -> None:
    logits = torch.zeros(64, 1000, device=device)
    rows = [row(seed=seed, output_ids=(1, 2, 3)) for seed in range(64)]
    out = sample(logits, rows).tolist()
    assert len(set(out)) > 50
    later = sample(logits, [SamplingRow(r.params, r.seed, (), (1, 2, 3, 4), 4) for r in rows])
    assert later.tolist() != out


def test_repetition_penalty_is_hf_style() -> None:
    # positive logit divided: 2.0 -> 1.0 < 1.5, so token 1 wins
    logits = torch.tensor([[2.0, 1.5, -1.0]])
    assert sample(logits, [row(temperature=0.0, prompt_ids=(0,), repetition_penalty=2.0)]) == 1
    # negative logit multiplied: -1.0 -> -2.0 < -1.5
    logits = torch.tensor([[-1.0, -1.5, -3.0]])
    assert sample(logits, [row(temperature=0.0, output_ids=(0,), repetition_penalty=2.0)]) == 1
    # penalty < 1 rewards: 1.0 -> 2.0 > 1.5
    logits = torch.tensor([[1.5, 1.0]])
    assert sample(logits, [row(temperature=0.0, output_ids=(1,), repetition_penalty=0.5)]) == 1
    # counted once however often it repeats
    logits = torch.tensor([[2.0, 1.1]])
    assert sample(logits, [row(temperature=0.0, output_ids=(0,) * 5, repetition_penalty=1.5)]) == 0


def test_frequency_penalty_scales_with_count() -> None:
    logits = torch.tensor([[3.0, 2.5]])
    assert sample(logits, [row(temperature=0.0, output_ids=(0, 0), frequency_penalty=0.3)]) == 1
    assert sample(logits, [row(temperature=0.0, output_ids=(0, 0), frequency_penalty=0.2)]) == 0
    assert sample(logits, [row(temperature=0.0, output_ids=(0,), frequency_penalty=0.3)]) == 0
    # prompt tokens do not count for frequency
    assert sample(logits, [row(temperature=0.0, prompt_ids=(0,) * 9, frequency_penalty=2.0)]) == 0
    # negative penalty encourages
    assert sample(logits, [row(temperature=0.0, output_ids=(1,), frequency_penalty=-1.0)]) == 1


def test_presence_penalty_is_flat() -> None:
    logits = torch.tensor([[3.0, 2.5]])
    assert sample(logits, [row(temperature=0.0, output_ids=(0,) * 3, presence_penalty=0.6)]) == 1
    assert sample(logits, [row(temperature=0.0, output_ids=(0,) * 9, presence_penalty=0.4)]) == 0


def test_penalties_stay_in_their_row() -> None:
    logits = torch.tensor([[3.0, 2.5], [3.0, 2.5], [3.0, 2.5]])
    rows = [
        row(temperature=0.0, output_ids=(0,)),
        row(temperature=0.0, output_ids=(0,), presence_penalty=1.0),
        row(temperature=0.0, output_ids=(0,)),
    ]
    assert sample(logits, rows).tolist() == [0, 1, 0]


def test_penalties_apply_before_sampling() -> None:
    logits = torch.tensor([[10.0, 0.0, -10.0]]).repeat(400, 1)
    rows = [
        row(seed=s, output_ids=(0,), presence_penalty=2.0, repetition_penalty=2.0)
        for s in range(400)
    ]
    # 10 / 2 - 2 = 3: token 1 now has probability 1 / (1 + e^3) ~ 0.047 instead of e^-10.
    out = sample(logits, rows).tolist()
    assert 5 < out.count(1) < 40 and 2 not in out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_new_tokens_masks_eos_and_stop_tokens(temperature: float) -> None:
    logits = torch.tensor([[0.0, 50.0, 40.0, 30.0, 0.0]])
    kwargs = dict(temperature=temperature, min_new_tokens=2, stop_token_ids=(2,))

    def pick(num_output: int) -> int:
        return int(sample(logits, [row(seed=3, output_ids=(4,) * num_output, **kwargs)], (1,)))

    assert pick(0) == 3 and pick(1) == 3
    assert pick(2) == 1
    assert int(sample(logits, [row(temperature=temperature, min_new_tokens=2)], ())) == 1


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


def draw_counts(params: dict[str, float], probs: list[float], num: int = 4000) -> list[int]:
    logits = torch.tensor(probs).log().repeat(num, 1)
    rows = [row(seed=10_000 + s, output_ids=(0,) * (s % 3), **params) for s in range(num)]
    out = sample(logits, rows)
    return torch.bincount(out, minlength=len(probs)).tolist()


# 99.9% quantiles of chi-square with 1, 2 and 3 degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27}


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"top_k": 2}, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        ({"top_p": 0.7}, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        ({"top_k": 3, "top_p": 0.9}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        ({"min_p": 0.25}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        ({}, [0.5, 0.3, 0.15, 0.05]),
        ({"temperature": 2.0}, [math.sqrt(p) for p in (0.5, 0.3, 0.15, 0.05)]),
    ],
)
def test_sampled_distribution(params: dict[str, float], expected: list[float]) -> None:
    expected = [p / sum(expected) for p in expected]
    counts = draw_counts(params, [0.5, 0.3, 0.15, 0.05])
    support = [i for i, p in enumerate(expected) if p > 0]
    assert all(counts[i] == 0 for i, p in enumerate(expected) if p == 0), counts
    stat = chi_square([counts[i] for i in support], [expected[i] for i in support])
    assert stat < CHI2_999[len(support) - 1], (counts, expected)


def test_filters_stay_in_their_row() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().repeat(400, 1)
    rows = [
        row(seed=s, **({"top_k": 1} if s % 2 else {"min_p": 0.2} if s % 4 else {}))
        for s in range(400)
    ]
    out = sample(logits, rows).tolist()
    assert all(token == 0 for token in out[1::2])  # top_k 1
    assert set(out[2::4]) == {0, 1, 2}  # min_p 0.2 drops 0.05 only
    assert set(out[0::4]) == {0, 1, 2, 3}  # unfiltered


def test_top_k_ties_same_on_both_paths() -> None:
    logits = torch.tensor([[2.0, 2.0, 2.0, 0.0]]).repeat(200, 1)
    rows = [row(seed=s, top_k=2) for s in range(200)]
    alone = sample(logits, rows)  # torch.topk path
    nucleus_neighbour = row(seed=0, top_p=0.5)
    mixed = sample(torch.cat([logits, logits[:1]]), [*rows, nucleus_neighbour])  # sort path
    assert torch.equal(alone, mixed[:-1])
    assert set(alone.tolist()) == {0, 1, 2}  # all ties with the 2nd stay


def test_empty_batch_and_logprobs() -> None:
    assert sample(torch.zeros(0, 8), []).shape == (0,)
    logits = torch.tensor([[0.0, math.log(3.0)]])
    chosen, values, ids = compute_logprobs(logits, torch.tensor([1]))
    assert torch.allclose(chosen, torch.tensor([math.log(0.75)]))
    assert values.shape == ids.shape == (1, 0)
    chosen, values, ids = compute_logprobs(logits, torch.tensor([0]), top_k=2)
    assert torch.allclose(chosen, torch.tensor([math.log(0.25)]))
    assert ids.tolist() == [[1, 0]]
    assert torch.allclose(values, torch.tensor([[math.log(0.75), math.log(0.25)]]))
