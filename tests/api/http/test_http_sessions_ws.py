"""Streaming sessions over the websocket GET /v1/sessions/ws (messages in api/ws_protocol):
open -> turns -> close, malformed messages, a concurrent turn, cancel, a socket that goes
away, server shutdown and the API key. Greedy turns equal stateless /generate requests on the
full history.
"""

from __future__ import annotations

import random
from typing import Any

import aiohttp
import pytest
from served import Served, ServeFactory
from session_checks import GREEDY, released, stateless


async def receive(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
    message: dict[str, Any] = await ws.receive_json(timeout=60)
    return message


async def turn(
    ws: aiohttp.ClientWebSocketResponse, **fields: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Send a turn; its deltas and the message that ended it (done or error)."""
    await ws.send_json({"type": "turn", **fields})
    deltas = []
    while True:
        message = await receive(ws)
        if message["type"] != "delta":
            return deltas, message
        deltas.append(message)


def tokens_of(deltas: list[dict[str, Any]]) -> list[int]:
    return [t for d in deltas for t in d["token_ids"]]


async def open_ws(s: Served, **fields: Any) -> tuple[aiohttp.ClientWebSocketResponse, str]:
    ws = await s.http.ws_connect(s.url + "/v1/sessions/ws")
    await ws.send_json({"type": "open", **fields})
    opened = await receive(ws)
    assert opened["type"] == "opened", opened
    return ws, opened["session_id"]


async def test_ws_turns_equal_stateless_requests_on_the_full_history(serve: ServeFactory) -> None:
    s = await serve(page_size=4)
    ws, session_id = await open_ws(s, timeout_s=60)
    rng = random.Random(3)
    history: list[int] = []
    cached: list[int] = []
    for number in range(6):
        new = [rng.randrange(3, 500) for _ in range(3 + number % 4)]
        deltas, done = await turn(ws, input_ids=new, max_new_tokens=5, **GREEDY)
        assert done["type"] == "done" and done["finish_reason"] == "length", done
        got = tokens_of(deltas)
        assert got == await stateless(s, history + new, 5), f"turn {number}"
        usage = done["usage"]
        assert usage["prompt_tokens"] == len(history) + len(new)
        assert usage["completion_tokens"] == 5
        if history:
            assert usage["cached_tokens"] >= len(history) - 1
        cached.append(usage["cached_tokens"])
        history += new + got
    assert cached == sorted(cached) and cached[-1] > cached[1] > 0
    await ws.send_json({"type": "close"})
    assert await receive(ws) == {"type": "closed", "session_id": session_id}
    await released(s.engine)
    await ws.close()


async def test_ws_malformed_messages_get_errors_and_the_connection_stays_usable(
    serve: ServeFactory,
) -> None:
    s = await serve()
    ws = await s.http.ws_connect(s.url + "/v1/sessions/ws")
    wrong: list[Any] = [
        "not json",
        [1, 2],
        {"kind": "open"},
        {"type": "bogus"},
        {"type": "turn", "input_ids": [5, 6]},  # before open
        {"type": "close"},  # nothing to close
        {"type": "open", "timeout_s": "soon"},
        {"type": "open", "timeout_s": -1},
        {"type": "open", "colour": "red"},
    ]
    for message in wrong:
        if isinstance(message, str):
            await ws.send_str(message)
        else:
            await ws.send_json(message)
        answer = await receive(ws)
        assert answer["type"] == "error" and answer["message"], (message, answer)
    await ws.send_json({"type": "open"})
    assert (await receive(ws))["type"] == "opened"
    for fields in (
        {"type": "open"},  # a second session on one connection
        {"type": "turn", "input_ids": "5 6"},
        {"type": "turn"},
        {"type": "turn", "text": "hi", "input_ids": [5]},
        {"type": "turn", "input_ids": [5], "temperature": 9},
        {"type": "turn", "input_ids": [5], "max_tokens": 3, "max_new_tokens": 4},
        {"type": "turn", "input_ids": [5], "temprature": 0},
        {"type": "turn", "input_ids": [10**6]},
    ):
        await ws.send_json(fields)
        answer = await receive(ws)
        assert answer["type"] == "error", (fields, answer)
    await ws.send_json({"type": "turn", "input_ids": [5], "temperature": 9})
    assert (await receive(ws))["param"] == "temperature"
    deltas, done = await turn(ws, input_ids=[5, 6, 7], max_tokens=4, **GREEDY)
    assert done["type"] == "done" and tokens_of(deltas) == await stateless(s, [5, 6, 7], 4)
    history = [5, 6, 7, *tokens_of(deltas)]
    text = s.engine.tokenizer.encode(" and the sea", add_special_tokens=False)
    deltas, done = await turn(ws, text=" and the sea", max_tokens=3, **GREEDY)
    assert tokens_of(deltas) == await stateless(s, history + text, 3)
    await ws.close()
    await released(s.engine)


async def test_ws_a_concurrent_turn_is_refused_and_the_first_is_unaffected(
    serve: ServeFactory,
) -> None:
    s = await serve(page_size=4)
    ws, _ = await open_ws(s)
    await ws.send_json({"type": "turn", "input_ids": [5, 6, 7], "max_new_tokens": 60, **GREEDY})
    await ws.send_json({"type": "turn", "input_ids": [8], "max_new_tokens": 3, **GREEDY})
    deltas: list[dict[str, Any]] = []
    refused = None
    while True:
        message = await receive(ws)
        if message["type"] == "delta":
            deltas.append(message)
        elif message["type"] == "error":
            refused = message
        else:
            break
    assert refused is not None and refused["code"] == "session_busy", refused
    assert "one turn at a time" in refused["message"]
    assert message["type"] == "done" and message["finish_reason"] == "length"
    first = tokens_of(deltas)
    assert first == await stateless(s, [5, 6, 7], 60)
    # Right after done, the next turn is accepted.
    deltas, done = await turn(ws, input_ids=[8], max_new_tokens=3, **GREEDY)
    assert tokens_of(deltas) == await stateless(s, [5, 6, 7, *first, 8], 3)
    assert done["usage"]["cached_tokens"] >= 62
    await ws.close()
    await released(s.engine)


async def test_ws_cancel_aborts_the_turn_and_the_session_rolls_back(serve: ServeFactory) -> None:
    s = await serve(page_size=4)
    ws, _ = await open_ws(s)
    await ws.send_json({"type": "cancel"})  # nothing live: ignored
    deltas, _ = await turn(ws, input_ids=[5, 6, 7, 8, 9], max_new_tokens=4, **GREEDY)
    history = [5, 6, 7, 8, 9, *tokens_of(deltas)]
    await ws.send_json({"type": "turn", "input_ids": [40, 41], "max_new_tokens": 400, **GREEDY})
    assert (await receive(ws))["type"] == "delta"
    await ws.send_json({"type": "cancel"})
    while (message := await receive(ws))["type"] == "delta":
        pass
    assert message["type"] == "done" and message["finish_reason"] == "abort", message
    assert message["usage"]["completion_tokens"] < 400
    deltas, done = await turn(ws, input_ids=[50, 51], max_new_tokens=6, **GREEDY)
    assert tokens_of(deltas) == await stateless(s, [*history, 50, 51], 6)
    assert done["usage"]["prompt_tokens"] == len(history) + 2
    await ws.close()
    await released(s.engine)


@pytest.mark.parametrize("how", ["dropped", "closed"])
async def test_ws_a_socket_that_goes_away_closes_its_session(serve: ServeFactory, how: str) -> None:
    s = await serve(page_size=4, max_sessions=1)
    ws, _ = await open_ws(s)
    await turn(ws, input_ids=list(range(5, 30)), max_new_tokens=4, **GREEDY)
    await s.engine.wait_idle()  # the turn's KV passes to the session when released
    held = await s.engine.cache_stats()
    assert held.sessions == 1 and held.locked_pages > 0
    await ws.send_json({"type": "turn", "input_ids": [40, 41], "max_new_tokens": 500, **GREEDY})
    assert (await receive(ws))["type"] == "delta"
    if how == "dropped":
        ws._writer.transport.abort()  # no close frame: the TCP connection just ends
    else:
        await ws.close()
    stats = await released(s.engine)
    assert stats.request_pages == 0 and not s.server.gateway.jobs
    await s.engine.check_integrity()
    # max_sessions is 1: a new session opens only because the old one is gone.
    again, _ = await open_ws(s)
    deltas, _ = await turn(again, input_ids=[7, 8, 9], max_new_tokens=3, **GREEDY)
    assert tokens_of(deltas) == await stateless(s, [7, 8, 9], 3)
    await again.close()
    await released(s.engine)


async def test_ws_server_stop_closes_sockets_and_their_sessions(serve: ServeFactory) -> None:
    s = await serve(page_size=4)
    ws, _ = await open_ws(s)
    await ws.send_json({"type": "turn", "input_ids": [5, 6], "max_new_tokens": 500, **GREEDY})
    assert (await receive(ws))["type"] == "delta"
    await s.server.stop()
    while (message := await ws.receive(timeout=30)).type == aiohttp.WSMsgType.TEXT:
        pass
    assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    await released(s.engine)


async def test_ws_needs_the_api_key(serve: ServeFactory) -> None:
    s = await serve(api_key="sesame")
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await s.http.ws_connect(s.url + "/v1/sessions/ws")
    assert refused.value.status == 401
    headers = {"Authorization": "Bearer sesame"}
    async with s.http.ws_connect(s.url + "/v1/sessions/ws", headers=headers) as ws:
        await ws.send_json({"type": "open"})
        assert (await receive(ws))["type"] == "opened"
    await released(s.engine)


async def test_ws_message_turns_match_an_engine_session(serve: ServeFactory) -> None:
    s = await serve()
    ws, _ = await open_ws(s)
    texts = ("Hello there", "Tell me more", "Thanks")
    got = []
    for text in texts:
        messages = [{"role": "user", "content": text}]
        deltas, done = await turn(ws, messages=messages, max_tokens=6, temperature=0)
        assert done["type"] == "done", done
        got.append(tokens_of(deltas))
    await ws.close()
    async with await s.engine.open_session() as session:
        for text, tokens in zip(texts, got, strict=True):
            messages = [{"role": "user", "content": text}]
            direct = await session.turn(messages=messages, max_new_tokens=6, temperature=0).result()
            assert list(direct.token_ids) == tokens
    await released(s.engine)


async def test_ws_a_turn_asks_for_logprobs_as_every_door_can(serve: ServeFactory) -> None:
    s = await serve()
    ws, _ = await open_ws(s)
    fields = {"max_new_tokens": 4, "logprobs": True, "top_logprobs": 2, **GREEDY}
    deltas, done = await turn(ws, input_ids=[5, 6, 7], **fields)
    assert done["type"] == "done", done
    items = [item for delta in deltas for item in delta["logprobs"]]
    assert [item["token_id"] for item in items] == tokens_of(deltas)
    for item in items:  # greedy: the chosen token is the most likely one
        assert item["logprob"] <= 0 and len(item["top"]) == 2
        assert item["top"][0][0] == item["token_id"]
    deltas, _ = await turn(ws, input_ids=[8], max_new_tokens=2, **GREEDY)
    assert deltas and all("logprobs" not in delta for delta in deltas)  # only when asked
    await ws.close()
    await released(s.engine)
