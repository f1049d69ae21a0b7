"""One HTTP request's engine requests (or a websocket turn's), as the gateway started them.

    async with gateway.submit(submission) as job:
        await job.accepted()                       # a streamed answer: every prompt accepted
        async for event in job.events(checked=True):    # Streamed(index, delta) ...
            ...                                          # Finished(index, completion)
        completions = await job.finished()         # or: the whole answer

A prompt is encoded and measured by the engine (its tokenizer actor), so its refusal arrives
from its stream: `accepted()` raises it as the ApiError the door answers before a streamed
response opens; a whole answer raises it from `finished()`. Every failure is named in the
door's names (FieldNames). Leaving `async with job` in any way (finished, an exception, the
handler cancelled because the client went away) aborts whatever still runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from shoal.api.http.errors import ApiError, FieldNames, check_finished, from_engine
from shoal.api.http.metrics import RequestTimer
from shoal.results import Completion, Delta, RequestStream

if TYPE_CHECKING:
    from shoal.api.http.gateway import Gateway


@dataclass(frozen=True)
class Streamed:
    """Choice `index` produced text (and tokens)."""

    index: int
    delta: Delta


@dataclass(frozen=True)
class Finished:
    """Choice `index` ended."""

    index: int
    completion: Completion


Event = Streamed | Finished


class Job:
    def __init__(
        self,
        gateway: Gateway,
        public_id: str,
        streams: list[RequestStream],
        arrived_at: float,
        names: Sequence[FieldNames],
    ) -> None:
        self.gateway = gateway
        self.public_id = public_id
        self.streams = streams
        self.timers = [gateway.metrics.timer(arrived_at) for _ in streams]
        self.names = names  # each choice's
        self.tasks: list[asyncio.Task[None]] = []

    async def accepted(self) -> list[int]:
        """Every choice's prompt tokens once its prompt is accepted (0 for one that ended
        before: aborted meanwhile); the first refusal raises its ApiError."""
        counts = []
        for index, stream in enumerate(self.streams):
            try:
                counts.append(await stream.accepted() or 0)
            except Exception as exc:
                raise self._failed(index, exc) from None
        return counts

    async def events(self, checked: bool = False) -> AsyncIterator[Event]:
        """Every choice's Deltas then its Completion, interleaved as they come.

        Raises ApiError if a request fails (bad input found by the engine: 400; engine dead:
        503), and, `checked`, if one ended unfinished (errors.check_finished); the others are
        aborted when the job is left.
        """
        if len(self.streams) == 1:
            async for event in self._pump(0, checked):
                yield event
            return
        queue: asyncio.Queue[Event | ApiError] = asyncio.Queue()
        self.tasks = [
            asyncio.create_task(self._feed(i, queue, checked), name=f"shoal-http-{stream.rid}")
            for i, stream in enumerate(self.streams)
        ]
        remaining = len(self.streams)
        while remaining:
            item = await queue.get()
            if isinstance(item, ApiError):
                raise item
            if isinstance(item, Finished):
                remaining -= 1
            yield item

    async def finished(self) -> list[Completion]:
        """Every choice's Completion, in order, each one finished (errors.check_finished)."""
        done: dict[int, Completion] = {}
        async for event in self.events(checked=True):
            if isinstance(event, Finished):
                done[event.index] = event.completion
        return [done[i] for i in range(len(self.streams))]

    async def _pump(self, index: int, checked: bool) -> AsyncIterator[Event]:
        stream, timer = self.streams[index], self.timers[index]
        try:
            async for delta in stream:
                timer.tokens(len(delta.token_ids))
                yield Streamed(index, delta)
            completion = await stream.result()
        except Exception as exc:
            raise self._failed(index, exc) from None
        timer.finish(completion)
        if checked:
            check_finished(completion, self.gateway.draining)
        yield Finished(index, completion)

    def _failed(self, index: int, exc: Exception) -> ApiError:
        error = from_engine(exc, self.names[index])
        self.timers[index].failed(counted=error.status >= 500)  # refused input: not counted
        return error

    async def _feed(
        self, index: int, queue: asyncio.Queue[Event | ApiError], checked: bool
    ) -> None:
        try:
            async for event in self._pump(index, checked):
                queue.put_nowait(event)
        except ApiError as exc:
            queue.put_nowait(exc)

    def abort(self) -> int:
        live = [stream for stream in self.streams if not stream.ended]
        for stream in live:
            stream.abort()
        return len(live)

    async def __aenter__(self) -> Job:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self.abort()
        for task in self.tasks:
            task.cancel()
        for stream, timer in zip(self.streams, self.timers, strict=True):
            if not timer.done:  # abandoned (client gone, failure): count it when it ends
                task = asyncio.get_running_loop().create_task(_record_late(stream, timer))
                self.gateway.late.add(task)
                task.add_done_callback(self.gateway.late.discard)
        if self.gateway.jobs.get(self.public_id) is self:
            del self.gateway.jobs[self.public_id]


async def _record_late(stream: RequestStream, timer: RequestTimer, timeout_s: float = 60.0) -> None:
    """An abandoned request's Completion still comes (its abort is in flight): record it."""
    try:
        completion = await asyncio.wait_for(stream.result(), timeout_s)
    except asyncio.CancelledError:
        timer.gone()
        raise
    except Exception:  # the engine died or never answered: it ended without a Completion
        timer.gone()
        return
    timer.finish(completion)
