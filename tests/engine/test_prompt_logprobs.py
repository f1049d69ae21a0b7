"""Prompt logprobs (SamplingParams.logprob_start_len, token_ids_logprob) against transformers:
each reported prompt position's logprob is log_softmax of the model's logits at the position
before it, whatever the page size, the chunking and the prefix cache; a request asking for
them reuses no cached KV at the positions it asks for; max_new_tokens 0 answers the prefill
alone; the refusals are the caller's."""

from __future__ import annotations

import random

import pytest
import torch
from engines import EngineFactory
from reference import Reference

from shoal import RequestError
from shoal.results import Completion, PromptLogprobs

ATOL = 1e-4  # as the output logprobs' test (tests/api/test_engine_api.py)


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def oracle(reference: Reference, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of ids: [T, V]."""
    with torch.no_grad():
        logits = reference.model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_prompt(
    got: PromptLogprobs | None,
    prompt: list[int],
    expected: torch.Tensor,
    start: int,
    top: int = 0,
    listed: tuple[int, ...] = (),
) -> None:
    assert got is not None and got.start == start
    assert got.first_token_id == (prompt[0] if start == 0 else None)
    first = max(start, 1)
    assert [item.token_id for item in got.items] == prompt[first:]
    for position, item in zip(range(first, len(prompt)), got.items, strict=True):
        row = expected[position - 1]
        assert abs(item.logprob - float(row[item.token_id])) < ATOL, position
        assert item.rank == int((row > row[item.token_id]).sum()) + 1
        assert [t for t, _ in item.top] == row.topk(top).indices.tolist()
        for (_, value), want in zip(item.top, row.topk(top).values.tolist(), strict=True):
            assert abs(value - want) < ATOL
        assert len(item.listed) == len(listed)
        for value, token_id in zip(item.listed, listed, strict=True):
            assert abs(value - float(row[token_id])) < ATOL


@pytest.mark.parametrize(("page_size", "chunk_size"), [(1, 512), (16, 512), (16, 5), (1, 3)])
async def test_prompt_logprobs_are_the_models_at_every_position(
    make_engine: EngineFactory, tiny_reference: Reference, page_size: int, chunk_size: int
) -> None:
    engine = await make_engine(page_size=page_size, chunk_size=chunk_size)
    prompt = prompt_ids(23, 3)
    listed = (5, 77, 300)
    stream = engine.generate(
        input_ids=prompt,
        max_new_tokens=3,
        temperature=0.0,
        ignore_eos=True,
        logprob_start_len=0,
        top_logprobs=3,
        token_ids_logprob=listed,
    )
    deltas = [d async for d in stream]
    done = await stream.result()
    expected = oracle(tiny_reference, prompt + list(done.token_ids))
    check_prompt(done.prompt_logprobs, prompt, expected, 0, 3, listed)
    # streamed: with the first Delta, once
    assert deltas[0].prompt_logprobs == done.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    # the output tokens' logprobs report the listed ids too
    assert done.logprobs is not None and len(done.logprobs) == 3
    for step, item in enumerate(done.logprobs):
        row = expected[len(prompt) - 1 + step]
        for value, token_id in zip(item.listed, listed, strict=True):
            assert abs(value - float(row[token_id])) < ATOL
    plain = await engine.generate(
        input_ids=prompt, max_new_tokens=3, temperature=0.0, ignore_eos=True
    ).result()
    assert plain.token_ids == done.token_ids and plain.prompt_logprobs is None


async def test_a_prefix_cache_hit_never_skips_a_position_asked_for(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    """The prompt is cached whole (three pages of 4) before each ask: from position 0 nothing
    is reused, from position 9 at most the 8 positions before it (two pages), and every asked
    position is still reported, right."""
    engine = await make_engine(page_size=4)
    prompt = prompt_ids(14, 5)
    expected = oracle(tiny_reference, prompt)
    warm = await engine.generate(input_ids=prompt, max_new_tokens=1).result()
    again = await engine.generate(input_ids=prompt, max_new_tokens=1).result()
    assert warm.usage.cached_tokens == 0 and again.usage.cached_tokens == 12
    whole = await engine.generate(input_ids=prompt, max_new_tokens=1, logprob_start_len=0).result()
    assert whole.usage.cached_tokens == 0
    check_prompt(whole.prompt_logprobs, prompt, expected, 0)
    tail = await engine.generate(
        input_ids=prompt, max_new_tokens=1, logprob_start_len=9, top_logprobs=2
    ).result()
    assert tail.usage.cached_tokens == 8
    check_prompt(tail.prompt_logprobs, prompt, expected, 9, 2)
    last = await engine.generate(input_ids=prompt, max_new_tokens=1, logprob_start_len=13).result()
    check_prompt(last.prompt_logprobs, prompt, expected, 13)


async def test_max_new_tokens_zero_answers_the_prefill_alone(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    """slime's on-policy distillation scores a sequence: max_new_tokens 0, the prompt's
    logprobs from position 0."""
    engine = await make_engine(chunk_size=4)
    prompt = prompt_ids(11, 9)
    stream = engine.generate(
        input_ids=prompt, max_new_tokens=0, temperature=0.7, logprob_start_len=0, logprobs=True
    )
    deltas = [d async for d in stream]
    done: Completion = await stream.result()
    assert deltas == [] and done.token_ids == () and done.text == ""
    assert done.finish_reason == "length" and done.usage.completion_tokens == 0
    assert done.logprobs == ()
    check_prompt(done.prompt_logprobs, prompt, oracle(tiny_reference, prompt), 0)
    plain = await engine.generate(input_ids=prompt, max_new_tokens=0).result()
    assert plain.token_ids == () and plain.prompt_logprobs is None


async def test_prompt_logprobs_refusals(make_engine: EngineFactory) -> None:
    engine = await make_engine(max_token_ids_logprob=3)
    with pytest.raises(RequestError, match="logprob_start_len must be below") as caught:
        await engine.generate(input_ids=[5, 6, 7], logprob_start_len=3).result()
    assert caught.value.field == "logprob_start_len"
    with pytest.raises(RequestError, match="logprob_start_len") as caught:
        engine.generate(input_ids=[5, 6, 7], logprob_start_len=-2)
    with pytest.raises(RequestError, match="token_ids_logprob") as caught:
        engine.generate(input_ids=[5, 6, 7], logprob_start_len=0, token_ids_logprob=(1, 2, 3, 4))
    assert caught.value.code == "array_above_max_length"
    with pytest.raises(RequestError, match="token_ids_logprob") as caught:
        engine.generate(input_ids=[5, 6, 7], token_ids_logprob=(10**7,))
    with pytest.raises(RequestError, match="max_new_tokens"):
        engine.generate(input_ids=[5, 6, 7], max_new_tokens=-1)
    # below the prompt's length, any start is fine
    done = await engine.generate(
        input_ids=[5, 6, 7], max_new_tokens=1, logprob_start_len=2
    ).result()
    assert done.prompt_logprobs is not None and len(done.prompt_logprobs.items) == 1


async def test_a_session_turn_asking_from_the_start_gives_its_kept_kv_back(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    """A turn's prompt is its whole history: asked from position 0, it reuses none of the KV
    its session keeps (given back), and every position is the model's."""
    engine = await make_engine(page_size=4)
    first, second = prompt_ids(9, 11), prompt_ids(6, 12)
    async with await engine.open_session() as session:
        one = await session.turn(input_ids=first, max_new_tokens=3, temperature=0.0).result()
        history = first + list(one.token_ids)
        two = await session.turn(
            input_ids=second, max_new_tokens=2, temperature=0.0, logprob_start_len=0
        ).result()
    prompt = history + second
    assert two.usage.prompt_tokens == len(prompt) and two.usage.cached_tokens == 0
    check_prompt(two.prompt_logprobs, prompt, oracle(tiny_reference, prompt), 0)
