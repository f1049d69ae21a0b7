"""The tokenizer actor's way in (actors/tokenizer/intake.py): every prompt is encoded and
measured on the actor's worker thread, never on the event loop, and the Engine's messages
keep their order behind a prompt being measured.

A tokenizer that holds the encoding of any text with HOLD in it until the test lets it go
(`Held`) makes each case deterministic: while it holds, the event loop must keep serving
(other streams deliver, an abort ends the held request, the engine stops), and what was sent
after the held request must take effect after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from engines import EngineFactory

from shoal.api.engine import Engine
from shoal.models.load import LoadedModel
from shoal.results import EngineDeadError

HOLD = "hold-this-prompt"
PROMPT = [5, 17, 42, 99, 7, 3]
WAIT_S = 5.0  # how long a held encoding waits for the test to let it go
T = TypeVar("T")


class Held:
    """The tiny model's tokenizer, but for `encode` of a text holding HOLD: that waits (on
    whatever thread calls it) until `go` is set, for at most WAIT_S; `in_time` says whether
    it was let go rather than timed out (it never is when the event loop itself waits)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.holding = threading.Event()
        self.go = threading.Event()
        self.in_time: bool | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if HOLD in text:
            self.holding.set()
            self.in_time = self.go.wait(WAIT_S)
        return list(self.inner.encode(text, add_special_tokens=add_special_tokens))

    async def holds(self) -> None:
        assert await asyncio.to_thread(self.holding.wait, WAIT_S), "nothing was held"


@pytest.fixture
def held(tiny_model: LoadedModel) -> Held:
    return Held(tiny_model.tokenizer)


@pytest.fixture
async def engine(make_engine: EngineFactory, tiny_model: LoadedModel, held: Held) -> Engine:
    started: Engine = await make_engine(dataclasses.replace(tiny_model, tokenizer=held))
    return started


async def within(work: Awaitable[T]) -> T:
    return await asyncio.wait_for(work, WAIT_S)


async def test_a_long_prompt_never_stalls_other_streams(engine: Engine, held: Held) -> None:
    other = engine.generate(input_ids=PROMPT, max_new_tokens=16, ignore_eos=True)
    first = await within(anext(aiter(other)))  # admitted: it streams
    long = engine.generate(f"{HOLD} once upon a time", max_new_tokens=2)
    await held.holds()
    rest = [delta async for delta in other]  # every other token, while the prompt is held
    assert sum(len(d.token_ids) for d in [first, *rest]) == 16
    assert not long.ended
    held.go.set()
    done = await within(long.result())
    assert held.in_time is True and done.finish_reason in ("stop", "length")


async def test_a_long_session_turn_never_stalls_other_streams(engine: Engine, held: Held) -> None:
    async with await engine.open_session() as session:
        await within(session.turn(input_ids=PROMPT, max_new_tokens=2).result())
        other = engine.generate(input_ids=PROMPT, max_new_tokens=16, ignore_eos=True)
        first = await within(anext(aiter(other)))
        turn = session.turn(f"{HOLD} and then", max_new_tokens=2)
        await held.holds()
        rest = [delta async for delta in other]
        assert sum(len(d.token_ids) for d in [first, *rest]) == 16
        assert not turn.ended
        held.go.set()
        done = await within(turn.result())
        busy = session.turn(input_ids=[8], max_new_tokens=2)
        assert (await within(busy.result())).usage.completion_tokens == 2
    assert held.in_time is True and done.finish_reason in ("stop", "length")
    assert done.usage.prompt_tokens > len(PROMPT) + 2  # the history, then the turn


async def test_an_advance_never_overtakes_the_request_being_encoded(
    engine: Engine, held: Held
) -> None:
    engine.testing.hold()
    try:
        stream = engine.generate(f"{HOLD} x", max_new_tokens=2, ignore_eos=True)
        await held.holds()
        advance = asyncio.ensure_future(engine.testing.advance())
        await asyncio.sleep(0)  # the Advance is posted: behind the request, in its line
        held.go.set()
        assert await within(advance) is not None  # it launched the request it followed
        await within(engine.testing.deliver())
        while not stream.ended:
            if await within(engine.testing.advance()) is not None:
                await within(engine.testing.deliver())
    finally:
        engine.testing.release()
    assert (await stream.result()).usage.completion_tokens == 2


async def test_a_weight_update_finds_the_request_being_encoded_admitted(
    engine: Engine, held: Held, tiny_folder: Path
) -> None:
    stream = engine.generate(f"{HOLD} x", max_new_tokens=4, ignore_eos=True)
    await held.holds()
    update = asyncio.ensure_future(engine.update_weights_from_disk(tiny_folder))
    await asyncio.sleep(0)  # the update is posted: behind the request, in its line
    held.go.set()
    done = await within(stream.result())
    assert done.weight_version == "0"  # a reader of the old weights: the writer waited for it
    result = await within(update)
    assert result.success and result.weight_version == "1"


async def test_an_abort_ends_the_request_being_encoded(engine: Engine, held: Held) -> None:
    stream = engine.generate(f"{HOLD} x", max_new_tokens=4)
    await held.holds()
    stream.abort()
    done = await within(stream.result())  # at once: the encoding still holds
    assert done.finish_reason == "abort" and done.usage.prompt_tokens == 0
    held.go.set()
    await engine.wait_idle()
    after = engine.generate(input_ids=PROMPT, max_new_tokens=2, ignore_eos=True)
    assert (await within(after.result())).usage.completion_tokens == 2


async def test_the_engine_stops_with_a_request_being_encoded(
    tiny_model: LoadedModel, held: Held
) -> None:
    engine = await Engine(dataclasses.replace(tiny_model, tokenizer=held), seed=0).start()
    try:
        stream = engine.generate(f"{HOLD} x", max_new_tokens=4)
        await held.holds()
        await within(engine.close())  # never waits for the worker
        assert held.in_time is None  # stopped while the encoding still held
        with pytest.raises(EngineDeadError):
            await within(stream.result())
    finally:
        held.go.set()
        await engine.close()
