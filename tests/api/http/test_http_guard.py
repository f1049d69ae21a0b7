"""What a request must show before a handler runs (api/http/guard.py): a browser page on
another origin cannot drive the server, form and text bodies are refused, the lifecycle routes
can need an admin key, and slow or oversized requests are cut off.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from served import Served, ServeFactory, chat

from shoal.api.cli import build_parser
from shoal.api.http.server import ServerOptions

CHAT = "/v1/chat/completions"
EVIL = "http://evil.example"
GENERATE_BODY = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
# every POST route a page could aim a form at, with a body that would be valid as JSON
TARGETS = {
    "/pause_generation": b"{}",
    "/continue_generation": b"{}",
    "/abort_request": b'{"abort_all": true}',
    "/flush_cache": b"{}",
    "/update_weights_from_disk": b'{"model_path": "/tmp"}',
    "/generate": b'{"text": "hi"}',
    CHAT: b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}',
    "/open_session": b"{}",
}
NOT_JSON = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]


async def generates(s: Served, timeout_s: float = 30) -> None:
    """A short generation finishes: the engine is not paused."""
    async with asyncio.timeout(timeout_s):
        async with s.http.post(s.url + "/generate", json=GENERATE_BODY) as resp:
            assert resp.status == 200, await resp.text()


async def cached_tokens(s: Served, headers: dict[str, str] | None = None) -> int:
    async with s.http.get(s.url + "/get_server_info", headers=headers) as resp:
        assert resp.status == 200
        count: int = (await resp.json())["cached_tokens"]
        return count


async def assert_error(resp: aiohttp.ClientResponse, status: int, code: str) -> str:
    body: dict[str, Any] = await resp.json()
    assert resp.status == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body
    message: str = body["error"]["message"]
    return message


# ---- content type ------------------------------------------------------------------------


async def test_form_and_text_posts_are_refused_and_change_nothing(serve: ServeFactory) -> None:
    s = await serve(page_size=4)
    await s.engine.generate(input_ids=list(range(5, 45)), max_new_tokens=2).result()
    cached = await cached_tokens(s)
    assert cached > 0
    bystander = s.engine.generate(input_ids=[5, 6, 7], max_new_tokens=40, ignore_eos=True)
    for path, body in TARGETS.items():
        for content_type in NOT_JSON:
            headers = {"Content-Type": content_type}
            async with s.http.post(s.url + path, data=body, headers=headers) as resp:
                message = await assert_error(resp, 415, "unsupported_media_type")
                assert "Content-Type: application/json" in message
        # a body without any Content-Type (fetch() with a Blob) is refused too
        async with s.http.post(s.url + path, data=body, skip_auto_headers=["Content-Type"]) as resp:
            await assert_error(resp, 415, "unsupported_media_type")
        # so is a non-JSON Content-Type on an empty body
        async with s.http.post(s.url + path, headers={"Content-Type": "text/plain"}) as resp:
            await assert_error(resp, 415, "unsupported_media_type")
    done = await bystander.result()  # not aborted, not paused
    assert done.finish_reason == "length" and len(done.token_ids) == 40
    await generates(s)
    assert s.engine.weight_version == "0"
    assert await cached_tokens(s) >= cached  # not flushed
    assert not s.server.gateway.jobs


async def test_json_with_parameters_and_bodyless_posts_pass(serve: ServeFactory) -> None:
    s = await serve()
    headers = {"Content-Type": "Application/JSON; charset=utf-8"}
    data = b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}'
    async with s.http.post(s.url + "/generate", data=data, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    for path in ("/pause_generation", "/continue_generation", "/flush_cache?timeout=5"):
        async with s.http.post(s.url + path) as resp:  # no body, no Content-Type
            assert resp.status == 200, (path, await resp.text())
    await generates(s)


# ---- origin ------------------------------------------------------------------------------


async def test_a_cross_site_origin_is_refused_on_http_and_the_websocket(
    serve: ServeFactory,
) -> None:
    s = await serve()
    for origin in (EVIL, "null", f"http://localhost:{s.server.port}", "https://127.0.0.1"):
        headers = {"Origin": origin}
        async with s.http.post(s.url + "/pause_generation", headers=headers) as resp:
            await assert_error(resp, 403, "origin_not_allowed")
        async with s.http.post(s.url + CHAT, json=chat("hi"), headers=headers) as resp:
            await assert_error(resp, 403, "origin_not_allowed")
        async with s.http.get(s.url + "/v1/models", headers=headers) as resp:
            await assert_error(resp, 403, "origin_not_allowed")
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await s.http.ws_connect(s.url + "/v1/sessions/ws", headers=headers)
        assert refused.value.status == 403
    cross_site = {"Sec-Fetch-Site": "cross-site"}  # a browser request without Origin
    async with s.http.post(s.url + "/pause_generation", headers=cross_site) as resp:
        await assert_error(resp, 403, "forbidden")
    await generates(s)  # never paused


async def test_the_own_and_allowed_origins_pass(serve: ServeFactory) -> None:
    s = await serve(allowed_origins=("http://ui.example:8080", "null"))
    port = s.server.port
    for origin in (s.url, f"HTTP://127.0.0.1:{port}/", "http://UI.example:8080", "null"):
        headers = {"Origin": origin, "Sec-Fetch-Site": "same-origin"}
        async with s.http.get(s.url + "/v1/models", headers=headers) as resp:
            assert resp.status == 200, (origin, await resp.text())
        async with s.http.post(s.url + "/generate", json=GENERATE_BODY, headers=headers) as resp:
            assert resp.status == 200, (origin, await resp.text())
        ws = await s.http.ws_connect(s.url + "/v1/sessions/ws", headers=headers)
        await ws.send_json({"type": "open"})
        assert (await ws.receive_json(timeout=30))["type"] == "opened"
        await ws.close()
    async with s.http.get(s.url + "/v1/models", headers={"Origin": "http://ui.example"}) as resp:
        assert resp.status == 403  # another port is another origin
    anyone = await serve(allowed_origins=("*",))
    for headers in ({"Origin": EVIL}, {"Sec-Fetch-Site": "cross-site"}):
        async with anyone.http.get(anyone.url + "/v1/models", headers=headers) as resp:
            assert resp.status == 200


# ---- admin key ---------------------------------------------------------------------------


async def test_the_lifecycle_routes_need_the_admin_key(serve: ServeFactory) -> None:
    s = await serve(api_key="user-key", admin_api_key="admin-key")
    user = {"Authorization": "Bearer user-key"}
    admin = {"Authorization": "Bearer admin-key"}
    routes = {
        "/pause_generation": None,
        "/continue_generation": None,
        "/flush_cache?timeout=5": None,
        "/abort_request": {"abort_all": True},
        "/update_weights_from_disk": {"model_path": "/nonexistent"},
    }
    for path, body in routes.items():
        async with s.http.post(s.url + path, json=body) as resp:
            await assert_error(resp, 401, "invalid_api_key")
        async with s.http.post(s.url + path, json=body, headers=user) as resp:
            await assert_error(resp, 403, "forbidden")
        async with s.http.post(s.url + path, json=body, headers=admin) as resp:
            expected = 400 if path == "/update_weights_from_disk" else 200
            assert resp.status == expected, (path, await resp.text())
    for headers in (user, admin):  # the other routes take either key
        async with s.http.get(s.url + "/v1/models", headers=headers) as resp:
            assert resp.status == 200
    async with s.http.get(s.url + "/v1/models") as resp:
        assert resp.status == 401
    async with s.http.get(s.url + "/get_server_info", headers=user) as resp:
        text = await resp.text()
        assert "admin-key" not in text and "user-key" not in text
        assert (await resp.json())["server"]["admin_api_key"] == "<set>"


async def test_an_admin_key_alone_guards_only_the_lifecycle_routes(serve: ServeFactory) -> None:
    s = await serve(admin_api_key="admin-key")
    await generates(s)
    async with s.http.post(s.url + "/pause_generation") as resp:
        await assert_error(resp, 401, "invalid_api_key")
    await generates(s)  # not paused


async def test_a_refused_weight_update_says_nothing_about_the_path(
    serve: ServeFactory, tiny_folder: Path
) -> None:
    s = await serve(api_key="user-key", admin_api_key="admin-key")
    plain = await serve(api_key="user-key")
    for server, headers in (
        (s, {}),
        (s, {"Authorization": "Bearer user-key"}),
        (s, {"Authorization": "Bearer wrong"}),
        (plain, {}),
    ):
        answers = []
        for model_path in (str(tiny_folder), "/nonexistent/model"):
            url = server.url + "/update_weights_from_disk"
            async with server.http.post(url, json={"model_path": model_path}, headers=headers) as r:
                shown = {k: v for k, v in r.headers.items() if k not in ("Date",)}
                answers.append((r.status, shown, await r.read()))
        assert answers[0] == answers[1], answers
        assert answers[0][0] in (401, 403)
        assert server.engine.weight_version == "0"


# ---- Retry-After -------------------------------------------------------------------------


async def test_429_and_503_carry_retry_after(serve: ServeFactory) -> None:
    s = await serve(max_running_requests=1, max_queued_requests=0)
    body = chat("hi", max_tokens=200, stream=True, ignore_eos=True)
    async with s.http.post(s.url + CHAT, json=body) as holder:
        assert holder.status == 200
        async with s.http.post(s.url + CHAT, json=chat("hi", max_tokens=2)) as resp:
            await assert_error(resp, 429, "rate_limit_exceeded")
            assert int(resp.headers["Retry-After"]) >= 1
        holder.close()
    for _ in range(200):  # the handler notices its client left
        if not s.server.gateway.jobs:
            break
        await asyncio.sleep(0.01)
    s.server.gateway.draining = True
    try:
        async with s.http.get(s.url + "/v1/models") as resp:
            await assert_error(resp, 503, "service_unavailable")
            assert int(resp.headers["Retry-After"]) >= 1
    finally:
        s.server.gateway.draining = False
    async with s.http.get(s.url + "/v1/models") as resp:
        assert resp.status == 200 and "Retry-After" not in resp.headers


# ---- slow and oversized requests ----------------------------------------------------------


async def raw_request(s: Served, head: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", s.server.port)
    writer.write(head)
    await writer.drain()
    return reader, writer


async def test_a_trickled_body_answers_408(serve: ServeFactory) -> None:
    s = await serve(body_timeout_s=0.5)
    head = (
        b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{"
    )
    reader, writer = await raw_request(s, head)
    began = time.monotonic()
    try:
        trickle = asyncio.create_task(_trickle(writer, b" "))
        status_line = await asyncio.wait_for(reader.readline(), timeout=10)
        assert status_line.startswith(b"HTTP/1.1 408"), status_line
        assert time.monotonic() - began < 5
        trickle.cancel()
    finally:
        writer.close()
    await generates(s)
    assert not s.server.gateway.jobs


async def _trickle(writer: asyncio.StreamWriter, chunk: bytes) -> None:
    while True:
        await asyncio.sleep(0.1)
        writer.write(chunk)
        await writer.drain()


async def test_a_trickled_head_is_cut_off(serve: ServeFactory) -> None:
    s = await serve(header_timeout_s=0.5)
    reader, writer = await raw_request(s, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    began = time.monotonic()
    trickle = asyncio.create_task(_trickle(writer, b"X-Slow: a\r\n"))
    try:
        assert await asyncio.wait_for(reader.read(), timeout=10) == b""  # closed, no answer
        assert time.monotonic() - began < 5
    finally:
        trickle.cancel()
        writer.close()
    async with s.http.get(s.url + "/v1/models") as resp:
        assert resp.status == 200


async def test_oversized_headers_are_refused(serve: ServeFactory) -> None:
    s = await serve(max_header_bytes=1024, max_headers=16)
    async with s.http.get(s.url + "/v1/models", headers={"X-Big": "a" * 2000}) as resp:
        assert resp.status == 400
    many = {f"X-H{i}": "a" for i in range(40)}
    async with s.http.get(s.url + "/v1/models", headers=many) as resp:
        assert resp.status == 400
    async with s.http.get(s.url + "/v1/models", headers={"X-Small": "a" * 500}) as resp:
        assert resp.status == 200


# ---- options -----------------------------------------------------------------------------


def test_options_are_validated_and_the_flags_reach_them() -> None:
    for bad in (
        {"allowed_origins": ("evil.example",)},
        {"allowed_origins": ("http://a.example/path",)},
        {"api_key": "same", "admin_api_key": "same"},
        {"body_timeout_s": 0.0},
        {"header_timeout_s": -1.0},
        {"max_header_bytes": 0},
    ):
        with pytest.raises(ValueError):
            ServerOptions(**bad).validate()  # type: ignore[arg-type]
    args = build_parser().parse_args(
        [
            "serve",
            "--allowed-origins",
            "http://a.example:8080, https://b.example",
            "--admin-api-key",
            "k",
            "--body-timeout-s",
            "5",
            "--header-timeout-s",
            "7",
            "--max-header-bytes",
            "4096",
            "--max-headers",
            "64",
        ]
    )
    assert args.allowed_origins == ("http://a.example:8080", "https://b.example")
    assert (args.admin_api_key, args.body_timeout_s, args.header_timeout_s) == ("k", 5.0, 7.0)
    assert (args.max_header_bytes, args.max_headers) == (4096, 64)
    assert ServerOptions(admin_api_key="k").public()["admin_api_key"] == "<set>"
