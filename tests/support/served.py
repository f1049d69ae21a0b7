"""What the tests that start servers share: conftest.py's `serve` fixture gives a `Served`, a
Server on the tiny model, on 127.0.0.1, port 0.

    async def test_x(serve: ServeFactory) -> None:
        s = await serve(max_n=4, page_size=4)    # server options, then engine options
        await s.client.chat.completions.create(...)   # the real openai.AsyncOpenAI
        async with s.http.post(s.url + "/generate", json={...}) as resp: ...
        status, got = await post(s, "/generate", {...})

Engines come from conftest's make_engine, so after each test they must be idle with nothing
leaked (checked there, after the servers are stopped).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai

from shoal.api.engine import Engine
from shoal.api.http.server import Server, ServerOptions

MODEL = "tiny"
SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerOptions)}


@dataclass
class Served:
    engine: Engine
    server: Server
    client: openai.AsyncOpenAI
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.server.url


ServeFactory = Callable[..., Awaitable[Served]]


async def post(s: Served, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST a JSON body; the status and the parsed answer."""
    async with s.http.post(s.url + path, json=body) as resp:
        return resp.status, await resp.json()


async def post_ok(s: Served, path: str, body: dict[str, Any]) -> Any:
    """POST a JSON body that must be answered 200; the parsed answer."""
    status, got = await post(s, path, body)
    assert status == 200, got
    return got


async def sse_events(response: aiohttp.ClientResponse) -> list[Any]:
    """Every `data:` payload of an SSE response, parsed; "[DONE]" stays a string."""
    events: list[Any] = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}
