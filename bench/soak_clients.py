"""The soak's clients (bench/soak.py): each loops over what real clients do, at random.

    chat         a streamed /v1/chat/completions, read to the end
    completion   a plain /v1/completions
    generate     a streamed /generate with logprobs (SGLang's native stream)
    session      /open_session, two or three /generate turns with session_params, /close_session
    websocket    a session over /v1/sessions/ws: open, two turns, close
    leave        a streamed request the client drops after its first events (a disconnect)
    abort        a streamed request ended by /abort_request with its rid

A failure is counted (`Tally`), never raised: the soak's summary shows them.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

KINDS = ("chat", "completion", "generate", "session", "websocket", "leave", "abort")
WEIGHTS = (30, 15, 10, 15, 10, 10, 10)
PROMPTS = (
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "List three colours and one thing of each colour.",
    "Explain what a cache is to a child.",
    "Count from one to twenty in words.",
)


@dataclass
class Tally:
    done: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    def fail(self, kind: str, why: str) -> None:
        self.failed[kind] += 1
        if len(self.errors) < 20:
            self.errors.append(f"{kind}: {why}"[:300])


class Client:
    def __init__(self, base: str, http: aiohttp.ClientSession, rng: random.Random) -> None:
        self.base, self.http, self.rng = base, http, rng

    def prompt(self) -> str:
        return self.rng.choice(PROMPTS)

    def tokens(self) -> int:
        return self.rng.randint(8, 48)

    async def run(self, kind: str) -> None:
        await getattr(self, kind)()

    async def _sse(self, path: str, body: dict[str, Any], keep: int | None = None) -> int:
        """POST a streamed body and read its events (all, or the first `keep`)."""
        events = 0
        async with self.http.post(self.base + path, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"{path} answered {response.status}: {await response.text()}")
            async for line in response.content:
                if line.startswith(b"data: "):
                    if b'"error"' in line[:20]:
                        raise RuntimeError(f"{path} streamed an error: {line[:200]!r}")
                    events += 1
                    if keep is not None and events >= keep:
                        return events  # leaving the block drops the connection
        return events

    async def chat(self) -> None:
        body = {
            "messages": [{"role": "user", "content": self.prompt()}],
            "max_tokens": self.tokens(),
            "temperature": 0.7,
            "stream": True,
        }
        await self._sse("/v1/chat/completions", body)

    async def completion(self) -> None:
        body = {"prompt": self.prompt(), "max_tokens": self.tokens(), "temperature": 0}
        async with self.http.post(self.base + "/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"completions answered {response.status}")
            await response.json()

    async def generate(self) -> None:
        body = {
            "text": self.prompt(),
            "sampling_params": {"max_new_tokens": self.tokens(), "temperature": 0.5},
            "return_logprob": True,
            "stream": True,
        }
        await self._sse("/generate", body)

    async def session(self) -> None:
        async with self.http.post(self.base + "/open_session", json={"timeout_s": 60}) as r:
            if r.status != 200:
                raise RuntimeError(f"open_session answered {r.status}")
            session_id = (await r.json())["session_id"]
        try:
            for _ in range(self.rng.randint(2, 3)):
                body = {
                    "text": self.prompt(),
                    "sampling_params": {"max_new_tokens": self.tokens(), "temperature": 0},
                    "session_params": {"id": session_id},
                }
                async with self.http.post(self.base + "/generate", json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"a session turn answered {r.status}")
                    await r.json()
        finally:
            async with self.http.post(
                self.base + "/close_session", json={"session_id": session_id}
            ) as r:
                await r.read()

    async def websocket(self) -> None:
        async with self.http.ws_connect(self.base + "/v1/sessions/ws") as ws:
            await ws.send_json({"type": "open", "timeout_s": 60})
            opened = await ws.receive_json(timeout=60)
            if opened.get("type") != "opened":
                raise RuntimeError(f"websocket open answered {opened}")
            for _ in range(2):
                turn = {"type": "turn", "text": self.prompt(), "max_tokens": self.tokens()}
                await ws.send_json(turn)
                while True:
                    event = await ws.receive_json(timeout=120)
                    if event["type"] == "done":
                        break
                    if event["type"] == "error":
                        raise RuntimeError(f"websocket turn: {event}")
            await ws.send_json({"type": "close"})
            await ws.receive_json(timeout=60)

    async def leave(self) -> None:
        body = {
            "messages": [{"role": "user", "content": self.prompt()}],
            "max_tokens": 64,
            "stream": True,
        }
        await self._sse("/v1/chat/completions", body, keep=2)

    async def abort(self) -> None:
        rid = f"soak-{uuid.uuid4().hex}"
        body = {
            "text": self.prompt(),
            "rid": rid,
            "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
            "stream": True,
        }
        reader = asyncio.create_task(self._sse("/generate", body))
        await asyncio.sleep(self.rng.uniform(0.05, 0.5))
        async with self.http.post(self.base + "/abort_request", json={"rid": rid}) as r:
            await r.read()
        await reader  # ends with the abort's finish, or earlier if it had finished


async def client_loop(
    index: int, base: str, until: float, tally: Tally, stop: asyncio.Event
) -> None:
    rng = random.Random(index)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        client = Client(base, http, rng)
        while time.monotonic() < until and not stop.is_set():
            kind = rng.choices(KINDS, WEIGHTS)[0]
            try:
                await client.run(kind)
                tally.done[kind] += 1
            except Exception as exc:  # a soak counts failures; the summary shows them
                tally.fail(kind, f"{type(exc).__name__}: {exc}")
