"""POST /generate, SGLang's native generation route (see http_native_protocol for the shape).

One prompt answers one object (or, with "stream": true, SSE events carrying the text and
output ids so far, or only what is new with incremental_streaming_output, the last with its
finish_reason, then `data: [DONE]`: native_answers.py); a batch of prompts
answers a list, in order. The engine request id is the caller's `rid` when given, so
`/abort_request {"rid": ...}` reaches it. With `session_params` the one prompt is the new
input of an open session's next turn (see http_sessions).

`sampling_params.n` > 1 (at most --max-n, as the OpenAI routes' n) makes each prompt n
samples, answered as a list prompt-major ([p0 s0, p0 s1, ..., p1 s0, ...]), as SGLang orders
them; sample i is its own engine request `<rid>-<i>` (the prefix cache shares the prompt),
seeded seed + i when a seed is given (openai_params.for_choice), so the samples differ yet
are reproducible. A batch's sampling_params must all give the same n; n > 1 does not stream,
as a batch does not.
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from shoal.api.http.body import decode_body, json_response
from shoal.api.http.errors import FieldNames, bad_request
from shoal.api.http.gateway import Gateway
from shoal.api.http.limits import check_count, check_id
from shoal.api.http.native_answers import StreamChunks, Wanted, whole
from shoal.api.http.native_protocol import (
    GenerateRequest,
    NativeSampling,
)
from shoal.api.http.openai_params import for_choice
from shoal.api.http.relay import stream_sse
from shoal.api.http.sessions import session_turn
from shoal.api.http.submission import Choice, PromptInput, Submission
from shoal.api.sampling_wire import (
    BESIDE_SAMPLING,
    DEFAULT_SAMPLING,
    IN_SAMPLING,
    LOGPROBS,
    ROUTED_EXPERTS,
    sampling_from,
    wire_names,
    wire_values,
)
from shoal.params import RoomLeft

BESIDE_NAMES = wire_names("native", fields=BESIDE_SAMPLING)  # beside sampling_params
NAMES = FieldNames(
    session="session_params.id",
    sampling={**wire_names("native", "sampling_params.", IN_SAMPLING), **BESIDE_NAMES},
)


class NativeRoutes:
    def __init__(
        self, gateway: Gateway, incremental_streaming_output: bool = False, max_n: int = 16
    ) -> None:
        self.gateway = gateway
        self.incremental = incremental_streaming_output  # stream events carry only what is new
        self.max_n = max_n  # sampling_params.n: the OpenAI routes' limit (ServerOptions.max_n)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrived_at = time.monotonic()
        body = await decode_body(request, GenerateRequest)
        self._check_sizes(body)
        if (body.text is None) == (body.input_ids is None):
            raise bad_request("give exactly one of text or input_ids", "text")
        batch = isinstance(body.text, list) or _nested(body.input_ids)
        n = self._n(body)
        session_id = self._turn(body, batch, n)  # its session checks it against the history
        prompts = self._prompts(body)
        rids = self._rids(body, len(prompts), batch)
        settings = self._settings(body, len(prompts))
        choices = [
            self._choice(body, rid, prompt, native, session_id is not None)
            for prompt, rid, native in zip(prompts, rids, settings, strict=True)
        ]
        if n > 1:  # prompt-major, as SGLang answers
            choices = [_sample(choice, i) for choice in choices for i in range(n)]
        if body.stream and (batch or n > 1):
            message = "stream is supported for one prompt and one sample (n 1), not a batch"
            raise bad_request(message, "stream")
        public_id = rids[0] if not batch else f"batch-{uuid.uuid4().hex}"
        submission = Submission(public_id, choices, arrived_at, NAMES, session_id, rooms=body)
        async with self.gateway.submit(submission) as job:
            if body.stream:
                [num_prompt] = await job.accepted()  # refused: a 4xx, not a stream
                # weight_version: fixed while the request is held (docs/architecture.md, law 2)
                version = self.gateway.engine.weight_version
                wanted = _wanted(body)
                chunks = StreamChunks(
                    rids[0], num_prompt, version, arrived_at, wanted, self.incremental
                )
                return await stream_sse(request, job, chunks)
            completions = await job.finished()
        wanted = _wanted(body)
        answers = [whole(c, arrived_at, wanted) for c in completions]
        return json_response(answers if batch or n > 1 else answers[0])

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
            stops = wire_values(native, "native", ("stop", "stop_token_ids", "stop_regex"))
            regex = stops.get("stop_regex")
            gateway.check_stops(stops.get("stop"), stops.get("stop_token_ids"), where, regex)
        texts = [body.text] if isinstance(body.text, str) else body.text or []
        for i, text in enumerate(texts):
            name = "text" if isinstance(body.text, str) else f"text[{i}]"
            gateway.check_prompt_size(text, None, name)

    def _prompts(self, body: GenerateRequest) -> list[PromptInput]:
        """The body's prompts as given: the engine encodes and measures them."""
        if isinstance(body.text, str):
            if not body.text:
                raise bad_request("text must not be empty", "text")
            return [PromptInput(name="text", text=body.text)]
        if body.text is not None:
            if not body.text:
                raise bad_request("text must not be an empty list", "text")
            for i, text in enumerate(body.text):
                if not text:
                    raise bad_request(f"text[{i}] must not be empty", f"text[{i}]")
            return [PromptInput(name=f"text[{i}]", text=t) for i, t in enumerate(body.text)]
        ids = body.input_ids or []
        flat = [t for t in ids if isinstance(t, int)]
        if len(flat) == len(ids):
            return [PromptInput(name="input_ids", input_ids=flat)]
        nested = [t for t in ids if isinstance(t, list)]
        if len(nested) != len(ids):
            raise bad_request("input_ids must be a list of ids or a list of id lists", "input_ids")
        return [PromptInput(name=f"input_ids[{i}]", input_ids=t) for i, t in enumerate(nested)]

    def _n(self, body: GenerateRequest) -> int:
        """Samples per prompt: sampling_params' n (every entry's the same), 1 by default."""
        given = body.sampling_params
        settings = [given] if isinstance(given, NativeSampling) else given or []
        counts = {1 if native.n is None else native.n for native in settings} or {1}
        if len(counts) > 1:
            message = f"sampling_params must all give the same n, got {sorted(counts)}"
            raise bad_request(message, "sampling_params.n")
        [n] = counts
        if not 1 <= n <= self.max_n:
            raise bad_request(f"n must be in [1, {self.max_n}], got {n}", "sampling_params.n")
        return n

    def _turn(self, body: GenerateRequest, batch: bool, n: int) -> str | None:
        """The session the one prompt is the next turn of, if any."""
        if body.session_params is None:
            return None
        if batch:
            raise bad_request("a session turn is one prompt, not a batch", "session_params")
        if n != 1:
            message = f"a session turn has one choice: n must be 1, got {n}"
            raise bad_request(message, "sampling_params.n")
        if isinstance(body.text, str) and not body.text:
            raise bad_request("text must not be empty", "text")
        if body.input_ids is not None and not body.input_ids:
            raise bad_request("input_ids must not be empty", "input_ids")
        return session_turn(body.session_params)

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

    def _choice(
        self,
        body: GenerateRequest,
        rid: str,
        prompt: PromptInput,
        native: NativeSampling,
        turn: bool,
    ) -> Choice:
        """The fields of sampling_params, and the logprob and routed experts fields beside it
        (sampling_wire.py).
        max_new_tokens not given: the declared default, capped at the room the prompt leaves
        (as SGLang's), sized where the engine measures it (RoomLeft); a session turn's: the
        declared default."""
        beside = wire_values(body, "native", BESIDE_SAMPLING)
        values = wire_values(native, "native", IN_SAMPLING) | beside
        if not values.get("logprobs"):  # SGLang's: the prompt's only with return_logprob
            values.pop("logprob_start_len", None)
            values.pop("token_ids_logprob", None)
        if native.sampling_seed is not None:
            values.setdefault("seed", native.sampling_seed)
        room = None
        if not turn and values.get("max_new_tokens") is None:
            room = RoomLeft(DEFAULT_SAMPLING.max_new_tokens)
        return Choice(rid, prompt, sampling_from(values), room)


def _sample(choice: Choice, index: int) -> Choice:
    """Sample `index` of a prompt's n: its own engine request, seeded seed + index."""
    sampling = for_choice(choice.sampling, index)
    return Choice(f"{choice.rid}-{index}", choice.prompt, sampling, choice.room)


def _wanted(body: GenerateRequest) -> Wanted:
    values = wire_values(body, "native", LOGPROBS)  # return_logprob, top_logprobs_num, ...
    listed = tuple(values.get("token_ids_logprob") or ())
    routed = wire_values(body, "native", ROUTED_EXPERTS)
    start = routed.get("routed_experts_start_len", 0) if routed.get("return_routed_experts") else 0
    return Wanted(bool(values.get("logprobs")), bool(values.get("top_logprobs")), listed, start)


def _nested(input_ids: list[int | list[int]] | None) -> bool:
    return bool(input_ids) and any(isinstance(t, list) for t in input_ids or ())
