"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Each generation handler validates everything before the engine sees it (400 naming the
field), submits n choices per prompt as separate engine requests through the gateway, and
answers one JSON body or an SSE stream that always ends `data: [DONE]`. A choice that ends
because the engine failed answers 500 (an error event when streaming); one cut short by the
server shutting down answers 503; one aborted through /abort_request has finish_reason
"abort". A chat request with `session_params` runs as an open session's next turn: its
messages are only the new ones (see http_sessions).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from aiohttp import web

from shoal.api.http.body import decode_body, json_response
from shoal.api.http.errors import ApiError, bad_request, unfinished
from shoal.api.http.gateway import Choice, Gateway, Job, SessionTurn
from shoal.api.http.openai_formats import ChatFormat, Format, TextFormat
from shoal.api.http.openai_logprobs import TokenBytes
from shoal.api.http.openai_params import (
    OpenAISampling,
    chat_messages,
    check_model,
    check_n,
    check_sizes,
    encode_prompts,
    for_choice,
    refuse_unsupported,
    usage,
)
from shoal.api.http.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIFields,
)
from shoal.api.http.sessions import session_turn
from shoal.api.http.sse import open_sse
from shoal.models.registry import family_of
from shoal.results import Completion, Delta


class OpenAIRoutes:
    def __init__(self, gateway: Gateway, model_names: Sequence[str], max_n: int) -> None:
        assert model_names, "serve at least one model name"
        self.gateway = gateway
        self.model_names = list(model_names)
        self.max_n = max_n
        self.tokens = TokenBytes(gateway.engine.tokenizer)
        self.created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
        ]

    async def models(self, request: web.Request) -> web.Response:
        engine = self.gateway.engine
        assert engine.loaded is not None
        root = self.model_names[0]  # not the local path: it would say where the cache is
        context = self.gateway.context_length
        config = engine.loaded.config
        family = family_of(config.model_type).name
        cards = [
            ModelCard(name, self.created, "shoal", root, context, family, config.sliding_window)
            for name in self.model_names
        ]
        return json_response(ModelList(cards))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        arrived_at = time.monotonic()
        body = await decode_body(request, ChatCompletionRequest)
        gateway = self.gateway
        check_sizes(gateway, body)
        model = check_model(body.model, self.model_names)
        refuse_unsupported(body)
        messages = chat_messages(gateway, body.messages)
        wire = OpenAISampling(body)
        turn, ids, num_prompt = None, [], None
        if body.session_params is None:
            ids = await gateway.encode_messages(messages)
            num_prompt = len(ids)
        else:  # its session encodes the turn and checks it against the whole history
            turn = session_turn(body.session_params, body.n or 1, messages=messages)
        sampling = wire.sampling(gateway, num_prompt, "messages")
        n = check_n(body.n, self.max_n)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        choices = [(ids, for_choice(sampling, i), f"{rid}-{i}") for i in range(n)]
        fmt = ChatFormat(rid, int(time.time()), model, wire.logprobs, self.tokens)
        return await self._answer(
            request, body, rid, choices, n, fmt, arrived_at, "messages", wire.names, turn
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrived_at = time.monotonic()
        body = await decode_body(request, CompletionRequest)
        check_sizes(self.gateway, body)
        model = check_model(body.model, self.model_names)
        refuse_unsupported(body)
        if body.session_params is not None:
            message = "session_params is supported on /v1/chat/completions and /generate"
            raise bad_request(message, "session_params")
        gateway = self.gateway
        prompts = await encode_prompts(gateway, body.prompt)
        wire = OpenAISampling(body)
        n = check_n(body.n, self.max_n)
        rid = f"cmpl-{uuid.uuid4().hex}"
        choices: list[Choice] = []
        for name, ids in prompts:
            sampling = wire.sampling(gateway, len(ids), name)
            choices += [
                (ids, for_choice(sampling, i), f"{rid}-{len(choices) + i}") for i in range(n)
            ]
        fmt = TextFormat(rid, int(time.time()), model, wire.logprobs, self.tokens)
        return await self._answer(
            request, body, rid, choices, n, fmt, arrived_at, "prompt", wire.names
        )

    # ---- answering ---------------------------------------------------------------------------

    async def _answer(
        self,
        request: web.Request,
        body: OpenAIFields,
        rid: str,
        choices: list[Choice],
        n: int,
        fmt: Format,
        arrived_at: float,
        prompt_param: str,
        names: dict[str, str],
        turn: SessionTurn | None = None,
    ) -> web.StreamResponse:
        submit = self.gateway.submit(rid, choices, arrived_at, prompt_param, turn, names, body)
        async with submit as job:
            if body.stream:
                if turn is not None:
                    await job.started()  # a refused turn answers 404 / 409, not a stream
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return await self._stream(request, job, fmt, n, include_usage)
            completions = await job.results()
            for completion in completions:
                self._check_finished(completion)
            return json_response(fmt.whole(completions, usage(completions, n)))

    async def _stream(
        self, request: web.Request, job: Job, fmt: Format, n: int, include_usage: bool
    ) -> web.StreamResponse:
        finished: dict[int, Completion] = {}
        async with open_sse(request) as sse:  # a client gone or cut: ends here, quietly
            try:
                for index in range(len(job.streams)):
                    first = fmt.first(index)
                    if first is not None:
                        await sse.event(first)
                async for index, event in job.events():
                    if isinstance(event, Delta):
                        chunk = fmt.delta(index, event)
                        if chunk is not None:
                            await sse.event(chunk)
                    else:
                        self._check_finished(event)
                        finished[index] = event
                        await sse.event(fmt.finish(index, event))
                if include_usage:
                    done = [finished[i] for i in range(len(job.streams))]
                    await sse.event(fmt.usage_chunk(usage(done, n)))
            except ApiError as exc:
                job.abort()
                await sse.error(exc)
            await sse.done()
        return sse.response

    def _check_finished(self, completion: Completion) -> None:
        error = unfinished(completion, self.gateway.draining)
        if error is not None:
            raise error
