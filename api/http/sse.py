"""Server-sent events, as the OpenAI client reads them::

    data: {"id": ..., "choices": [...]}\\n\\n
    : keep-alive\\n\\n                                       (a comment, after keepalive_s idle)
    ...
    data: {"error": {"message": ..., "type": ..., "param": null, "code": ...}}\\n\\n   (on failure)
    data: [DONE]\\n\\n                                                              (always last)

    async with open_sse(request) as sse:
        await sse.event(chunk)
        ...
        await sse.done()
    return sse.response

Every write is bounded by the stream policy's write_timeout_s (api/http/stream_writer.py): a
client that takes nothing for that long is cut. A comment line (`: keep-alive`, which every
compliant reader ignores; the openai package does) goes out whenever no write has for
keepalive_s, from the moment the stream opens: proxies and clients see a live connection while
a request queues or prefills. One lock orders the handler's writes and the keep-alives.

A client that went away (or was cut) raises ConnectionError from a write; `open_sse` ends the
stream quietly there, so the handler returns, its job is left and its engine requests are
aborted (aiohttp also cancels the handler when the connection drops, which aborts a request
that is waiting rather than writing). Nothing is logged for it but the cut's one line.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from shoal.api.http.body import encode
from shoal.api.http.errors import ApiError
from shoal.api.http.stream_writer import StreamPolicy, stream_policy, write_within

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"


@contextlib.asynccontextmanager
async def open_sse(request: web.Request) -> AsyncIterator[SseStream]:
    """Start the SSE response; a ConnectionError inside (the client gone or cut) ends it
    without a word, and the keep-alives stop with it."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies: do not hold the events back
        }
    )
    await response.prepare(request)
    stream = SseStream(request, response, stream_policy(request))
    try:
        yield stream
    except ConnectionError:
        pass  # nobody to answer; the caller's job is left next, aborting what still runs
    finally:
        await stream.close()


class SseStream:
    def __init__(
        self, request: web.Request, response: web.StreamResponse, policy: StreamPolicy
    ) -> None:
        self.request = request
        self.response = response
        self.policy = policy
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self._last_write_at = self._loop.time()
        self._ended = False  # the body's end is written: nothing more may be
        self._keeper: asyncio.Task[None] | None = None
        if policy.keepalive_s > 0:
            self._keeper = asyncio.create_task(self._keep_alive(), name="shoal-sse-keepalive")

    async def event(self, payload: Any) -> None:
        await self._write(b"data: " + encode(payload) + b"\n\n")

    async def error(self, error: ApiError) -> None:
        await self.event(error.body)

    async def done(self) -> None:
        """`data: [DONE]`, then the end of the body; both bounded, so a handler never waits
        on a client that stopped reading, not even for its last bytes."""
        await self._write(DONE, eof=True)

    async def close(self) -> None:
        if self._keeper is not None:
            keeper, self._keeper = self._keeper, None
            keeper.cancel()
            await asyncio.wait([keeper])  # raises only if this task itself is cancelled

    async def _write(self, data: bytes, eof: bool = False) -> None:
        async with self._lock:
            self._ended = self._ended or eof
            await write_within(lambda: self._send(data, eof), self.request, self.policy)
            self._last_write_at = self._loop.time()

    async def _send(self, data: bytes, eof: bool) -> None:
        if eof:
            await self.response.write_eof(data)
        else:
            await self.response.write(data)

    async def _keep_alive(self) -> None:
        interval_s = self.policy.keepalive_s
        while True:
            idle_s = self._loop.time() - self._last_write_at
            if idle_s < interval_s:
                await asyncio.sleep(interval_s - idle_s)
                continue
            async with self._lock:  # the handler's write may have gone out meanwhile
                if self._ended:
                    return
                if self._loop.time() - self._last_write_at < interval_s:
                    continue
                try:
                    await write_within(
                        lambda: self.response.write(KEEP_ALIVE), self.request, self.policy
                    )
                except ConnectionError:
                    return  # gone or cut: aiohttp cancels the handler as the connection drops
                self._last_write_at = self._loop.time()
