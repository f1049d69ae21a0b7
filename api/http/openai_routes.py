"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Each generation handler checks the body's fields (400 naming the field), turns it into one
Submission of n choices per prompt (separate engine requests) for the gateway, and answers one
JSON body or an SSE stream that always ends `data: [DONE]` (relay.py). The engine encodes and
measures the prompts; a refusal answers 400 before a stream opens. A choice that ends
because the engine failed answers 500 (an error event when streaming); one cut short by the
server shutting down answers 503; one aborted through /abort_request has finish_reason
"abort". A chat request with `session_params` runs as an open session's next turn: its
messages are only the new ones (see http_sessions).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence

from aiohttp import web

from shoal.api.http.body import decode_body, json_response
from shoal.api.http.chat_tools import tool_plan
from shoal.api.http.errors import bad_request
from shoal.api.http.gateway import Gateway
from shoal.api.http.openai_formats import Answer, ChatFormat, Format, TextFormat
from shoal.api.http.openai_logprobs import TokenBytes
from shoal.api.http.openai_params import (
    OpenAISampling,
    chat_messages,
    check_model,
    check_n,
    check_sizes,
    prompts,
    refuse_unsupported,
)
from shoal.api.http.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIFields,
)
from shoal.api.http.reasoning import PARSERS as REASONING
from shoal.api.http.relay import stream_sse
from shoal.api.http.sessions import session_turn
from shoal.api.http.submission import PromptInput, Submission
from shoal.api.http.tool_parsers import parser_for_template
from shoal.models.registry import family_of
from shoal.params import ChatTemplateArgs
from shoal.results import RequestError


class OpenAIRoutes:
    def __init__(
        self,
        gateway: Gateway,
        model_names: Sequence[str],
        max_n: int,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        """`tool_call_parser`: the format of tool calls for tool_choice auto (None: the one
        the chat template shows, if any); `reasoning_parser`: a <think> block's split."""
        assert model_names, "serve at least one model name"
        self.gateway = gateway
        self.model_names = list(model_names)
        self.max_n = max_n
        self.tokens = TokenBytes(gateway.engine.tokenizer)
        self.created = int(time.time())
        template = getattr(gateway.engine.tokenizer, "chat_template", None)
        shown = parser_for_template(template if isinstance(template, str) else None)
        self.tool_parser = tool_call_parser or shown
        self.reasoning = None if reasoning_parser is None else REASONING[reasoning_parser]

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
        plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_parser)
        if plan is not None and plan.schema is not None:
            wire.constrain("json_schema", plan.schema, "tool_choice")
        template = None
        if plan is not None or body.chat_template_kwargs:
            tools = () if plan is None else plan.tools
            template = ChatTemplateArgs(tools, dict(body.chat_template_kwargs or {}))
            try:
                template.check()
            except RequestError as exc:  # named here: the engine's names know no such field
                raise bad_request(str(exc), "chat_template_kwargs") from None
        prompt = PromptInput(name="messages", messages=messages, template=template)
        session_id = None
        if body.session_params is not None:  # its session checks it against the history
            if template is not None:
                name = "tools" if body.tools else "chat_template_kwargs"
                raise bad_request(f"{name} is not supported with session_params yet", name)
            session_id = session_turn(body.session_params, body.n or 1)
        n = check_n(body.n, self.max_n)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        choices = wire.choices(rid, [prompt], n, turn=session_id is not None)
        submission = Submission(rid, choices, arrived_at, wire.field_names, session_id, body)
        fmt = ChatFormat(self._answer_of(rid, model, wire, n, body), plan, self.reasoning)
        return await self._answer(request, bool(body.stream), submission, fmt)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrived_at = time.monotonic()
        body = await decode_body(request, CompletionRequest)
        check_sizes(self.gateway, body)
        model = check_model(body.model, self.model_names)
        refuse_unsupported(body)
        if body.session_params is not None:
            message = "session_params is supported on /v1/chat/completions and /generate"
            raise bad_request(message, "session_params")
        given = prompts(self.gateway, body.prompt)
        wire = OpenAISampling(body)
        n = check_n(body.n, self.max_n)
        rid = f"cmpl-{uuid.uuid4().hex}"
        choices = wire.choices(rid, given, n)
        submission = Submission(rid, choices, arrived_at, wire.field_names, rooms=body)
        answer = self._answer_of(rid, model, wire, n, body)
        if wire.echo:  # each prompt's text as given (ids: decoded)
            echo = tuple(self._text_of(prompt) for prompt in given)
            answer = dataclasses.replace(answer, echo=echo)
        fmt = TextFormat(answer)
        return await self._answer(request, bool(body.stream), submission, fmt)

    # ---- answering ---------------------------------------------------------------------------

    def _answer_of(
        self, rid: str, model: str, wire: OpenAISampling, n: int, body: OpenAIFields
    ) -> Answer:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Answer(
            rid,
            int(time.time()),
            model,
            wire.logprobs,
            self.tokens,
            n,
            include_usage,
            prompt_top=wire.prompt_top,
        )

    def _text_of(self, prompt: PromptInput) -> str:
        if prompt.text is not None:
            return prompt.text
        return str(self.gateway.engine.tokenizer.decode(list(prompt.input_ids or ())))

    async def _answer(
        self, request: web.Request, stream: bool, submission: Submission, fmt: Format
    ) -> web.StreamResponse:
        async with self.gateway.submit(submission) as job:
            if stream:
                await job.accepted()  # a refused prompt or turn answers 4xx, not a stream
                return await stream_sse(request, job, fmt)
            return json_response(fmt.whole(await job.finished()))
