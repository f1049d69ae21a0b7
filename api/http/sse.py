"""Server-sent events, as the OpenAI client reads them::

    data: {"id": ..., "choices": [...]}\\n\\n
    ...
    data: {"error": {"message": ..., "type": ..., "param": null, "code": ...}}\\n\\n   (on failure)
    data: [DONE]\\n\\n                                                              (always last)

A write to a client that went away raises ConnectionError; callers let it propagate so the
request's job is left and its engine requests aborted. (aiohttp also cancels the handler
when the connection drops, which aborts a request that is waiting rather than writing.)
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from shoal.api.http.body import encode
from shoal.api.http.errors import ApiError

DONE = b"data: [DONE]\n\n"


async def open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies: do not hold the events back
        }
    )
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, payload: Any) -> None:
    await response.write(b"data: " + encode(payload) + b"\n\n")


async def send_error(response: web.StreamResponse, error: ApiError) -> None:
    await send_event(response, error.body)


async def send_done(response: web.StreamResponse) -> None:
    await response.write(DONE)
    await response.write_eof()
