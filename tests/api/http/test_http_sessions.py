"""Streaming sessions over HTTP: /open_session, session_params on /generate and
/v1/chat/completions, /close_session (the websocket: test_http_sessions_ws).

Each greedy turn must give exactly the tokens of a stateless /generate on the full history;
whatever way a session ends, its pages come back (the fixtures check integrity after each
test, with the server stopped first).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from served import ServeFactory, post, sse_events
from session_checks import GREEDY, released, stateless


async def test_http_open_generate_with_session_params_and_close(serve: ServeFactory) -> None:
    s = await serve(page_size=4)
    status, opened = await post(s, "/open_session", {"timeout_s": 60})
    assert status == 200
    session = {"id": opened["session_id"]}
    history: list[int] = []
    cached = []
    for number, new in enumerate(([5, 6, 7, 8, 9], [20, 21], [30, 31, 32])):
        body = {
            "input_ids": new,
            "sampling_params": {"max_new_tokens": 4, **GREEDY},
            "session_params": session,
            "stream": number == 1,
        }
        if number == 1:
            async with s.http.post(s.url + "/generate", json=body) as resp:
                assert resp.status == 200
                events = await sse_events(resp)
            assert events[-1] == "[DONE]"
            got = events[-2]
        else:
            status, got = await post(s, "/generate", body)
            assert status == 200, got
        assert got["output_ids"] == await stateless(s, history + new, 4), f"turn {number}"
        meta = got["meta_info"]
        assert meta["prompt_tokens"] == len(history) + len(new)
        cached.append(meta["cached_tokens"])
        history += new + got["output_ids"]
    assert cached[2] > cached[1] > 0
    status, closed = await post(s, "/close_session", {"session_id": session["id"]})
    assert status == 200 and closed == {"session_id": session["id"], "success": True}
    await released(s.engine)
    body = {"input_ids": [5], "session_params": session}
    status, gone = await post(s, "/generate", body)
    assert status == 404 and gone["error"]["code"] == "session_not_found"
    assert gone["error"]["param"] == "session_params.id"
    status, again = await post(s, "/close_session", {"session_id": session["id"]})
    assert status == 404 and again["error"]["code"] == "session_not_found"  # closed already


async def test_http_session_errors(serve: ServeFactory) -> None:
    s = await serve(max_sessions=1)
    for body, param in (
        ({"timeout_s": 0}, "timeout_s"),
        ({"max_tokens": 1}, "max_tokens"),
        ({"timeout_s": "x"}, "timeout_s"),
        ({"session": 1}, "session"),
    ):
        status, got = await post(s, "/open_session", body)
        assert status == 400 and got["error"]["param"] == param, got
    status, opened = await post(s, "/open_session", {})
    sid = opened["session_id"]
    status, got = await post(s, "/open_session", {})
    assert status == 429 and got["error"]["code"] == "too_many_sessions"
    for body, param in (
        ({"text": ["a", "b"], "rid": ["x", "y"], "session_params": {"id": sid}}, "session_params"),
        ({"text": "a", "session_params": {"id": sid, "offset": 3}}, "session_params.offset"),
        ({"text": "a", "session_params": {"idd": sid}}, "session_params.idd"),
    ):
        status, got = await post(s, "/generate", body)
        assert status == 400 and got["error"]["param"] == param, got
    chat = {"messages": [{"role": "user", "content": "hi"}], "session_params": {"id": sid}}
    status, got = await post(s, "/v1/chat/completions", {**chat, "n": 2})
    assert status == 400 and got["error"]["param"] == "n"
    status, got = await post(s, "/v1/completions", {"prompt": "hi", "session_params": {"id": sid}})
    assert status == 400 and got["error"]["param"] == "session_params"
    status, got = await post(s, "/generate", {"text": "a", "session_params": {"id": "nope"}})
    assert status == 404 and got["error"]["code"] == "session_not_found"
    await post(s, "/close_session", {"session_id": sid})


@pytest.mark.parametrize("stream", [False, True])
async def test_http_a_concurrent_turn_answers_409(serve: ServeFactory, stream: bool) -> None:
    s = await serve()
    _, opened = await post(s, "/open_session", {})
    session = {"id": opened["session_id"]}
    long = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 400, **GREEDY},
        "session_params": session,
        "rid": "long-turn",
    }
    first = asyncio.create_task(post(s, "/generate", long))
    while "long-turn" not in s.server.gateway.jobs:
        await asyncio.sleep(0.005)
    while s.server.metrics.last_token_at == 0.0:  # admitted and streaming
        await asyncio.sleep(0.005)
    second = {"input_ids": [8], "session_params": session, "stream": stream}
    async with s.http.post(s.url + "/generate", json=second) as resp:
        assert resp.status == 409 and resp.content_type == "application/json"
        refused = await resp.json()
    assert refused["error"]["code"] == "session_busy"
    assert "one turn at a time" in refused["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "session_params": session}
    status, got = await post(s, "/v1/chat/completions", {**chat, "stream": stream})
    assert status == 409 and got["error"]["code"] == "session_busy"
    await post(s, "/abort_request", {"rid": "long-turn"})
    status, aborted = await first
    assert status == 200 and aborted["meta_info"]["finish_reason"]["type"] == "abort"
    status, _ = await post(s, "/close_session", session)  # "id" is not "session_id"
    assert status == 400
    await post(s, "/close_session", {"session_id": session["id"]})
    await released(s.engine)


async def test_chat_with_session_params_matches_an_engine_session(serve: ServeFactory) -> None:
    s = await serve()
    _, opened = await post(s, "/open_session", {})
    extra = {"session_params": {"id": opened["session_id"]}}
    texts = ("Hello there", "Tell me more", "Thanks")
    answers = []
    for number, text in enumerate(texts):
        messages: Any = [{"role": "user", "content": text}]
        if number == 1:  # streamed, through the openai client
            chunks = await s.client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
            parts, usage = [], None
            async for chunk in chunks:
                parts += [c.delta.content or "" for c in chunk.choices]
                usage = chunk.usage or usage
            answers.append(("".join(parts), usage))
        else:
            done = await s.client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body=extra
            )
            answers.append((done.choices[0].message.content or "", done.usage))
    await post(s, "/close_session", {"session_id": opened["session_id"]})
    async with await s.engine.open_session() as session:
        for text, (content, usage) in zip(texts, answers, strict=True):
            messages = [{"role": "user", "content": text}]
            direct = await session.turn(messages=messages, max_new_tokens=6, temperature=0).result()
            assert direct.text == content
            assert usage is not None and usage.prompt_tokens == direct.usage.prompt_tokens
    assert answers[2][1].prompt_tokens_details.cached_tokens > answers[1][1].prompt_tokens > 0
    await released(s.engine)
