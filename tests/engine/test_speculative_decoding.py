"""Speculative decoding on the engine (issue 35): greedy rows give transformers' tokens with
n-gram drafts verified in one step, across page sizes, chunked prefill, prefix hits and
sessions; sampled rows stay seeded; the counters show drafts were verified and kept."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from engines import EngineFactory
from parity import copying_prompts
from reference import Reference
from workload import greedy

pytestmark = pytest.mark.usefixtures("eager_drafts")  # drafts at every match (conftest.py)

SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}
NEW = 24


async def run(engine: Any, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    streams = [engine.generate(input_ids=p, **greedy(new)) for p in prompts]
    return [list(d.token_ids) for d in await asyncio.gather(*(s.result() for s in streams))]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk_size", [7, 512])
async def test_greedy_with_drafts_matches_transformers(
    make_engine: EngineFactory, tiny_reference: Reference, page_size: int, chunk_size: int
) -> None:
    engine = await make_engine(page_size=page_size, chunk_size=chunk_size, **SPEC)
    prompts = copying_prompts(engine.loaded.config.vocab_size)
    expected = [tiny_reference.greedy(p, NEW) for p in prompts]
    assert await run(engine, prompts) == expected
    first = await engine.snapshot()
    assert first.spec_steps > 0 and first.spec_accepted > 0
    # again: the prompts' KV comes from the tree, and no rejected draft's KV went there
    assert await run(engine, prompts) == expected
    assert (await engine.snapshot()).spec_accepted > first.spec_accepted


async def test_one_stream_at_a_time_matches(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    engine = await make_engine(page_size=4, **SPEC)
    for prompt in copying_prompts(engine.loaded.config.vocab_size, seed=11):
        assert await run(engine, [prompt], 40) == [tiny_reference.greedy(prompt, 40)]
    assert (await engine.snapshot()).spec_accepted > 0


async def test_session_turns_with_drafts_equal_the_full_history(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    engine = await make_engine(page_size=4, **SPEC)
    vocab = engine.loaded.config.vocab_size
    history: list[int] = []
    async with await engine.open_session() as session:
        for turn, new in enumerate(copying_prompts(vocab, seed=5)):
            done = await session.turn(input_ids=new, **greedy(12)).result()
            assert list(done.token_ids) == tiny_reference.greedy(history + new, 12, True), turn
            history += new + list(done.token_ids)
    assert (await engine.snapshot()).spec_steps > 0


async def test_seeded_sampling_with_drafts_repeats_and_ends_right(
    make_engine: EngineFactory,
) -> None:
    engine = await make_engine(page_size=4, **SPEC)
    prompts = copying_prompts(engine.loaded.config.vocab_size)
    sampling = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": NEW, "ignore_eos": True}

    async def once() -> list[list[int]]:
        streams = [engine.generate(input_ids=p, seed=9, **sampling) for p in prompts]
        return [list(d.token_ids) for d in await asyncio.gather(*(s.result() for s in streams))]

    first = await once()
    assert all(len(tokens) == NEW for tokens in first)
    assert await once() == first
    assert (await engine.snapshot()).spec_steps > 0


async def test_past_max_running_drafts_nothing(make_engine: EngineFactory) -> None:
    engine = await make_engine(page_size=4, speculative_max_running=2, **SPEC)
    prompts = copying_prompts(engine.loaded.config.vocab_size)
    await run(engine, prompts, 8)  # four at once: more than 2 run
    assert (await engine.snapshot()).spec_steps == 0


async def test_pipeline_stages_verify_drafts_on_the_last_stage(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    """Two stages (the tiny model's two layers one a stage): the last stage's head gives the
    drafts' targets, and greedy rows keep transformers' tokens; sampled rows repeat."""
    engine = await make_engine(page_size=4, pipeline_stages=2, **SPEC)
    prompts = copying_prompts(engine.loaded.config.vocab_size)
    assert await run(engine, prompts) == [tiny_reference.greedy(p, NEW) for p in prompts]
    greedy_steps = (await engine.snapshot()).spec_steps
    assert greedy_steps > 0
    # near greedy, so the answers repeat as the greedy ones do and drafts are sent
    sampling = {"temperature": 0.3, "max_new_tokens": NEW, "ignore_eos": True, "seed": 4}
    firsts = [await engine.generate(input_ids=p, **sampling).result() for p in prompts]
    agains = [await engine.generate(input_ids=p, **sampling).result() for p in prompts]
    assert [d.token_ids for d in firsts] == [d.token_ids for d in agains]
    assert all(len(d.token_ids) == NEW for d in firsts)
    assert (await engine.snapshot()).spec_steps > greedy_steps


async def test_min_new_tokens_and_stop_ids_with_drafts(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    """A request drafts only once its min_new_tokens are out (its stop tokens are masked
    till then, a per-token edit), and a stop id among kept drafts ends it there."""
    engine = await make_engine(page_size=4, **SPEC)
    prompt = copying_prompts(engine.loaded.config.vocab_size)[2]
    want = tiny_reference.greedy(prompt, NEW, True)
    done = await engine.generate(input_ids=prompt, min_new_tokens=8, **greedy(NEW)).result()
    assert list(done.token_ids) == want
    stop = want[10]
    cut = want[: want.index(stop) + 1]
    done = await engine.generate(input_ids=prompt, stop_token_ids=[stop], **greedy(NEW)).result()
    assert list(done.token_ids) == cut and done.finish_reason == "stop"
    assert (await engine.snapshot()).spec_steps > 0
