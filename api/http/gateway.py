"""The gateway between HTTP handlers and the engine, shared by the OpenAI and native routes.

    ids = await gateway.encode_messages(messages)        # or encode_text / check_ids
    max_new = gateway.budget(len(ids), body.max_tokens, "max_tokens", "messages")
    async with gateway.submit(public_id, [(ids, sampling, rid), ...], arrived_at) as job:
        async for index, event in job.events():          # Delta ... then Completion, per choice
            ...

Prompts are measured before they are encoded (characters, messages: the limits every door
shares, limits.py) and encoded on a worker thread, so a long prompt never stalls the event loop
that answers every other client.

It turns every problem into an ApiError (400 naming the field, 429 when saturated, 503 while
draining or when the engine is dead), keeps the table of open jobs (for /abort_request, the
429 cap and shutdown), and times each request for the metrics. The cap counts engine requests
that have not ended, not jobs: a handler still writing a finished answer to a slow client
holds no engine work (`num_open`). Leaving `async with job` in any
way — finished, an exception, the handler cancelled because the client went away — aborts
whatever is still running, so nothing a gone client asked for keeps holding rows or pages.

A request with a `SessionTurn` runs as that session's next turn; the session's refusals arrive
as its first event (unknown or closed session: 404, a turn in progress: 409), which a streaming
handler awaits with `job.started()` before it begins its response.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import msgspec

from shoal.actors.tokenizer.encode import encode_prompt
from shoal.api.engine import Engine
from shoal.api.http.bootstrap_fields import RoomFields, bootstraps
from shoal.api.http.errors import ApiError, bad_request, from_engine, refused
from shoal.api.http.limits import HttpLimits, api_error
from shoal.api.http.metrics import Metrics, RequestTimer
from shoal.api.sampling_wire import SAMPLING_FIELDS
from shoal.limits import LimitExceeded, check_prompt_size, check_stops
from shoal.params import SamplingParams
from shoal.results import Completion, Delta, RequestError, RequestStream

Event = tuple[int, Delta | Completion]
Choice = tuple[list[int], SamplingParams, str]  # prompt ids, sampling, engine rid
ErrorMap = Callable[[BaseException, str], ApiError]


class SessionTurn(msgspec.Struct, frozen=True, kw_only=True):
    """Run a request as a session's next turn: exactly one of text, input_ids or messages
    (only the new ones), appended to the session's history."""

    session_id: str
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None


