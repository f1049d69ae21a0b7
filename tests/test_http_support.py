"""Shared fixture for the HTTP tests: a Server on the tiny model, on 127.0.0.1, port 0.

    async def test_x(serve: ServeFactory) -> None:
        s = await serve(max_n=4, page_size=4)    # server options, then engine options
        await s.client.chat.completions.create(...)   # the real openai.AsyncOpenAI
        async with s.http.post(s.url + "/generate", json={...}) as resp: ...

Engines come from conftest's make_engine, so after each test they must be idle with nothing
leaked (checked there, after the servers here are stopped).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from conftest import EngineFactory

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


@pytest.fixture
async def serve(make_engine: EngineFactory) -> AsyncIterator[ServeFactory]:
    started: list[Served] = []

    async def start(**options: Any) -> Served:
        server_options = {k: options.pop(k) for k in list(options) if k in SERVER_FIELDS}
        server_options.setdefault("port", 0)
        server_options.setdefault("served_model_name", MODEL)
        engine = await make_engine(**options)
        server = Server(engine, ServerOptions(**server_options))
        await server.start()
        key = server_options.get("api_key") or "unused"
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        served = Served(engine, server, client, aiohttp.ClientSession())
        started.append(served)
        return served

    yield start
    for served in started:
        await served.client.close()
        await served.http.close()
        await served.server.stop()
        assert not served.server.gateway.jobs, "a job outlived its HTTP request"


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
