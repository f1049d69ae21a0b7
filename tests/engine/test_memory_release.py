"""Memory release and resume (api/memory_calls.py): a writer of the update lock, so it waits
for in-flight requests, new ones wait while anything is released, paused ones stay parked,
and after the resume every request answers as before (the weights rebuilt from where they
came: the checkpoint, or the last push's host copy)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engines import EngineFactory
from weight_pushes import checkpoint
from workload import prompt

from shoal import Engine

IDS = prompt(9, 0)


async def greedy(engine: Engine, n: int = 8) -> list[int]:
    done = await engine.generate(
        input_ids=IDS, max_new_tokens=n, temperature=0.0, ignore_eos=True
    ).result()
    return list(done.token_ids)


async def test_requests_wait_while_released_and_answer_the_same_after(
    make_engine: EngineFactory,
) -> None:
    engine = await make_engine(page_size=4)
    before = await greedy(engine)
    stats = await engine.cache_stats()
    assert stats.cached_tokens > 0  # the prompt's pages are in the prefix cache
    released = await engine.release_memory_occupation()
    assert released.success and released.message == "memory released kv_cache, weights"
    assert (await engine.cache_stats()).cached_tokens == 0  # flushed with the KV pool
    waiting = asyncio.create_task(greedy(engine))
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert not waiting.done()  # queued behind the released memory, never run on it
    half = await engine.resume_memory_occupation(["kv_cache"])
    assert half.success
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert not waiting.done()  # the weights are still released
    assert (await engine.resume_memory_occupation(["weights"])).success
    assert await waiting == before
    assert engine.weight_version == "0"


async def test_a_release_waits_for_the_requests_in_flight(make_engine: EngineFactory) -> None:
    engine = await make_engine(page_size=4)
    engine.testing.hold()  # the scheduler stops launching: the request stays in flight
    running = engine.generate(input_ids=IDS, max_new_tokens=6, temperature=0.0, ignore_eos=True)
    releasing = asyncio.create_task(engine.release_memory_occupation(["kv_cache"]))
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert not releasing.done()
    engine.testing.release()
    done = await running.result()
    assert done.finish_reason == "length" and len(done.token_ids) == 6
    assert (await releasing).success
    assert (await engine.resume_memory_occupation()).success
    assert await greedy(engine, 6) == list(done.token_ids)


async def test_paused_requests_stay_parked_until_the_memory_is_back(
    make_engine: EngineFactory,
) -> None:
    engine = await make_engine(page_size=4)
    before = await greedy(engine, 24)
    stream = engine.generate(input_ids=IDS, max_new_tokens=24, temperature=0.0, ignore_eos=True)
    await anext(aiter(stream))  # it runs
    engine.pause_generation("in_place")
    assert (await engine.release_memory_occupation()).success  # parked: its KV given back
    engine.continue_generation()  # released: it stays parked
    for _ in range(20):
        await asyncio.sleep(0.01)
    snap = await engine.snapshot()
    assert not snap.idle
    assert (await engine.resume_memory_occupation()).success
    done = await stream.result()
    assert list(done.token_ids) == before  # prefilled again, on the same weights


async def test_pushed_weights_come_back_and_an_update_needs_them_resumed(
    make_engine: EngineFactory, other_folder: Path
) -> None:
    engine = await make_engine(page_size=4)
    tiny = await greedy(engine)
    pushed = await engine.update_weights_from_tensor(checkpoint(other_folder))
    assert pushed.success
    other = await greedy(engine)
    assert other != tiny
    assert (await engine.release_memory_occupation(["weights"])).success
    refused = await engine.update_weights_from_tensor(checkpoint(other_folder))
    assert not refused.success and "released" in refused.message
    assert (await engine.resume_memory_occupation(["weights"])).success
    assert await greedy(engine) == other  # the pushed weights, not the checkpoint's
    for tags, why in ((["gpu"], "tags must name"), ([], "tags must name")):
        wrong = await engine.release_memory_occupation(tags)
        assert not wrong.success and why in wrong.message
    assert (await engine.resume_memory_occupation()).success  # nothing released: a no-op
