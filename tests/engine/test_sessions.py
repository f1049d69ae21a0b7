"""Streaming sessions on the Engine: KV kept across turns, prefill of only the new tokens,
turn-by-turn equality with a stateless request on the full history, rollback, cleanup."""

from __future__ import annotations

import asyncio
import random

import pytest
from engines import EngineFactory
from reference import Reference
from workload import greedy, idle_stats

from shoal.results import RequestError


@pytest.mark.parametrize("page_size", [1, 4, 16])
async def test_thirty_turns_equal_stateless_requests_on_the_full_history(
    make_engine: EngineFactory, tiny_reference: Reference, page_size: int
) -> None:
    engine = await make_engine(page_size=page_size, kv_cache_tokens=4096)
    rng = random.Random(page_size)
    history: list[int] = []
    cached = []
    async with await engine.open_session() as session:
        for turn in range(30):
            out = 3
            # Land the history after this turn's input on a page boundary, one before or after.
            target = (len(history) // page_size + 1) * page_size + (turn % 3 - 1)
            new_len = max(1, target - len(history))
            new = [rng.randrange(3, 500) for _ in range(new_len)]
            done = await session.turn(input_ids=new, **greedy(out)).result()
            expected = tiny_reference.greedy(history + new, out, True)
            assert list(done.token_ids) == expected, f"turn {turn}"
            assert done.usage.prompt_tokens == len(history) + new_len
            cached.append(done.usage.cached_tokens)
            if history:
                assert done.usage.cached_tokens >= len(history) - 1
            history += new + list(done.token_ids)
    assert cached == sorted(cached) and cached[-1] > 100
    stats = await idle_stats(engine)
    assert stats.session_pages == 0 and stats.locked_pages == 0


async def test_an_aborted_turn_rolls_back_and_the_next_turn_is_correct(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    engine = await make_engine(page_size=4)
    session = await engine.open_session()
    first = [5, 6, 7, 8, 9, 10, 11]
    done = await session.turn(input_ids=first, **greedy(5)).result()
    history = first + list(done.token_ids)
    stream = session.turn(input_ids=[40, 41, 42], **greedy(300))
    async for _ in stream:
        stream.abort()
    assert (await stream.result()).finish_reason == "abort"
    after = await session.turn(input_ids=[50, 51], **greedy(6)).result()
    assert list(after.token_ids) == tiny_reference.greedy([*history, 50, 51], 6, True)
    assert after.usage.cached_tokens >= len(history) - 1
    await session.close()


async def test_one_turn_at_a_time(make_engine: EngineFactory, tiny_reference: Reference) -> None:
    engine = await make_engine()
    session = await engine.open_session()
    first = session.turn(input_ids=[5, 6, 7], **greedy(40))
    second = session.turn(input_ids=[8], **greedy(3))
    with pytest.raises(ValueError, match="one turn at a time"):
        await second.result()
    assert list((await first.result()).token_ids) == tiny_reference.greedy([5, 6, 7], 40, True)
    # Right after a turn ends (its KV may still be on its way back), the next one is fine.
    third = await session.turn(input_ids=[8], **greedy(3)).result()
    assert third.finish_reason == "length"
    await session.close()


async def test_close_during_a_turn_waits_for_it_then_releases_everything(
    make_engine: EngineFactory,
) -> None:
    engine = await make_engine(page_size=4)
    start = await idle_stats(engine)
    session = await engine.open_session()
    stream = session.turn(input_ids=list(range(5, 30)), **greedy(30))
    await asyncio.sleep(0.01)
    await session.close()
    assert (await stream.result()).finish_reason == "length"
    with pytest.raises(ValueError, match="not open"):
        await session.turn(input_ids=[5], **greedy(2)).result()
    end = await idle_stats(engine)
    assert end.session_pages == end.locked_pages == end.request_pages == 0
    assert end.free_pages + end.evictable_pages == start.free_pages


async def test_an_idle_session_is_reaped_after_its_timeout(make_engine: EngineFactory) -> None:
    engine = await make_engine(page_size=4)
    session = await engine.open_session(timeout_s=0.2)
    await session.turn(input_ids=list(range(5, 20)), **greedy(4)).result()
    kept = await idle_stats(engine)
    assert kept.session_pages + (await engine.cache_stats()).locked_pages > 0
    await asyncio.sleep(0.5)
    stats = await engine.cache_stats()
    assert stats.session_pages == stats.locked_pages == 0
    with pytest.raises(ValueError, match="not open"):
        await session.turn(input_ids=[5], **greedy(2)).result()


async def test_session_limits(make_engine: EngineFactory) -> None:
    engine = await make_engine(max_sessions=2)
    a = await engine.open_session(session_id="a")
    with pytest.raises(ValueError, match="already open"):
        await engine.open_session(session_id="a")
    await engine.open_session(session_id="b")
    with pytest.raises(ValueError, match="too many"):
        await engine.open_session()
    capped = await engine.close_session("b") or await engine.open_session(max_tokens=20)
    with pytest.raises(ValueError, match="max_tokens"):
        await capped.turn(input_ids=list(range(5, 20)), **greedy(10)).result()
    await a.close()
    await capped.close()


async def test_message_turns_apply_the_template_incrementally(
    make_engine: EngineFactory,
) -> None:
    """The history's tokens decode to the template applied to the whole conversation."""
    engine = await make_engine()
    tok = engine.tokenizer
    session = await engine.open_session()
    history: list[dict[str, str]] = []
    for turn, text in enumerate(("Hello there", "Tell me more", "Thanks", "Bye now")):
        message = {"role": "user", "content": text}
        done = await session.turn(
            messages=[message], max_new_tokens=4 + turn, temperature=0.0
        ).result()
        history.append(message)
        await engine.wait_idle()  # the history is committed when the turn's KV is released
        tokens = engine.actors.tokenizer.sessions.states[session.id].tokens
        prompt = tok.decode(tokens[: done.usage.prompt_tokens], skip_special_tokens=False)
        expected = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        assert prompt == expected, f"turn {turn}"
        # The reply as the model emitted it (special tokens included, its end-of-turn not).
        raw = tok.decode(list(done.token_ids), skip_special_tokens=False)
        history.append({"role": "assistant", "content": raw.removesuffix("<|im_end|>")})
    await session.close()


async def test_sessions_under_memory_pressure_with_other_traffic(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    engine = await make_engine(page_size=4, kv_cache_tokens=700, chunk_size=32)
    rng = random.Random(5)

    async def converse(index: int) -> None:
        history: list[int] = []
        async with await engine.open_session() as session:
            for turn in range(20):
                new = [rng.randrange(3, 500) for _ in range(rng.randint(1, 6))]
                done = await session.turn(input_ids=new, **greedy(2)).result()
                expected = tiny_reference.greedy(history + new, 2, True)
                assert list(done.token_ids) == expected, f"session {index} turn {turn}"
                history += new + list(done.token_ids)

    async def traffic() -> None:
        for i in range(30):
            ids = [rng.randrange(3, 500) for _ in range(rng.randint(5, 60))]
            done = await engine.generate(input_ids=ids, **greedy(4)).result()
            assert list(done.token_ids) == tiny_reference.greedy(ids, 4, True), f"request {i}"

    await asyncio.gather(*(converse(i) for i in range(8)), traffic(), traffic())
    stats = await idle_stats(engine)
    assert stats.session_pages == stats.locked_pages == 0
    assert stats.sessions_reclaimed > 0  # the pool really was too small to keep them all


async def test_a_session_timeout_is_bounded(make_engine: EngineFactory) -> None:
    """timeout_s past max_session_timeout_s is refused naming the bound, never clamped; none
    given is the default or the bound if lower."""
    engine = await make_engine(max_session_timeout_s=100.0)
    for huge in (1e300, float("inf"), 100.5):
        with pytest.raises(RequestError, match=r"max_session_timeout_s") as refused:
            await engine.open_session(timeout_s=huge)
        assert refused.value.field == "timeout_s" and "(0, 100]" in str(refused.value)
    books = engine.actors.tokenizer.sessions
    assert not books.states
    at_bound = await engine.open_session(timeout_s=100.0)
    default = await engine.open_session()
    assert books.states[at_bound.id].timeout_s == books.states[default.id].timeout_s == 100.0
    await at_bound.close()
    await default.close()


async def test_one_client_cannot_take_every_session(make_engine: EngineFactory) -> None:
    engine = await make_engine(max_sessions=4, max_sessions_per_client=2)
    books = engine.actors.tokenizer.sessions
    mine = [await engine.open_session(client="10.0.0.1") for _ in range(2)]
    with pytest.raises(RequestError, match="max_sessions_per_client") as refused:
        await engine.open_session(client="10.0.0.1")
    assert refused.value.code == "too_many_sessions"
    other = await engine.open_session(client="10.0.0.2")  # another client still gets one
    unnamed = await engine.open_session()  # the Python API names no client: not counted
    assert books.per_client == {"10.0.0.1": 2, "10.0.0.2": 1}
    await mine[0].close()  # a closed session frees its client's slot
    mine[0] = await engine.open_session(client="10.0.0.1")
    for session in (*mine, other, unnamed):
        await session.close()
    assert books.per_client == {}
    reaped = await engine.open_session(timeout_s=0.05, client="10.0.0.3")
    for _ in range(200):  # a reaped session frees its slot too
        if reaped.id not in books.states:
            break
        await asyncio.sleep(0.01)
    assert reaped.id not in books.states and books.per_client == {}


async def test_a_messages_turn_after_a_text_turn_says_why(make_engine: EngineFactory) -> None:
    engine = await make_engine()
    async with await engine.open_session() as session:
        await session.turn("Hello there", max_new_tokens=2, temperature=0.0).result()
        with pytest.raises(RequestError, match="not a chat conversation") as refused:
            messages = [{"role": "user", "content": "and now?"}]
            await session.turn(messages=messages, max_new_tokens=2).result()
        assert refused.value.field == "messages"
        done = await session.turn(" and then", max_new_tokens=2, temperature=0.0).result()
        assert done.finish_reason in ("stop", "length")  # the session is still usable