class Gateway:
    def __init__(
        self,
        engine: Engine,
        metrics: Metrics,
        max_open_requests: int,
        limits: HttpLimits | None = None,
    ) -> None:
        assert engine.loaded is not None and engine.resolved is not None, "start the engine"
        self.engine = engine
        self.limits = limits or HttpLimits()
        self.input_limits = engine.limits  # the engine's own: stops, prompt chars, messages
        self.metrics = metrics
        self.max_open_requests = max_open_requests
        self.vocab_size = engine.loaded.config.vocab_size
        self.context_length = engine.resolved.context_length
        self.jobs: dict[str, Job] = {}
        self.draining = False
        self.late: set[asyncio.Task[None]] = set()  # awaiting the ends of abandoned requests

    @property
    def num_open(self) -> int:
        """Engine requests still running: what the 429 cap counts. A job whose requests have
        all ended holds nothing of the engine's, even while its handler still writes to a slow
        (or stuck) client, so it does not count; the write timeout ends that handler
        (api/http/stream_writer.py)."""
        return sum(not stream.ended for job in self.jobs.values() for stream in job.streams)

    # ---- prompts ---------------------------------------------------------------------------

    async def encode_messages(
        self, messages: list[dict[str, Any]], param: str = "messages"
    ) -> list[int]:
        """The tokenizer actor's own encoding of `messages=` (actors/tokenizer/encode.py), measured
        first and templated and encoded off the event loop."""
        self.check_prompt_size(None, messages, param)
        return await asyncio.to_thread(self._encode, None, messages, param)

    async def encode_text(self, text: str, param: str) -> list[int]:
        """The tokenizer actor's own encoding of `prompt=` (actors/tokenizer/encode.py),
        measured first and encoded off the event loop."""
        if not text:
            raise bad_request(f"{param} must not be empty", param)
        self.check_prompt_size(text, None, param)
        return await asyncio.to_thread(self._encode, text, None, param)

    def check_prompt_size(
        self, text: str | None, messages: list[dict[str, Any]] | None, param: str
    ) -> None:
        """400 for a prompt over max_prompt_chars or messages over max_messages (or their
        content over max_prompt_chars): counted, never encoded."""
        try:
            check_prompt_size(self.input_limits, text, messages, param)
        except LimitExceeded as exc:
            raise api_error(exc, param) from None

    def check_stops(
        self, stop: str | list[str] | None, stop_token_ids: list[int] | None, prefix: str = ""
    ) -> None:
        """400 for too many or too long stop strings, or too many stop ids, before anything
        else reads them (SamplingParams.validate checks the same, later). prefix: where the
        fields are ("sampling_params.")."""
        stops = [stop] if isinstance(stop, str) else stop or []
        try:
            check_stops(self.input_limits, stops, stop_token_ids or [])
        except LimitExceeded as exc:
            raise api_error(exc, prefix + exc.field) from None

    def _encode(
        self, text: str | None, messages: list[dict[str, Any]] | None, param: str
    ) -> list[int]:
        """On a worker thread: a fast tokenizer's encode releases the GIL, a chat template
        (jinja2) shares it in short slices."""
        try:
            ids = encode_prompt(self.engine.tokenizer, text, None, messages)
        except RequestError as exc:  # its message names "messages"; say the API's name
            message = str(exc)
            if exc.field == "messages":
                message = param + message.removeprefix("messages")
            raise refused(exc, param, message) from None
        return self.check_ids(ids, param)

    def check_ids(self, ids: Sequence[int], param: str) -> list[int]:
        if not ids:
            raise bad_request(f"{param} must not be empty", param)
        if len(ids) >= self.context_length:  # before reading them: a long list costs nothing
            self.budget(len(ids), None, param, param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"{param} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
                param,
            )
        return list(ids)

    def budget(self, num_prompt: int, max_tokens: int | None, field: str, prompt: str) -> int:
        """max_new_tokens for this prompt: max_tokens, or all the room left if None."""
        context = self.context_length
        if num_prompt >= context:
            raise bad_request(
                f"{prompt} is {num_prompt} tokens; this model's context length is {context} "
                "tokens, which leaves no room to generate",
                prompt,
                "context_length_exceeded",
            )
        if max_tokens is None:
            return context - num_prompt
        if max_tokens < 1:
            raise bad_request(f"{field} must be >= 1, got {max_tokens}", field)
        if num_prompt + max_tokens > context:
            raise bad_request(
                f"{field} {max_tokens} plus the prompt's {num_prompt} tokens exceeds the context "
                f"length {context}; ask for at most {context - num_prompt}",
                field,
                "context_length_exceeded",
            )
        return max_tokens

    def _refusal(self, exc: BaseException, prompt_param: str, names: Mapping[str, str]) -> ApiError:
        """What engine.generate raised, as an ApiError. A sampling field's refusal (Engine.generate
        validates each request once: SamplingParams.validate) names the field as the body sent
        it: `names` maps SamplingParams fields to the door's names."""
        if isinstance(exc, RequestError) and exc.field in SAMPLING_FIELDS:
            name = names.get(exc.field, exc.field)
            return refused(exc, name, name + str(exc).removeprefix(exc.field))
        return from_engine(exc, prompt_param)

    # ---- requests --------------------------------------------------------------------------

    def submit(
        self,
        public_id: str,
        choices: Sequence[Choice],
        arrived_at: float,
        prompt_param: str,
        turn: SessionTurn | None = None,
        names: Mapping[str, str] | None = None,
        rooms: RoomFields | None = None,
    ) -> Job:
        """Start each choice; `names`: the door's names of the sampling fields (refused);
        `rooms`: the body's disaggregation fields (api/http/bootstrap_fields.py)."""
        assert turn is None or len(choices) == 1, "a session turn is one request"
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        if public_id in self.jobs:
            raise bad_request(f"request id {public_id!r} is already in use", "rid")
        if len(choices) > self.max_open_requests:
            raise bad_request(
                f"this request asks for {len(choices)} generations (prompts x n); the server "
                f"holds at most {self.max_open_requests} at once",
                "n",
            )
        if self.num_open + len(choices) > self.max_open_requests:
            raise ApiError(
                429,
                f"the server is saturated ({self.num_open} requests open, at most "
                f"{self.max_open_requests}): retry later",
            )
        streams: list[RequestStream] = []
        disaggregated = self.engine.options.disaggregation_mode != "null"
        halves = bootstraps(rooms if disaggregated else None, len(choices))
        try:
            for (ids, sampling, rid), bootstrap in zip(choices, halves, strict=True):
                if turn is None:
                    stream = self.engine.generate(
                        input_ids=ids, sampling=sampling, rid=rid, bootstrap=bootstrap
                    )
                else:  # the turn's own input: the engine appends it to the history
                    stream = self.engine.generate(
                        turn.text,
                        input_ids=turn.input_ids,
                        messages=turn.messages,
                        sampling=sampling,
                        rid=rid,
                        session_id=turn.session_id,
                    )
                streams.append(stream)
        except Exception as exc:
            for stream in streams:
                stream.abort()
            raise self._refusal(exc, prompt_param, names or {}) from None
        errors = from_engine if turn is None else turn_error
        job = Job(self, public_id, streams, arrived_at, prompt_param, errors)
        self.jobs[public_id] = job
        return job

    def abort(self, rid: str) -> int:
        """Abort the job with this public id, or the one engine request with this rid."""
        job = self.jobs.get(rid)
        if job is not None:
            return job.abort()
        for job in self.jobs.values():
            for stream in job.streams:
                if stream.rid == rid and not stream.ended:
                    stream.abort()
                    return 1
        return 0

    def abort_all(self) -> int:
        return sum(job.abort() for job in list(self.jobs.values()))


