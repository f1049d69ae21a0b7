"""Greedy tokens equal transformers `generate(do_sample=False)` under every scheduling path."""

from __future__ import annotations

import asyncio

import pytest
from engines import EngineFactory
from parity import NEW_TOKENS, expect, mixed_prompts, run_all
from reference import Reference


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("chunk_size", [7, 512])
async def test_concurrent_greedy_matches_transformers(
    make_engine: EngineFactory, tiny_reference: Reference, page_size: int, chunk_size: int
) -> None:
    engine = await make_engine(page_size=page_size, chunk_size=chunk_size, kv_cache_tokens=4096)
    prompts = mixed_prompts(engine.loaded.config.vocab_size)
    done = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in done] == expect(tiny_reference, prompts)
    for d, p in zip(done, prompts, strict=True):
        assert d.usage.prompt_tokens == len(p)
        assert d.usage.completion_tokens == len(d.token_ids)
        assert d.finish_reason in ("stop", "length")
    # A second wave hits the prefix cache and still gives the same tokens.
    again = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in again] == expect(tiny_reference, prompts)
    long_ones = [d for d, p in zip(again, prompts, strict=True) if len(p) > page_size + 1]
    assert all(d.usage.cached_tokens > 0 for d in long_ones)


@pytest.mark.parametrize("page_size", [1, 4])
async def test_small_pool_forces_retraction(
    make_engine: EngineFactory, tiny_reference: Reference, page_size: int
) -> None:
    engine = await make_engine(page_size=page_size, chunk_size=16, kv_cache_tokens=240)
    prompts = mixed_prompts(engine.loaded.config.vocab_size)[1:]
    done = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in done] == expect(tiny_reference, prompts)
    assert (await engine.snapshot()).num_retractions > 0


async def test_running_cap_forces_queuing(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    engine = await make_engine(page_size=4, max_running_requests=2)
    prompts = mixed_prompts(engine.loaded.config.vocab_size)
    streams = [
        engine.generate(input_ids=p, max_new_tokens=NEW_TOKENS, temperature=0.0) for p in prompts
    ]
    await asyncio.sleep(0)
    seen_waiting = 0
    while not all(s.ended for s in streams):
        snap = await engine.snapshot()
        holding = len(snap.prefill) + len(snap.running) + len(snap.finishing)
        assert holding <= 2
        seen_waiting = max(seen_waiting, len(snap.waiting))
        await asyncio.sleep(0.002)
    done = await asyncio.gather(*(s.result() for s in streams))
    assert [list(d.token_ids) for d in done] == expect(tiny_reference, prompts)
    assert seen_waiting >= 4


@pytest.mark.parametrize("max_inflight", [1, 3])
async def test_overlap_depth_does_not_change_tokens(
    make_engine: EngineFactory, tiny_reference: Reference, max_inflight: int
) -> None:
    engine = await make_engine(page_size=4, chunk_size=16, max_inflight=max_inflight)
    prompts = mixed_prompts(engine.loaded.config.vocab_size)
    done = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in done] == expect(tiny_reference, prompts)


async def test_prefix_cache_off_reuses_nothing_and_changes_no_token(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    engine = await make_engine(page_size=4, prefix_cache=False, kv_cache_tokens=240)
    prompts = mixed_prompts(engine.loaded.config.vocab_size)[1:]
    for _ in range(2):
        done = await run_all(engine, prompts)
        assert [list(d.token_ids) for d in done] == expect(tiny_reference, prompts)
        assert all(d.usage.cached_tokens == 0 for d in done)
    assert (await engine.cache_stats()).cached_tokens == 0
