"""Every input dimension is bounded through every door (docs/limits.md): at its limit a request
is accepted, one past it is a 4xx naming the field, and nothing is harmed.

The table runs on a server with small limits (fast: the tiny model); the original attacks (a
300 KB stop string, 5000-deep JSON) also run on one with the defaults. Tokenization runs off
the event loop: /health answers while a prompt is being encoded.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from served import MODEL, Served, ServeFactory
from session_checks import GREEDY, released

from shoal.actors.tokenizer import encode as tokenizer_encode
from shoal.api.cli import build_parser
from shoal.api.http.server import ServerOptions

LIMITS: dict[str, int] = {
    "max_stop_strings": 4,
    "max_stop_chars": 16,
    "max_stop_token_ids": 8,
    "max_prompt_chars": 400,
    "max_messages": 6,
    "max_json_depth": 8,
    "max_prompts": 3,
    "max_content_parts": 3,
    "max_id_chars": 48,
    "max_path_chars": 64,
    "max_logit_bias": 4,
    "max_ws_message_bytes": 64 * 1024,
}
TOO_MANY, TOO_LONG, TOO_DEEP = "array_above_max_length", "string_above_max_length", "json_too_deep"
TEXT = "the " * 100  # 400 characters (about 100 tokens): the prompt limit exactly
ONE = {"max_tokens": 1}
JSON_HEADERS = {"Content-Type": "application/json"}
SP = {"max_new_tokens": 1}


def user(content: Any, role: str = "user") -> dict[str, Any]:
    return {"role": role, "content": content}


def bias(count: int) -> dict[str, float]:
    return {str(i): 1.0 for i in range(count)}


def parts(count: int) -> list[dict[str, str]]:
    return [{"type": "text", "text": "a"}] * count


def nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


@dataclass(frozen=True)
class Case:
    """door: chat | completions | generate | ws | session-generate | session-chat | close |
    lifecycle | abort | python. param None: accepted (2xx, or a refusal that is not a limit's).
    """

    name: str
    door: str
    payload: Any
    param: str | None = None
    code: str | None = None
    status: int = 400


def ok(name: str, door: str, payload: Any) -> Case:
    return Case(name, door, payload)


def past(name: str, door: str, payload: Any, param: str | None, code: str = TOO_MANY) -> Case:
    return Case(name, door, payload, param, code)


CASES: list[Case] = [
    # stop strings: count, length; stop ids: count (every door)
    ok("chat-stops-at", "chat", {"messages": [user("hi")], "stop": ["s" * 16] * 4, **ONE}),
    past("chat-stops-many", "chat", {"messages": [user("hi")], "stop": ["s"] * 5}, "stop"),
    past("chat-stop-long", "chat", {"messages": [user("hi")], "stop": "s" * 17}, "stop", TOO_LONG),
    past(
        "cmpl-stop-300kb",
        "completions",
        {"prompt": "hi", "stop": ["ab" * 150_000]},
        "stop",
        TOO_LONG,
    ),
    ok("cmpl-stop-ids-at", "completions", {"prompt": "hi", "stop_token_ids": [3] * 8, **ONE}),
    past(
        "cmpl-stop-ids-many",
        "completions",
        {"prompt": "hi", "stop_token_ids": [3] * 9},
        "stop_token_ids",
    ),
    ok(
        "gen-stops-at",
        "generate",
        {"text": "hi", "sampling_params": {"stop": ["s" * 16] * 4, **SP}},
    ),
    past(
        "gen-stops-many",
        "generate",
        {"text": "hi", "sampling_params": {"stop": ["s"] * 5}},
        "sampling_params.stop",
    ),
    past(
        "gen-batch-stop-long",
        "generate",
        {"text": ["a", "b"], "sampling_params": [{"stop": "s"}, {"stop": "s" * 17}]},
        "sampling_params[1].stop",
        TOO_LONG,
    ),
    past(
        "gen-stop-ids-many",
        "generate",
        {"text": "hi", "sampling_params": {"stop_token_ids": [3] * 9}},
        "sampling_params.stop_token_ids",
    ),
    # logit_bias: entries counted (every door: the engine counts them)
    ok("chat-logit-bias-at", "chat", {"messages": [user("hi")], "logit_bias": bias(4), **ONE}),
    past(
        "chat-logit-bias-many",
        "chat",
        {"messages": [user("hi")], "logit_bias": bias(5)},
        "logit_bias",
    ),
    past(
        "gen-logit-bias-many",
        "generate",
        {"text": "hi", "sampling_params": {"logit_bias": bias(5)}},
        "sampling_params.logit_bias",
    ),
    past("ws-logit-bias-many", "ws", {"text": "hi", "logit_bias": bias(5)}, "logit_bias"),
    # messages: count, content parts, characters
    ok("chat-messages-at", "chat", {"messages": [user("hi")] * 6, **ONE}),
    past("chat-messages-many", "chat", {"messages": [user("hi")] * 7}, "messages"),
    ok("chat-parts-at", "chat", {"messages": [user(parts(3))], **ONE}),
    past("chat-parts-many", "chat", {"messages": [user(parts(4))]}, "messages[0].content"),
    ok("chat-chars-at", "chat", {"messages": [user(TEXT[:396])], **ONE}),  # + "user": 400
    past("chat-chars-past", "chat", {"messages": [user(TEXT[:397])]}, "messages", TOO_LONG),
    # prompts: characters, list length
    ok("cmpl-prompt-at", "completions", {"prompt": TEXT, **ONE}),
    past("cmpl-prompt-past", "completions", {"prompt": TEXT + "x"}, "prompt", TOO_LONG),
    ok("cmpl-prompts-at", "completions", {"prompt": ["a", "b", "c"], **ONE}),
    past("cmpl-prompts-many", "completions", {"prompt": ["a"] * 4}, "prompt"),
    past(
        "cmpl-prompt-item-past", "completions", {"prompt": ["a", TEXT + "x"]}, "prompt[1]", TOO_LONG
    ),
    past("cmpl-id-lists-many", "completions", {"prompt": [[5]] * 4}, "prompt"),
    ok("gen-text-at", "generate", {"text": TEXT, "sampling_params": SP}),
    past("gen-text-past", "generate", {"text": TEXT + "x"}, "text", TOO_LONG),
    ok("gen-batch-at", "generate", {"text": ["a", "b", "c"], "sampling_params": SP}),
    past("gen-batch-many", "generate", {"text": ["a"] * 4}, "text"),
    past("gen-id-batch-many", "generate", {"input_ids": [[5]] * 4}, "input_ids"),
    past(
        "gen-sampling-list-many",
        "generate",
        {"text": "a", "sampling_params": [{}] * 4},
        "sampling_params",
    ),
    # ids and names
    ok("gen-rid-at", "generate", {"text": "a", "rid": "r" * 48, "sampling_params": SP}),
    past("gen-rid-long", "generate", {"text": "a", "rid": "r" * 49}, "rid", TOO_LONG),
    past(
        "gen-rid-list-long",
        "generate",
        {"text": ["a", "b"], "rid": ["r", "r" * 49]},
        "rid[1]",
        TOO_LONG,
    ),
    past("gen-rids-many", "generate", {"text": "a", "rid": ["r1", "r2", "r3", "r4"]}, "rid"),
    Case(
        "chat-model-at",
        "chat",
        {"messages": [user("hi")], "model": "m" * 48},
        "model",
        "model_not_found",
        404,
    ),
    past(
        "chat-model-long",
        "chat",
        {"messages": [user("hi")], "model": "m" * 10_000},
        "model",
        TOO_LONG,
    ),
    ok("chat-user-at", "chat", {"messages": [user("hi")], "user": "u" * 48, **ONE}),
    past("chat-user-long", "chat", {"messages": [user("hi")], "user": "u" * 49}, "user", TOO_LONG),
    ok("abort-rid-at", "abort", {"rid": "r" * 48}),
    past("abort-rid-long", "abort", {"rid": "r" * 1_000_000}, "rid", TOO_LONG),
    # JSON nesting depth: 8 levels accepted (in metadata, which is ignored), 9 and 5000 refused
    ok("chat-depth-at", "chat", {"messages": [user("hi")], "metadata": nested(7), **ONE}),
    past("chat-depth-past", "chat", {"messages": [user("hi")], "extra": nested(8)}, None, TOO_DEEP),
    past("chat-depth-5000", "chat", b"[" * 5000 + b"]" * 5000, None, TOO_DEEP),
    past("cmpl-depth-5000", "completions", b'{"prompt": ' + b"[" * 5000, None, TOO_DEEP),
    past("gen-depth-5000", "generate", b'{"text": "a", "x": ' + b"{" * 5000, None, TOO_DEEP),
    ok("chat-brackets-in-strings", "chat", {"messages": [user("[{" * 150)], **ONE}),
    # HTTP sessions
    ok("session-text-at", "session-generate", {"text": TEXT, "sampling_params": SP}),
    past("session-text-past", "session-generate", {"text": TEXT + "x"}, "text", TOO_LONG),
    past("session-messages-many", "session-chat", {"messages": [user("hi")] * 7}, "messages"),
    past(
        "session-id-long",
        "generate",
        {"text": "a", "session_params": {"id": "s" * 49}},
        "session_params.id",
        TOO_LONG,
    ),
    past("close-session-id-long", "close", {"session_id": "s" * 1_000_000}, "session_id", TOO_LONG),
    # lifecycle
    ok("update-weights-path-at", "lifecycle", {"model_path": "/nonexistent/" + "p" * 51}),
    past(
        "update-weights-path-1mb",
        "lifecycle",
        {"model_path": "/" + "p" * 2**20},
        "model_path",
        TOO_LONG,
    ),
    # websocket turns
    ok("ws-messages-at", "ws", {"messages": [user("hi")] * 6, "max_tokens": 1}),  # first
    ok("ws-text-at", "ws", {"text": TEXT, "max_tokens": 1}),
    past("ws-text-past", "ws", {"text": TEXT + "x"}, "text", TOO_LONG),
    past("ws-messages-many", "ws", {"messages": [user("hi")] * 7}, "messages"),
    past("ws-parts-many", "ws", {"messages": [user(parts(4))]}, "messages[0].content"),
    past("ws-stops-many", "ws", {"text": "a", "stop": ["s"] * 5}, "stop"),
    past("ws-stop-long", "ws", {"text": "a", "stop": "s" * 17}, "stop", TOO_LONG),
    past("ws-stop-ids-many", "ws", {"text": "a", "stop_token_ids": [3] * 9}, "stop_token_ids"),
    past("ws-depth-5000", "ws", "[" * 5000, None, TOO_DEEP),
    # the Python API
    ok("python-prompt-at", "python", {"prompt": TEXT}),
    past("python-prompt-past", "python", {"prompt": TEXT + "x"}, "prompt", TOO_LONG),
    past("python-messages-many", "python", {"messages": [user("hi")] * 7}, "messages"),
    past("python-stops-many", "python", {"prompt": "a", "stop": ["s"] * 5}, "stop"),
    past(
        "python-logit-bias-many",
        "python",
        {"prompt": "a", "logit_bias": {i: 1.0 for i in range(5)}},
        "logit_bias",
    ),
    past(
        "python-stop-300kb", "python", {"prompt": "a", "stop": ["ab" * 150_000]}, "stop", TOO_LONG
    ),
    past(
        "python-stop-ids-many",
        "python",
        {"prompt": "a", "stop_token_ids": [3] * 9},
        "stop_token_ids",
    ),
]

PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
    "session-generate": "/generate",
    "session-chat": "/v1/chat/completions",
    "close": "/close_session",
    "lifecycle": "/update_weights_from_disk",
    "abort": "/abort_request",
}


def assert_refusal(case: Case, error: dict[str, Any]) -> None:
    assert error["param"] == case.param, (case.name, error)
    assert error["code"] == case.code, (case.name, error)
    message = error["message"]
    if case.param is not None:
        assert case.param.split("[")[0].split(".")[-1] in message, (case.name, message)
    for leak in ("Traceback", "Error", ".py", "/work"):
        assert leak not in message, (case.name, message)


async def run_http(s: Served, case: Case, session_id: str) -> None:
    payload = case.payload
    if case.door.startswith("session-"):
        payload = {**payload, "session_params": {"id": session_id}}
    if case.door in ("chat", "completions", "session-chat") and isinstance(payload, dict):
        payload = {"model": MODEL, **payload}
    kwargs: dict[str, Any] = {"json": payload}
    if isinstance(payload, bytes):
        kwargs = {"data": payload, "headers": JSON_HEADERS}
    async with s.http.post(s.url + PATHS[case.door], **kwargs) as resp:
        got = await resp.json()
        status = resp.status
    if case.param is None and case.code is None:  # accepted: a 2xx, or not a limit's refusal
        if case.door in ("lifecycle", "abort"):
            assert status < 500 and got.get("error", {}).get("code") not in (TOO_LONG, TOO_MANY)
        else:
            assert status == 200, (case.name, got)
        return
    assert status == case.status, (case.name, status, got)
    assert_refusal(case, got["error"])


async def run_ws(ws: aiohttp.ClientWebSocketResponse, case: Case) -> None:
    if isinstance(case.payload, str):
        await ws.send_str(case.payload)
    else:
        await ws.send_json({"type": "turn", **case.payload})
    while True:
        message = await ws.receive_json(timeout=60)
        if message["type"] != "delta":
            break
    if case.param is None and case.code is None:
        assert message["type"] == "done", (case.name, message)
        return
    assert message["type"] == "error", (case.name, message)
    assert_refusal(case, message)


async def run_python(s: Served, case: Case) -> None:
    if case.param is None:
        done = await s.engine.generate(**case.payload, max_new_tokens=1).result()
        assert done.finish_reason in ("stop", "length"), case.name
        return
    with pytest.raises(ValueError, match=case.param) as caught:
        s.engine.generate(**case.payload, max_new_tokens=1)
    assert getattr(caught.value, "code", None) == case.code, case.name


async def greedy(s: Served) -> list[int]:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, **GREEDY}}
    async with s.http.post(s.url + "/generate", json=body) as resp:
        assert resp.status == 200
        return list((await resp.json())["output_ids"])


async def test_every_limit_at_and_past_through_every_door(serve: ServeFactory) -> None:
    assert len(CASES) >= 40 and {c.door for c in CASES} >= {*PATHS, "ws", "python"}
    s = await serve(**LIMITS)
    before = await greedy(s)
    async with s.http.post(s.url + "/open_session", json={"timeout_s": 60}) as resp:
        session_id = (await resp.json())["session_id"]
    ws = await s.http.ws_connect(s.url + "/v1/sessions/ws")
    await ws.send_json({"type": "open"})
    assert (await ws.receive_json(timeout=60))["type"] == "opened"
    for case in CASES:
        if case.door == "ws":
            await run_ws(ws, case)
        elif case.door == "python":
            await run_python(s, case)
        else:
            await run_http(s, case, session_id)
    # a frame at the size limit is read; one byte more closes the connection (1009)
    limit = LIMITS["max_ws_message_bytes"]
    frame = json.dumps({"type": "turn", "text": "hi", "max_tokens": 1})
    await ws.send_str(frame.ljust(limit))
    assert (await ws.receive_json(timeout=60))["type"] in ("delta", "done")
    while (await ws.receive_json(timeout=60))["type"] == "delta":
        pass
    await ws.send_str(frame.ljust(limit + 1))
    closing = await ws.receive(timeout=60)
    assert closing.type == aiohttp.WSMsgType.CLOSE and closing.data == 1009, closing
    await ws.close()
    async with s.http.post(s.url + "/close_session", json={"session_id": session_id}) as resp:
        assert resp.status == 200
    # unharmed: up, alive, the same greedy tokens, nothing leaked
    async with s.http.get(s.url + "/health") as resp:
        assert resp.status == 200
    assert s.engine.dead_reason is None
    assert await greedy(s) == before
    await released(s.engine)
    await s.engine.check_integrity()


async def test_the_original_attacks_at_the_default_limits(serve: ServeFactory) -> None:
    s = await serve()
    before = await greedy(s)
    stop = {"model": MODEL, "prompt": "hi", "stop": ["ab" * 150_000]}
    async with s.http.post(s.url + "/v1/completions", json=stop) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["param"] == "stop" and error["code"] == TOO_LONG, error
        assert "1024" in error["message"] and "max_stop_chars" in error["message"]
    for path, body in (
        ("/v1/chat/completions", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ):
        async with s.http.post(s.url + path, data=body, headers=JSON_HEADERS) as resp:
            assert resp.status == 400, path
            error = (await resp.json())["error"]
            assert error["code"] == TOO_DEEP and "32" in error["message"], error
    ws = await s.http.ws_connect(s.url + "/v1/sessions/ws")
    await ws.send_str('{"type": "open", "x": ' + "[" * 5000 + "]" * 5000 + "}")
    answer = await ws.receive_json(timeout=60)
    assert answer["type"] == "error" and answer["code"] == TOO_DEEP, answer
    await ws.send_json({"type": "open"})
    assert (await ws.receive_json(timeout=60))["type"] == "opened"  # the connection stays
    await ws.close()
    assert s.engine.dead_reason is None and await greedy(s) == before
    await released(s.engine)


async def test_health_answers_while_a_prompt_at_the_char_limit_is_encoded(
    serve: ServeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deterministic: the encoding is held on its worker thread until /health has answered;
    were it on the event loop, /health could not answer at all."""
    max_chars = 100_000
    s = await serve(max_prompt_chars=max_chars)
    encoding, finish = threading.Event(), threading.Event()
    real_encode = tokenizer_encode.encode_prompt

    def held_encode(
        tokenizer: Any, text: str | None, ids: Any, messages: Any, template: Any = None
    ) -> list[int]:
        if text is not None and len(text) == max_chars:
            encoding.set()
            assert finish.wait(30), "the test never let the encoding finish"
        return real_encode(tokenizer, text, ids, messages, template)

    monkeypatch.setattr(tokenizer_encode, "encode_prompt", held_encode)
    body = {"model": MODEL, "prompt": "the " * (max_chars // 4), "max_tokens": 1}
    request = asyncio.ensure_future(s.http.post(s.url + "/v1/completions", json=body))
    try:
        assert await asyncio.to_thread(encoding.wait, 30)
        began = time.perf_counter()
        async with s.http.get(s.url + "/health") as resp:
            assert resp.status == 200
        assert time.perf_counter() - began < 2.0
        assert not request.done()  # still encoding: /health answered in the meantime
    finally:
        finish.set()
    async with await request as resp:  # 25k tokens: longer than the tiny model's context
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "context_length_exceeded"


def test_limits_are_options_and_flags() -> None:
    args = build_parser().parse_args(["serve", "--max-json-depth", "9", "--max-stop-strings", "5"])
    assert args.max_json_depth == 9 and args.max_stop_strings == 5
    assert args.max_prompt_chars == 2_000_000 and args.max_ws_message_bytes == 4 * 2**20
    with pytest.raises(ValueError, match="max_prompts"):
        ServerOptions(max_prompts=0).validate()
    with pytest.raises(ValueError, match="max_id_chars"):
        ServerOptions(max_id_chars=10).validate()
