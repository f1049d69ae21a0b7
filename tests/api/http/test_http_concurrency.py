"""Many clients at once: independent outputs; clients that leave leave nothing behind."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
from served import MODEL, Served, ServeFactory, chat, sse_events


def prompt_text(i: int) -> str:
    rng = random.Random(i)
    words = ["fish", "sea", "the", "quick", "model", "page", "cache", "river", "token", "blue"]
    return " ".join(rng.choice(words) for _ in range(3 + i % 7))


async def settle(s: Served, timeout_s: float = 10.0) -> None:
    """Wait until no HTTP job is open and the engine is idle."""
    deadline = time.monotonic() + timeout_s
    while s.server.gateway.jobs:
        assert time.monotonic() < deadline, f"jobs still open: {list(s.server.gateway.jobs)}"
        await asyncio.sleep(0.01)
    await s.engine.wait_idle(timeout_s=timeout_s)
    while s.server.gateway.late:  # the abandoned requests' ends, recorded for the metrics
        assert time.monotonic() < deadline, "abandoned requests were never recorded"
        await asyncio.sleep(0.01)


async def test_32_concurrent_streams_complete_with_independent_outputs(
    serve: ServeFactory,
) -> None:
    s = await serve()
    requests = []
    for i in range(32):
        sampled = i % 2 == 1  # half greedy, half seeded sampling
        fields = {"temperature": 0.8, "seed": 100 + i} if sampled else {"temperature": 0.0}
        requests.append({"prompt": prompt_text(i), "max_tokens": 8 + i % 9, **fields})
    alone = []  # each request on its own first: the reference for the crowded run
    for body in requests:
        sampling = {k: v for k, v in body.items() if k not in ("prompt", "max_tokens")}
        done = await s.engine.generate(
            body["prompt"], max_new_tokens=body["max_tokens"], ignore_eos=True, **sampling
        ).result()
        alone.append(done.text)

    async def stream_one(body: dict[str, object]) -> tuple[str, str | None]:
        stream = await s.client.completions.create(  # type: ignore[call-overload]
            model=MODEL, stream=True, extra_body={"ignore_eos": True}, **body
        )
        text, finish = "", None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
        return text, finish

    results = await asyncio.gather(*(stream_one(body) for body in requests))
    assert [text for text, _ in results] == alone
    assert {finish for _, finish in results} == {"length"}
    assert len(set(alone)) > 16  # the outputs really are different from one another
    await settle(s)


async def test_50_clients_leaving_mid_stream_leave_nothing_behind(serve: ServeFactory) -> None:
    s = await serve()
    before = await s.engine.cache_stats()
    body = chat("tell me a long story", max_tokens=400, stream=True, ignore_eos=True)

    async def leave_raw(i: int) -> None:
        async with s.http.post(s.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            for _ in range(2 + i % 3):
                await resp.content.readline()
            resp.close()  # drop the connection mid-stream

    async def leave_openai(i: int) -> None:
        stream = await s.client.chat.completions.create(  # type: ignore[call-overload]
            model=MODEL,
            messages=body["messages"],
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen > i % 4:
                break
        await stream.close()

    await asyncio.gather(*(leave_raw(i) if i % 2 else leave_openai(i) for i in range(50)))
    await settle(s)
    snapshot = await s.engine.snapshot()
    assert snapshot.idle and not snapshot.running and not snapshot.waiting
    after = await s.engine.cache_stats()
    assert after.free_rows == before.free_rows == after.total_rows
    assert after.request_pages == 0 and after.locked_pages == 0
    # aborted requests may leave their KV in the prefix cache: evictable, not held
    assert after.free_pages + after.evictable_pages == (before.free_pages + before.evictable_pages)
    aborted = s.server.metrics.requests.labels("abort")._value.get()
    generated = s.server.metrics.generation_tokens._value.get()
    # each was aborted within a few steps of its client leaving (not after its 400 tokens)
    assert aborted == 50 and generated < 50 * 20
    await s.engine.check_integrity()


async def test_a_non_streaming_client_that_leaves_is_aborted(serve: ServeFactory) -> None:
    s = await serve()
    body = chat("hi", max_tokens=900, ignore_eos=True)
    timeout = aiohttp.ClientTimeout(total=0.3)
    try:
        async with s.http.post(s.url + "/v1/chat/completions", json=body, timeout=timeout):
            raise AssertionError("900 tokens cannot come back in 0.3 s")
    except TimeoutError:
        pass
    await settle(s)
    assert s.server.metrics.requests.labels("abort")._value.get() == 1
    assert s.server.metrics.requests.labels("length")._value.get() == 0


async def test_abort_request_by_rid_and_all(serve: ServeFactory) -> None:
    s = await serve()
    native = {
        "text": "hi",
        "rid": "mine",
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
    }
    pending = asyncio.create_task(s.http.post(s.url + "/generate", json=native))
    while "mine" not in s.server.gateway.jobs:
        await asyncio.sleep(0.005)
    async with s.http.post(s.url + "/abort_request", json={"rid": "mine"}) as resp:
        assert (await resp.json()) == {"aborted": 1}
    async with await pending as resp:
        got = await resp.json()
    assert got["meta_info"]["finish_reason"]["type"] == "abort"
    assert got["meta_info"]["completion_tokens"] < 900

    streaming = chat("hi", max_tokens=900, ignore_eos=True, stream=True, n=2)
    async with s.http.post(s.url + "/v1/chat/completions", json=streaming) as resp:
        await resp.content.readline()
        async with s.http.post(s.url + "/abort_request", json={"abort_all": True}) as abort:
            assert (await abort.json()) == {"aborted": 2}
        events = await sse_events(resp)
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["abort", "abort"] and events[-1] == "[DONE]"
    async with s.http.post(s.url + "/abort_request", json={"rid": "gone"}) as resp:
        assert (await resp.json()) == {"aborted": 0}
    await settle(s)
