"""results.py's RequestStream: a reader that waits gets a Delta a push; one that fell behind
gets what came since its last read as one Delta; ends, failures, aborts and cancellation as
before."""

from __future__ import annotations

import asyncio
import random

import pytest
from engines import EngineFactory
from reference import Reference

from shoal.results import Completion, Delta, RequestStream, TokenLogprob, Usage


def delta(i: int, logprobs: bool = False) -> Delta:
    return Delta(f"t{i} ", (i,), (TokenLogprob(i, -0.5 * i),) if logprobs else None)


def completion(rid: str, reason: str = "length") -> Completion:
    return Completion(rid, "", (), reason, Usage(1, 0, 0))  # type: ignore[arg-type]


async def test_a_waiting_reader_gets_one_delta_a_push() -> None:
    stream = RequestStream("r", lambda rid: None)
    got: list[Delta] = []
    each = asyncio.Event()

    async def read() -> None:
        async for d in stream:
            got.append(d)
            each.set()

    reader = asyncio.create_task(read())
    for i in range(5):
        each.clear()
        stream.push(delta(i))
        await each.wait()  # the reader took it and waits again before this task resumes
    stream.finish(completion("r"))
    await reader
    assert got == [delta(i) for i in range(5)]


async def test_a_reader_behind_gets_everything_since_its_last_read_as_one_delta() -> None:
    stream = RequestStream("r", lambda rid: None)
    stream.push(delta(0, True))
    assert await anext(stream) == delta(0, True)
    for i in range(1, 6):
        stream.push(delta(i, True))
    stream.push(Delta("!", ()))  # the flush's text at the end: no token, no logprob
    stream.finish(completion("r"))
    rest = [d async for d in stream]
    assert rest == [
        Delta(
            "t1 t2 t3 t4 t5 !",
            (1, 2, 3, 4, 5),
            tuple(TokenLogprob(i, -0.5 * i) for i in range(1, 6)),
        )
    ]
    assert (await stream.result()).finish_reason == "length"


async def test_what_came_before_a_failure_is_read_then_the_failure() -> None:
    stream = RequestStream("r", lambda rid: None)
    stream.push(delta(1))
    stream.push(delta(2))
    stream.fail(RuntimeError("boom"))
    stream.push(delta(3))  # after the end: dropped
    assert await anext(stream) == Delta("t1 t2 ", (1, 2))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="boom"):
            await anext(stream)


async def test_cancelling_a_waiting_reader_aborts_the_request() -> None:
    aborted: list[str] = []
    stream = RequestStream("r", aborted.append)
    reader = asyncio.create_task(anext(stream))
    await asyncio.sleep(0)  # let it start waiting: nothing else to wait for
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert aborted == ["r"]
    stream.push(delta(1))  # the cancelled waiter is skipped
    stream.finish(completion("r", "abort"))
    assert [d async for d in stream] == [delta(1)]
    assert (await stream.result()).finish_reason == "abort"


async def test_two_waiting_readers_both_wake() -> None:
    stream = RequestStream("r", lambda rid: None)
    first, second = asyncio.create_task(anext(stream)), asyncio.create_task(anext(stream))
    await asyncio.sleep(0)  # both wait
    stream.push(delta(1))
    stream.finish(completion("r"))
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert sorted(results, key=lambda r: isinstance(r, StopAsyncIteration))[0] == delta(1)
    assert any(isinstance(r, StopAsyncIteration) for r in results)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


async def test_a_reader_that_reads_nothing_until_the_end_gets_one_delta_of_it_all(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    engine = await make_engine()
    ids = prompt(7, 1)
    stream = engine.generate(
        input_ids=ids, max_new_tokens=12, temperature=0.0, ignore_eos=True, top_logprobs=2
    )
    await engine.wait_idle()  # all 12 tokens pushed, none read
    deltas = [d async for d in stream]
    done = await stream.result()
    assert len(deltas) == 1
    assert deltas[0].text == done.text and deltas[0].token_ids == done.token_ids
    assert deltas[0].logprobs == done.logprobs and len(done.token_ids) == 12
    assert list(done.token_ids) == tiny_reference.greedy(ids, 12, True)


async def test_a_slow_readers_stream_aborts_whole(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    """Read one Delta, fall behind for several steps, abort: the rest comes as one Delta,
    then the abort's Completion, whose tokens and text are all the Deltas'."""
    engine = await make_engine(max_inflight=1)
    ids = prompt(5, 2)
    engine.testing.hold()
    stream = engine.generate(input_ids=ids, max_new_tokens=200, temperature=0.0, ignore_eos=True)
    for _ in range(8):
        if await engine.testing.advance() is not None:
            await engine.testing.deliver()
    first = await anext(stream)
    for _ in range(6):
        if await engine.testing.advance() is not None:
            await engine.testing.deliver()
    engine.abort(stream.rid)
    engine.testing.release()
    await engine.wait_idle()
    rest = [d async for d in stream]
    done = await stream.result()
    assert done.finish_reason == "abort" and len(rest) == 1
    assert first.token_ids + rest[0].token_ids == done.token_ids
    assert first.text + rest[0].text == done.text
    assert len(rest[0].token_ids) >= 5
    assert list(done.token_ids) == tiny_reference.greedy(ids, len(done.token_ids), True)
