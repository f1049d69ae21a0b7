"""The gateway between the doors and the engine: one call for every door.

    async with gateway.submit(submission) as job:        # api/http/submission.py, job.py
        ...

A door turns its body into a typed `Submission`; the gateway starts one engine request per
choice through Engine.generate (prompts as given: text, messages or ids, which the engine's
tokenizer actor encodes and measures off the event loop) and hands back the `Job` that
streams their events.

It turns every problem into an ApiError (400 naming the field as the door does, 429 when
saturated, 503 while draining or when the engine is dead), keeps the table of open jobs (for
/abort_request, the 429 cap and shutdown), and times each request for the metrics. The cap
counts engine requests that have not ended, not jobs: a handler still writing a finished
answer to a slow client holds no engine work (`num_open`).

The doors count, before anything reads them, what every door limits (a prompt's characters,
messages, stop strings: limits.py) through `check_prompt_size` and `check_stops`, so a body's
limits are answered first and named as the body names them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from shoal.api.engine import Engine
from shoal.api.http.bootstrap_fields import bootstraps
from shoal.api.http.errors import ApiError, bad_request, from_engine
from shoal.api.http.job import Job
from shoal.api.http.limits import HttpLimits, api_error
from shoal.api.http.metrics import Metrics
from shoal.api.http.submission import Choice, Submission
from shoal.limits import LimitExceeded, check_prompt_size, check_stops
from shoal.params import Bootstrap
from shoal.results import RequestStream


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

    # ---- counts every door makes before it reads ------------------------------------------

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
        self,
        stop: str | list[str] | None,
        stop_token_ids: list[int] | None,
        prefix: str = "",
        stop_regex: str | list[str] | None = None,
    ) -> None:
        """400 for too many or too long stop strings or stop_regex patterns, or too many stop
        ids, before anything else reads them (SamplingParams.validate checks the same, later).
        prefix: where the fields are ("sampling_params.")."""
        stops = [stop] if isinstance(stop, str) else stop or []
        patterns = [stop_regex] if isinstance(stop_regex, str) else stop_regex or []
        try:
            check_stops(self.input_limits, stops, stop_token_ids or [], patterns)
        except LimitExceeded as exc:
            raise api_error(exc, prefix + exc.field) from None

    # ---- requests --------------------------------------------------------------------------

    def submit(self, submission: Submission) -> Job:
        """Start each choice (Engine.generate validates its sampling: a refusal is the 400 of
        the choice's field as the door names it); the prompts' refusals come from the job."""
        choices = submission.choices
        assert submission.session_id is None or len(choices) == 1, "a turn is one request"
        public_id = submission.public_id
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
        disaggregated = self.engine.options.disaggregation_mode != "null"
        halves = bootstraps(submission.rooms if disaggregated else None, len(choices))
        names = [submission.names_of(choice) for choice in choices]
        streams: list[RequestStream] = []
        try:
            for choice, bootstrap in zip(choices, halves, strict=True):
                streams.append(self._start(choice, bootstrap, submission.session_id))
        except Exception as exc:
            for stream in streams:
                stream.abort()
            raise from_engine(exc, names[len(streams)]) from None
        job = Job(self, public_id, streams, submission.arrived_at, names)
        self.jobs[public_id] = job
        return job

    def _start(
        self, choice: Choice, bootstrap: Bootstrap | None, session_id: str | None
    ) -> RequestStream:
        prompt = choice.prompt
        room = {} if choice.room is None else {"max_new_tokens": choice.room}
        return self.engine.generate(
            prompt.text,
            input_ids=prompt.input_ids,
            messages=prompt.messages,
            chat_template=prompt.template,
            sampling=choice.sampling,
            rid=choice.rid,
            session_id=session_id,  # a turn: the engine appends its input to the history
            bootstrap=bootstrap,
            **room,
        )

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
