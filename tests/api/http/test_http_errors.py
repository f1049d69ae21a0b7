"""Bad input gets a 4xx in the one error shape, naming the field, and disturbs nothing."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from served import MODEL, ServeFactory, chat, sse_events

from shoal.api.http.errors import error_middleware

CONTEXT = 256  # the engine below runs with this context length
CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
TOO_LONG = "context_length_exceeded"

Case = tuple[str, str, Any, int, str | None, str | None]  # id, path, body, status, param, code


def case(
    name: str,
    path: str,
    body: Any,
    param: str | None = None,
    code: str | None = None,
    status: int = 400,
) -> Case:
    return name, path, body, status, param, code


CASES: list[Case] = [
    case("malformed-json", CHAT, b'{"messages": ['),
    case("empty-body", CHAT, b""),
    case("not-an-object", CHAT, b"[1, 2]"),
    case("invalid-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    case(
        "lone-surrogate",
        CHAT,
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        "messages[0].content",
    ),
    case("messages-missing", CHAT, {"model": MODEL}, "messages"),
    case("messages-empty", CHAT, {"messages": []}, "messages"),
    case("messages-wrong-type", CHAT, {"messages": "hello"}, "messages"),
    case(
        "role-unknown", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"
    ),
    case(
        "content-image",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0]",
    ),
    case("max-tokens-zero", CHAT, chat("hi", max_tokens=0), "max_tokens"),
    case("max-tokens-string", CHAT, chat("hi", max_tokens="ten"), "max_tokens"),
    case("max-tokens-beyond-context", CHAT, chat("hi", max_tokens=10**6), "max_tokens", TOO_LONG),
    case(
        "max-completion-tokens-negative",
        CHAT,
        chat("hi", max_completion_tokens=-1),
        "max_completion_tokens",
    ),
    case("temperature-high", CHAT, chat("hi", temperature=2.5), "temperature"),
    case("temperature-negative", CHAT, chat("hi", temperature=-0.1), "temperature"),
    case("top-p-zero", CHAT, chat("hi", top_p=0), "top_p"),
    case("top-p-above-one", CHAT, chat("hi", top_p=1.5), "top_p"),
    case("n-zero", CHAT, chat("hi", n=0), "n"),
    case("n-above-cap", CHAT, chat("hi", n=1000), "n"),
    case("top-logprobs-high", CHAT, chat("hi", logprobs=True, top_logprobs=21), "top_logprobs"),
    case("top-logprobs-alone", CHAT, chat("hi", top_logprobs=2), "top_logprobs"),
    case("presence-penalty", CHAT, chat("hi", presence_penalty=3), "presence_penalty"),
    case("repetition-penalty", CHAT, chat("hi", repetition_penalty=0), "repetition_penalty"),
    case("top-k-zero", CHAT, chat("hi", top_k=0), "top_k"),
    case("seed-negative", CHAT, chat("hi", seed=-1), "seed"),
    case("stop-empty", CHAT, chat("hi", stop=[""]), "stop"),
    case("stop-token-out-of-vocab", CHAT, chat("hi", stop_token_ids=[10**6]), "stop_token_ids"),
    case("stop-token-wrong-type", CHAT, chat("hi", stop_token_ids=["a"]), "stop_token_ids[0]"),
    case("logit-bias-value", CHAT, chat("hi", logit_bias={"5": 101}), "logit_bias"),
    case("logit-bias-key", COMPLETIONS, {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    case(
        "unknown-model",
        CHAT,
        {**chat("hi"), "model": "gpt-5"},
        "model",
        "model_not_found",
        status=404,
    ),
    case("prompt-too-long", COMPLETIONS, {"prompt": [5] * CONTEXT}, "prompt", TOO_LONG),
    case(
        "prompt-plus-max-tokens",
        COMPLETIONS,
        {"prompt": [5] * 200, "max_tokens": 100},
        "max_tokens",
        TOO_LONG,
    ),
    case(
        "prompt-ids-out-of-vocab", COMPLETIONS, {"prompt": [5, 6, 512], "max_tokens": 2}, "prompt"
    ),
    case("prompt-ids-negative", COMPLETIONS, {"prompt": [[5, -1]], "max_tokens": 2}, "prompt[0]"),
    case("prompt-empty-string", COMPLETIONS, {"prompt": ""}, "prompt"),
    case("prompt-empty-list", COMPLETIONS, {"prompt": []}, "prompt"),
    case("prompt-mixed", COMPLETIONS, {"prompt": ["a", [5]]}, "prompt[1]"),
    case("prompt-number", COMPLETIONS, {"prompt": 5}, "prompt"),
    case("prompt-lone-surrogate", COMPLETIONS, b'{"prompt": ["ok", "\\udc00"]}', "prompt[1]"),
    case("completion-logprobs-high", COMPLETIONS, {"prompt": "a", "logprobs": 50}, "logprobs"),
    case("echo", CHAT, chat("hi", echo=True), "echo"),  # completions' is honoured
    case(
        "max-tokens-zero-without-echo", COMPLETIONS, {"prompt": "a", "max_tokens": 0}, "max_tokens"
    ),
    case("generate-no-prompt", GENERATE, {"sampling_params": {}}, "text"),
    case("generate-both-prompts", GENERATE, {"text": "a", "input_ids": [5]}, "text"),
    case(
        "generate-unknown-sampling-field",
        GENERATE,
        {"text": "a", "sampling_params": {"temprature": 1}},
        "sampling_params.temprature",
    ),
    case(
        "generate-max-new-tokens-negative",  # 0: the prefill alone (prompt logprobs)
        GENERATE,
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        "sampling_params.max_new_tokens",
    ),
    case("generate-ids-out-of-vocab", GENERATE, {"input_ids": [5, 99999]}, "input_ids"),
    case("generate-too-long", GENERATE, {"input_ids": [5] * 300}, "input_ids", TOO_LONG),
    case(
        "generate-top-logprobs-num",
        GENERATE,
        {"text": "a", "return_logprob": True, "top_logprobs_num": 99},
        "top_logprobs_num",
    ),
    case("generate-batch-stream", GENERATE, {"text": ["a", "b"], "stream": True}, "stream"),
    case("abort-nothing", "/abort_request", {}, "rid"),
    case("unknown-route", "/v1/embeddings", {"input": "a"}, None, status=404),
]


def assert_error_shape(body: dict[str, Any], param: str | None, code: str | None) -> None:
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
        assert param.split("[")[0].split(".")[-1] in error["message"], error
    if code is not None:
        assert error["code"] == code, error


async def test_bad_input_table_then_the_server_is_unharmed(serve: ServeFactory) -> None:
    assert len(CASES) >= 25
    s = await serve(context_length=CONTEXT, max_n=8)
    # a long request runs through the whole table: bad input must not disturb it
    bystander = s.engine.generate(input_ids=[5, 6, 7], max_new_tokens=60, ignore_eos=True)
    statuses = []
    for name, path, body, status, param, code in CASES:
        kwargs = (
            {"data": body, "headers": {"Content-Type": "application/json"}}
            if isinstance(body, bytes)
            else {"json": body}
        )
        async with s.http.post(s.url + path, **kwargs) as resp:
            got = await resp.json()
            statuses.append(resp.status)
            assert resp.status == status, (name, resp.status, got)
            assert resp.headers["Content-Type"].startswith("application/json"), name
            assert_error_shape(got, param, code)
    assert all(400 <= s < 500 for s in statuses)
    done = await bystander.result()
    assert done.finish_reason == "length" and len(done.token_ids) == 60
    ok = await s.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert ok.choices[0].finish_reason in ("stop", "length")
    await s.engine.check_integrity()
    snapshot = await s.engine.snapshot()
    assert snapshot.idle and not s.server.gateway.jobs


async def test_a_streamed_request_the_engine_refuses_answers_before_its_stream(
    serve: ServeFactory,
) -> None:
    """The engine measures the prompt (its tokenizer actor): a streamed request waits for
    that before it opens its stream, so a refused prompt is a 4xx, never an error event in a
    200 stream."""
    s = await serve(context_length=CONTEXT, max_n=8)
    refused = [
        (CHAT, {**chat("hi", max_tokens=10**6), "n": 2}, "max_tokens", TOO_LONG),
        (COMPLETIONS, {"prompt": [5] * CONTEXT}, "prompt", TOO_LONG),
        (COMPLETIONS, {"prompt": [[5], [5, 600]], "max_tokens": 2}, "prompt[1]", None),
        (GENERATE, {"input_ids": [5] * 300}, "input_ids", TOO_LONG),
        (GENERATE, {"input_ids": [5, 99999]}, "input_ids", None),
    ]
    for path, body, param, code in refused:
        if path != GENERATE:
            body = {"model": MODEL, **body}
        async with s.http.post(s.url + path, json={**body, "stream": True}) as resp:
            got = await resp.json()
            assert resp.status == 400, (path, body, got)
            assert resp.headers["Content-Type"].startswith("application/json"), path
            assert_error_shape(got, param, code)
    await s.engine.check_integrity()
    assert not s.server.gateway.jobs


async def test_the_openai_client_sees_typed_errors_without_retrying(serve: ServeFactory) -> None:
    s = await serve(context_length=CONTEXT)
    with pytest.raises(openai.BadRequestError) as caught:
        await s.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=5
        )
    assert caught.value.status_code == 400
    assert caught.value.param == "temperature"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as caught:
        await s.client.completions.create(model=MODEL, prompt=[5] * CONTEXT)
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        await s.client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}]
        )


async def test_wrong_method_is_405_in_the_error_shape_with_allow(serve: ServeFactory) -> None:
    s = await serve()
    async with s.http.get(s.url + CHAT) as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"  # RFC 9110: a 405 lists what the route takes
        body = await resp.json()
        assert_error_shape(body, None, "method_not_allowed")
        assert "POST" in body["error"]["message"]
    async with s.http.post(s.url + "/v1/models") as resp:
        assert resp.status == 405
        assert {m.strip() for m in resp.headers["Allow"].split(",")} == {"GET", "HEAD"}


async def test_api_key_guards_every_route_but_health(serve: ServeFactory) -> None:
    s = await serve(api_key="sekrit")
    async with s.http.get(s.url + "/health") as resp:
        assert resp.status == 200
    for path in ("/v1/models", "/get_model_info", "/metrics", "/health_generate", "/nope"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            async with s.http.get(s.url + path, headers=headers) as resp:
                assert resp.status == 401, (path, headers)
                assert_error_shape(await resp.json(), None, "invalid_api_key")
    good = {"Authorization": "Bearer sekrit"}
    async with s.http.get(s.url + "/v1/models", headers=good) as resp:
        assert resp.status == 200
    reply = await s.client.chat.completions.create(  # the client sends the key it was given
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices
    bad = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    await bad.close()


async def test_oversized_body_is_413(serve: ServeFactory) -> None:
    s = await serve(max_body_bytes=10_000)
    body = chat("x" * 20_000, max_tokens=2)
    async with s.http.post(s.url + CHAT, json=body) as resp:
        assert resp.status == 413
        assert_error_shape(await resp.json(), None, "request_too_large")
    async with s.http.post(s.url + CHAT, json=chat("small", max_tokens=2)) as resp:
        assert resp.status == 200


async def test_saturation_answers_429_instead_of_queueing_without_bound(
    serve: ServeFactory,
) -> None:
    s = await serve(max_running_requests=2, max_queued_requests=2)
    body = chat("hi", max_tokens=200, stream=True, ignore_eos=True)
    holders = [s.http.post(s.url + CHAT, json=body) for _ in range(4)]
    responses = [await h.__aenter__() for h in holders]
    try:
        assert all(r.status == 200 for r in responses)
        async with s.http.post(s.url + CHAT, json=chat("hi", max_tokens=2)) as resp:
            assert resp.status == 429
            assert_error_shape(await resp.json(), None, "rate_limit_exceeded")
        async with s.http.post(s.url + CHAT, json=chat("hi", max_tokens=2, n=3)) as resp:
            assert resp.status == 429
        async with s.http.post(s.url + CHAT, json=chat("hi", max_tokens=2, n=5)) as resp:
            assert resp.status == 400  # more than the server ever holds: retrying cannot help
            assert (await resp.json())["error"]["param"] == "n"
    finally:
        for h, r in zip(holders, responses, strict=True):
            r.close()
            await h.__aexit__(None, None, None)
    await s.engine.wait_idle(timeout_s=10)
    for _ in range(100):  # the handlers notice their clients left
        if not s.server.gateway.jobs:
            break
        await asyncio.sleep(0.01)
    async with s.http.post(s.url + CHAT, json=chat("hi", max_tokens=2)) as resp:
        assert resp.status == 200


async def test_shutdown_ends_open_streams_with_an_error_event_then_503(
    serve: ServeFactory,
) -> None:
    s = await serve()
    body = chat("hi", max_tokens=500, stream=True, ignore_eos=True)
    async with s.http.post(s.url + CHAT, json=body) as resp:
        await resp.content.readline()  # the stream is open
        stopping = asyncio.create_task(s.server.stop())
        events = await asyncio.wait_for(sse_events(resp), timeout=10)
    await asyncio.wait_for(stopping, timeout=10)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "service_unavailable"
    assert "shutting down" in events[-2]["error"]["message"]
    await s.engine.wait_idle(timeout_s=10)


async def test_draining_server_answers_503(serve: ServeFactory) -> None:
    s = await serve()
    s.server.gateway.draining = True
    try:
        async with s.http.post(s.url + CHAT, json=chat("hi", max_tokens=2)) as resp:
            assert resp.status == 503
            assert_error_shape(await resp.json(), None, "service_unavailable")
    finally:
        s.server.gateway.draining = False


async def _served_app(handler: Any) -> tuple[TestServer, aiohttp.ClientSession]:
    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/last", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, aiohttp.ClientSession()


async def test_a_client_gone_before_the_last_write_is_logged_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that resets right after the last event: the stream's closing write fails on
    the closing transport. That is a debug line, not aiohttp's ERROR with a traceback."""

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"data: [DONE]\n\n")
        assert request.transport is not None
        request.transport.abort()  # the client's reset, as it lands before write_eof
        await response.write_eof()  # raises ConnectionResetError
        return response

    server, http = await _served_app(stream)
    try:
        with caplog.at_level(logging.DEBUG):
            with pytest.raises(aiohttp.ClientError):
                async with http.get(server.make_url("/last")) as resp:
                    await resp.read()
            await server.close()  # every handler has ended
    finally:
        await http.close()
        await server.close()
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == [], [r.getMessage() for r in loud]
    assert any("the client went away" in r.getMessage() for r in caplog.records)


async def test_a_connection_error_not_about_the_client_is_a_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def peer_refused(request: web.Request) -> web.Response:
        raise ConnectionRefusedError("a peer this handler called refused")

    server, http = await _served_app(peer_refused)
    try:
        with caplog.at_level(logging.ERROR, logger="shoal.http"):
            async with http.get(server.make_url("/last")) as resp:
                assert resp.status == 500
                assert_error_shape(await resp.json(), None, "internal_error")
    finally:
        await http.close()
        await server.close()
    assert any(r.name == "shoal.http" and r.exc_info for r in caplog.records)
