"""POST /generate, SGLang's native generation route (see http_native_protocol for the shape).

One prompt answers one object (or, with "stream": true, SSE events carrying the text and
output ids so far, or only what is new with incremental_streaming_output, the last with its
finish_reason, then `data: [DONE]`: native_answers.py); a batch of prompts
answers a list, in order. The engine request id is the caller's `rid` when given, so
`/abort_request {"rid": ...}` reaches it. With `session_params` the one prompt is the new
input of an open session's next turn (see http_sessions).
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from shoal.api.http.body import decode_body, json_response
from shoal.api.http.errors import ApiError, bad_request, unfinished
from shoal.api.http.gateway import Choice, Gateway, Job, SessionTurn
from shoal.api.http.limits import check_count, check_id
from shoal.api.http.native_answers import StreamChunks, Wanted, whole
from shoal.api.http.native_protocol import (
    GenerateRequest,
    NativeSampling,
)
from shoal.api.http.sessions import session_turn
from shoal.api.http.sse import open_sse
from shoal.api.sampling_wire import (
    DEFAULT_SAMPLING,
    LOGPROBS,
    NOT_LOGPROBS,
    sampling_from,
    wire_names,
    wire_values,
)
from shoal.params import SamplingParams
from shoal.results import Completion, Delta

LOGPROB_NAMES = wire_names("native", fields=LOGPROBS)  # beside sampling_params


class NativeRoutes:
    def __init__(self, gateway: Gateway, incremental_streaming_output: bool = False) -> None:
        self.gateway = gateway
        self.incremental = incremental_streaming_output  # stream events carry only what is new

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/generate", self.generate)]

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrived_at = time.monotonic()
        body = await decode_body(request, GenerateRequest)
        self._check_sizes(body)
        if (body.text is None) == (body.input_ids is None):
            raise bad_request("give exactly one of text or input_ids", "text")
        batch = isinstance(body.text, list) or _nested(body.input_ids)
        turn = self._turn(body, batch)
        if turn is None:
            prompts = await self._prompts(body)
        else:  # its session encodes it, and checks it against the whole history
            prompts = [("text" if turn.text is not None else "input_ids", None)]
        rids = self._rids(body, len(prompts), batch)
        settings = self._settings(body, len(prompts))
        choices: list[Choice] = []
        for (name, ids), rid, native in zip(prompts, rids, settings, strict=True):
            num_prompt = None if ids is None else len(ids)
            choices.append((ids or [], self._sampling(body, native, num_prompt, name), rid))
        if body.stream and batch:
            raise bad_request("stream is supported for one prompt, not a batch", "stream")
        public_id = rids[0] if not batch else f"batch-{uuid.uuid4().hex}"
        prompt_param = prompts[0][0].split("[")[0]
        names = {**wire_names("native", "sampling_params.", NOT_LOGPROBS), **LOGPROB_NAMES}
        submit = self.gateway.submit(
            public_id, choices, arrived_at, prompt_param, turn, names, rooms=body
        )
        async with submit as job:
            if body.stream:
                if turn is not None:
                    await job.started()  # a refused turn answers 404 / 409, not a stream
                return await self._stream(request, body, job, len(choices[0][0]), arrived_at)
            completions = await job.results()
        for completion in completions:
            self._check_finished(completion)
        wanted = _wanted(body)
        answers = [whole(c, arrived_at, wanted) for c in completions]
        return json_response(answers if batch else answers[0])

    async def _stream(
        self,
        request: web.Request,
        body: GenerateRequest,
        job: Job,
        num_prompt: int,
        arrived_at: float,
    ) -> web.StreamResponse:
        """Each event carries the text, output ids and logprobs so far, or with
        incremental_streaming_output only what is new (native_answers.py); the last event
        the finish_reason."""
        # weight_version: fixed while the request is held (docs/architecture.md, law 2)
        chunks = StreamChunks(
            job.streams[0].rid,
            num_prompt,
            self.gateway.engine.weight_version,
            arrived_at,
            _wanted(body),
            self.incremental,
        )
        async with open_sse(request) as sse:  # a client gone or cut: ends here, quietly
            try:
                async for _, event in job.events():
                    if isinstance(event, Delta):
                        await sse.event(chunks.delta(event))
                    else:
                        self._check_finished(event)
                        await sse.event(chunks.finish(event))
            except ApiError as exc:
                job.abort()
                await sse.error(exc)
            await sse.done()
        return sse.response

    # ---- request ---------------------------------------------------------------------------

    def _check_sizes(self, body: GenerateRequest) -> None:
        """Every counted dimension, before anything is read or encoded (docs/limits.md)."""
        gateway = self.gateway
        limits = gateway.limits
        for name in ("text", "rid", "sampling_params"):
            value = getattr(body, name)
            if isinstance(value, list):
                check_count(len(value), limits.max_prompts, name, "max_prompts")
        ids = body.input_ids
        if ids and isinstance(ids[0], list):
            check_count(len(ids), limits.max_prompts, "input_ids", "max_prompts")
        rids = [body.rid] if isinstance(body.rid, str) else body.rid or []
        for i, rid in enumerate(rids):
            check_id(rid, limits, "rid" if isinstance(body.rid, str) else f"rid[{i}]")
        if body.session_params is not None:
            check_id(body.session_params.id, limits, "session_params.id")
        given = body.sampling_params
        settings = [given] if isinstance(given, NativeSampling) else given or []
        one = isinstance(given, NativeSampling)
        for i, native in enumerate(settings):
            where = "sampling_params." if one else f"sampling_params[{i}]."
            stops = wire_values(native, "native", ("stop", "stop_token_ids"))
            gateway.check_stops(stops.get("stop"), stops.get("stop_token_ids"), where)
        texts = [body.text] if isinstance(body.text, str) else body.text or []
        for i, text in enumerate(texts):
            name = "text" if isinstance(body.text, str) else f"text[{i}]"
            gateway.check_prompt_size(text, None, name)

    async def _prompts(self, body: GenerateRequest) -> list[tuple[str, list[int] | None]]:
        gateway = self.gateway
        if isinstance(body.text, str):
            return [("text", await gateway.encode_text(body.text, "text"))]
        if body.text is not None:
            if not body.text:
                raise bad_request("text must not be an empty list", "text")
            return [
                (f"text[{i}]", await gateway.encode_text(t, f"text[{i}]"))
                for i, t in enumerate(body.text)
            ]
        ids = body.input_ids or []
        flat = [t for t in ids if isinstance(t, int)]
        if len(flat) == len(ids):
            return [("input_ids", gateway.check_ids(flat, "input_ids"))]
        nested = [t for t in ids if isinstance(t, list)]
        if len(nested) != len(ids):
            raise bad_request("input_ids must be a list of ids or a list of id lists", "input_ids")
        return [
            (f"input_ids[{i}]", gateway.check_ids(t, f"input_ids[{i}]"))
            for i, t in enumerate(nested)
        ]

    def _turn(self, body: GenerateRequest, batch: bool) -> SessionTurn | None:
        if body.session_params is None:
            return None
        if batch:
            raise bad_request("a session turn is one prompt, not a batch", "session_params")
        if isinstance(body.text, str):
            if not body.text:
                raise bad_request("text must not be empty", "text")
            return session_turn(body.session_params, text=body.text)
        flat = [t for t in body.input_ids or [] if isinstance(t, int)]
        ids = self.gateway.check_ids(flat, "input_ids")
        return session_turn(body.session_params, input_ids=ids)

    def _rids(self, body: GenerateRequest, count: int, batch: bool) -> list[str]:
        rid = body.rid
        if rid is None:
            return [f"gen-{uuid.uuid4().hex}" for _ in range(count)]
        rids = [rid] if isinstance(rid, str) else rid
        if isinstance(rid, str) and batch:
            raise bad_request("a batch needs a list of rids, one per prompt", "rid")
        if len(rids) != count or len(set(rids)) != count or not all(rids):
            raise bad_request(f"rid must give {count} distinct non-empty ids", "rid")
        return rids

    def _settings(self, body: GenerateRequest, count: int) -> list[NativeSampling]:
        given = body.sampling_params
        if given is None:
            return [NativeSampling()] * count
        if isinstance(given, NativeSampling):
            return [given] * count
        if len(given) != count:
            raise bad_request(f"sampling_params must give {count} entries", "sampling_params")
        return list(given)

    def _sampling(
        self,
        body: GenerateRequest,
        native: NativeSampling,
        num_prompt: int | None,
        prompt_param: str,
    ) -> SamplingParams:
        """The fields of sampling_params, and the logprob pair beside it (api/sampling_wire.py).
        max_new_tokens not given: the declared default, capped at the room a prompt of
        num_prompt tokens leaves (as SGLang); None (a session turn): the declared default."""
        values = wire_values(native, "native", NOT_LOGPROBS) | wire_values(body, "native", LOGPROBS)
        if native.sampling_seed is not None:
            values.setdefault("seed", native.sampling_seed)
        if num_prompt is not None:
            max_tokens = values.get("max_new_tokens")
            if max_tokens is None:
                room = max(1, self.gateway.context_length - num_prompt)
                max_tokens = min(DEFAULT_SAMPLING.max_new_tokens, room)
            field = "sampling_params.max_new_tokens"
            values["max_new_tokens"] = self.gateway.budget(
                num_prompt, max_tokens, field, prompt_param
            )
        return sampling_from(values)

    def _check_finished(self, completion: Completion) -> None:
        error = unfinished(completion, self.gateway.draining)
        if error is not None:
            raise error


def _wanted(body: GenerateRequest) -> Wanted:
    values = wire_values(body, "native", LOGPROBS)  # return_logprob, top_logprobs_num
    return Wanted(bool(values.get("logprobs")), bool(values.get("top_logprobs")))


def _nested(input_ids: list[int | list[int]] | None) -> bool:
    return bool(input_ids) and any(isinstance(t, list) for t in input_ids or ())