class Job:
    """One HTTP request's engine requests (n choices, or a batch of prompts)."""

    def __init__(
        self,
        gateway: Gateway,
        public_id: str,
        streams: list[RequestStream],
        arrived_at: float,
        prompt_param: str,
        errors: ErrorMap = from_engine,
    ) -> None:
        self.gateway = gateway
        self.public_id = public_id
        self.streams = streams
        self.timers = [gateway.metrics.timer(arrived_at) for _ in streams]
        self.prompt_param = prompt_param
        self.tasks: list[asyncio.Task[None]] = []
        self.errors = errors
        self._first: tuple[AsyncIterator[Event], Event] | None = None  # see started()

    async def started(self) -> None:
        """Wait for a one-request job's first event, so a refusal raises its ApiError before
        a streamed response begins; events() then yields that event first."""
        assert len(self.streams) == 1 and self._first is None
        pump = self._pump(0)
        self._first = (pump, await anext(pump))

    async def events(self) -> AsyncIterator[Event]:
        """Every choice's Deltas then its Completion, interleaved as they come.

        Raises ApiError if a request fails (bad input found by the engine: 400; engine dead:
        503); the others are aborted when the job is left.
        """
        if len(self.streams) == 1:
            if self._first is None:
                pump = self._pump(0)
            else:
                pump, first = self._first
                yield first
            async for event in pump:
                yield event
            return
        queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self.tasks = [
            asyncio.create_task(self._feed(i, queue), name=f"shoal-http-{self.streams[i].rid}")
            for i in range(len(self.streams))
        ]
        remaining = len(self.streams)
        while remaining:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item[1], Completion):
                remaining -= 1
            yield item

    async def results(self) -> list[Completion]:
        done: dict[int, Completion] = {}
        async for index, event in self.events():
            if isinstance(event, Completion):
                done[index] = event
        return [done[i] for i in range(len(self.streams))]

    async def _pump(self, index: int) -> AsyncIterator[Event]:
        stream, timer = self.streams[index], self.timers[index]
        try:
            async for delta in stream:
                timer.tokens(len(delta.token_ids))
                yield index, delta
            completion = await stream.result()
        except Exception as exc:
            error = self.errors(exc, self.prompt_param)
            timer.failed(counted=error.status >= 500)  # input the engine refused: not counted
            raise error from None
        timer.finish(completion)
        yield index, completion

    async def _feed(self, index: int, queue: asyncio.Queue[Event | BaseException]) -> None:
        try:
            async for event in self._pump(index):
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


def turn_error(exc: BaseException, prompt_param: str) -> ApiError:
    """As for any request, the session named as the turn names it: not open (never opened,
    closed or reaped) 404, a turn already in progress 409 (http_errors.STATUS_OF)."""
    return from_engine(exc, prompt_param, "session_params.id")
