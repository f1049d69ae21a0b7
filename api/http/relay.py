"""The one loop that writes a job's events to a client, whatever the format: an OpenAI chat or
completions stream, a /generate stream, a websocket turn.

    await relay(job, fmt, send, checked=True)        # fmt: a StreamFormat, send: one write
    return await stream_sse(request, job, fmt)       # the SSE answer of the HTTP doors

A format is made per request and may keep state (text offsets, what was sent so far):

    first(i)        what opens choice i (chat: the assistant role), or None
    delta(i, d)     what carries a Delta's text / tokens / logprobs, or None if nothing
    finish(i, c)    what closes choice i
    last(cs)        what follows every choice's end (OpenAI's usage chunk), or None

Every write goes through `send`, bounded by the stream policy (api/http/stream_writer.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import msgspec
from aiohttp import web

from shoal.api.http.errors import ApiError
from shoal.api.http.job import Finished, Job, Streamed
from shoal.api.http.sse import open_sse
from shoal.results import Completion, Delta

Chunk = TypeVar("Chunk", bound=msgspec.Struct, covariant=True)
Sent = TypeVar("Sent", bound=msgspec.Struct)


class StreamFormat(Protocol[Chunk]):
    def first(self, index: int) -> Chunk | None: ...
    def delta(self, index: int, delta: Delta) -> Chunk | None: ...
    def finish(self, index: int, completion: Completion) -> Chunk: ...
    def last(self, completions: list[Completion]) -> Chunk | None: ...


async def relay(
    job: Job,
    fmt: StreamFormat[Sent],
    send: Callable[[Sent], Awaitable[None]],
    checked: bool,
) -> None:
    """Write every event of the job in the format. `checked`: a choice that ended unfinished
    raises its ApiError (errors.check_finished) instead of its finish."""
    for index in range(len(job.streams)):
        opening = fmt.first(index)
        if opening is not None:
            await send(opening)
    finished: dict[int, Completion] = {}
    async for event in job.events(checked):
        match event:
            case Streamed(index=index, delta=delta):
                chunk = fmt.delta(index, delta)
                if chunk is not None:
                    await send(chunk)
            case Finished(index=index, completion=completion):
                finished[index] = completion
                await send(fmt.finish(index, completion))
    closing = fmt.last([finished[i] for i in range(len(job.streams))])
    if closing is not None:
        await send(closing)


async def stream_sse(
    request: web.Request, job: Job, fmt: StreamFormat[msgspec.Struct]
) -> web.StreamResponse:
    """The SSE answer: every event, an error event if a choice fails (the rest are aborted),
    and `data: [DONE]` always last. A client gone or cut ends it quietly (open_sse)."""
    async with open_sse(request) as sse:
        try:
            await relay(job, fmt, sse.event, checked=True)
        except ApiError as exc:
            job.abort()
            await sse.error(exc)
        await sse.done()
    return sse.response
