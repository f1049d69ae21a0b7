"""From an OpenAI request body to engine inputs: messages, prompts, choices.

Everything here raises ApiError 400 naming the OpenAI field; nothing touches the engine. The
prompts go to the engine as given (its tokenizer actor encodes and measures them); the
sampling values are validated once, by Engine.generate; a refused one is named as the body
did (OpenAISampling.names).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from shoal.api.http.door_rules import CHAT, COMPLETIONS, STREAM_OPTIONS
from shoal.api.http.errors import ApiError, FieldNames, bad_request
from shoal.api.http.field_rules import TOOLS, refuse
from shoal.api.http.gateway import Gateway
from shoal.api.http.limits import check_count, check_id
from shoal.api.http.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIFields,
    ToolCall,
)
from shoal.api.http.response_format import response_format_grammar
from shoal.api.http.submission import Choice, PromptInput
from shoal.api.http.vllm_guided import vllm_constraints
from shoal.api.sampling_wire import sampling_from, wire_names, wire_values
from shoal.params import GRAMMAR_KINDS, MAX_TOP_LOGPROBS, RoomLeft, SamplingParams

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
SEED_LIMIT = 2**63


def check_model(requested: str | None, names: Sequence[str]) -> str:
    """The served name to answer with; 404 model_not_found for any other name."""
    if requested is None or requested in names:
        return names[0]
    raise ApiError(
        404,
        f"the model {requested!r} does not exist: this server serves {names[0]!r}",
        param="model",
        code="model_not_found",
    )


def check_n(n: int | None, max_n: int) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= max_n:
        raise bad_request(f"n must be in [1, {max_n}], got {n}", "n")
    return n


def check_sizes(gateway: Gateway, body: OpenAIFields) -> None:
    """Every counted dimension of the body, before anything reads or encodes it: 400 naming
    the field past its limit (docs/limits.md)."""
    limits = gateway.limits
    stops = wire_values(body, "chat", ("stop", "stop_token_ids", "stop_regex"))  # alike on both
    check_id(body.model, limits, "model")
    check_id(body.user, limits, "user")
    if body.session_params is not None:
        check_id(body.session_params.id, limits, "session_params.id")
    gateway.check_stops(stops.get("stop"), stops.get("stop_token_ids"), "", stops.get("stop_regex"))


def refuse_unsupported(body: OpenAIFields) -> None:
    """400 naming the first field the body asks for that the door does not do (field_rules):
    after check_sizes, so a refused field is counted first."""
    chat = isinstance(body, ChatCompletionRequest)
    refuse(body, CHAT if chat else COMPLETIONS)
    if body.stream_options is not None:
        refuse(body.stream_options, STREAM_OPTIONS, "stream_options.")
    best_of = body.best_of if isinstance(body, CompletionRequest) else None
    if best_of is not None and best_of != (body.n or 1):
        raise bad_request("best_of other than n is not supported", "best_of")


def chat_messages(gateway: Gateway, messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them: role and plain-text content. Counted first
    (messages, content parts per message), then measured (characters), never encoded here."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    max_messages = gateway.input_limits.max_messages
    check_count(len(messages), max_messages, "messages", "max_messages")
    max_parts = gateway.limits.max_content_parts
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            where = f"messages[{i}].content"
            check_count(len(message.content), max_parts, where, "max_content_parts")
    out = []
    for i, message in enumerate(messages):
        if message.function_call:  # OpenAI's legacy functions
            where = f"messages[{i}].function_call"
            raise bad_request(f"{where} is not supported{TOOLS}", where)
        if message.role not in ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {sorted(ROLES)}, got {message.role!r}",
                f"messages[{i}].role",
            )
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}].content[{j}]: only text parts are supported, "
                        f"got type {part.type!r}",
                        f"messages[{i}].content[{j}]",
                    )
                texts.append(part.text)
            content = "".join(texts)
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if message.tool_calls:
            if message.role != "assistant":
                where = f"messages[{i}].tool_calls"
                raise bad_request(f"{where}: only an assistant message carries calls", where)
            entry["tool_calls"] = [
                template_call(f"messages[{i}].tool_calls[{j}]", call)
                for j, call in enumerate(message.tool_calls)
            ]
        if message.reasoning_content is not None:  # Qwen3's template renders it, others not
            entry["reasoning_content"] = message.reasoning_content
        if message.role == "tool":
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                entry["name"] = message.name
        out.append(entry)
    gateway.check_prompt_size(None, out, "messages")
    return out


def template_call(where: str, call: ToolCall) -> dict[str, Any]:
    """An assistant's call as chat templates read it: its arguments an object, not the JSON
    text OpenAI sends (as vLLM hands them to the template)."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        where = f"{where}.function.arguments"
        raise bad_request(f"{where} must be a JSON object as text", where)
    out: dict[str, Any] = {"type": "function"}
    if call.id is not None:
        out["id"] = call.id
    out["function"] = {"name": call.function.name, "arguments": arguments}
    return out


def prompts(gateway: Gateway, prompt: str | list[str | int | list[int]]) -> list[PromptInput]:
    """One prompt per string, list of token ids, or token-id list of a list: counted and
    measured in characters here (every string before any is read), encoded by the engine."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        gateway.check_prompt_size(prompt, None, "prompt")
        return [PromptInput(name="prompt", text=prompt)]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    ints = [p for p in prompt if isinstance(p, int)]
    if len(ints) == len(prompt):
        return [PromptInput(name="prompt", input_ids=ints)]
    check_count(len(prompt), gateway.limits.max_prompts, "prompt", "max_prompts")
    for i, p in enumerate(prompt):
        if isinstance(p, str) and p:
            gateway.check_prompt_size(p, None, f"prompt[{i}]")
    out = []
    for i, p in enumerate(prompt):
        name = f"prompt[{i}]"
        if isinstance(p, str) and isinstance(prompt[0], str):
            if not p:
                raise bad_request(f"{name} must not be empty", name)
            out.append(PromptInput(name=name, text=p))
        elif isinstance(p, list) and isinstance(prompt[0], list):
            out.append(PromptInput(name=name, input_ids=p))
        else:
            raise bad_request(
                "prompt must be a string, a list of strings, a list of token ids or a list of "
                "token-id lists (not a mix)",
                name,
            )
    return out


class OpenAISampling:
    """An OpenAI body's sampling fields in SamplingParams' terms (api/sampling_wire.py), the
    names they were sent by (to name a refused one), and the logprobs the answer reports."""

    def __init__(self, body: OpenAIFields) -> None:
        chat = isinstance(body, ChatCompletionRequest)
        door = "chat" if chat else "completions"
        self.values = wire_values(body, door)
        self.names = wire_names(door)
        if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
            self.values["max_new_tokens"] = body.max_completion_tokens  # the newer name wins
            self.names["max_new_tokens"] = "max_completion_tokens"
        if body.no_stop_trim is not None:  # SGLang's name; vLLM's, if given too, must agree
            given = self.values.setdefault("include_stop_str_in_output", body.no_stop_trim)
            if given != body.no_stop_trim:
                message = "no_stop_trim and include_stop_str_in_output disagree; give one"
                raise bad_request(message, "no_stop_trim")
            self.names["include_stop_str_in_output"] = "no_stop_trim"
        if chat and self.values.get("top_logprobs") and not self.values.get("logprobs"):
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        if not chat and "top_logprobs" in self.values:  # any completions logprobs asks for them
            self.values["logprobs"] = True
        grammar = response_format_grammar(body.response_format)
        if grammar is not None:
            self.constrain(*grammar, "response_format")
        for name, kind, source in vllm_constraints(body):
            self.constrain(kind, source, name)
        self.logprobs = (bool(self.values.get("logprobs")), self.values.get("top_logprobs", 0))
        self.echo = isinstance(body, CompletionRequest) and bool(body.echo)
        self.prompt_top = self._prompt_logprobs(body)
        if self.values.get("max_new_tokens") == 0 and not self.echo:  # 0: only to score
            name = self.names["max_new_tokens"]
            raise bad_request(f"{name} must be >= 1 (0 only with echo), got 0", name)

    def constrain(self, kind: str, source: str, name: str) -> None:
        """The output must match `source` (a grammar field's: a tool choice's schema, vLLM's
        constraints), asked by the body's field `name`: 400 when the body constrains it
        already."""
        given = [k for k in GRAMMAR_KINDS if self.values.get(k) is not None]
        if given:
            asked = self.names.get(given[0], given[0])
            raise bad_request(f"{name} and {asked} both constrain the output; give one", name)
        self.values[kind] = source
        self.names[kind] = name

    def _prompt_logprobs(self, body: OpenAIFields) -> int | None:
        """The prompt's logprobs the answer reports (vLLM's prompt_logprobs: its top k; None:
        not asked), asked of the engine from position 0 (also by echo with logprobs, which
        reports them with the completion's). Both take the most alternatives either wants."""
        top = body.prompt_logprobs
        if top is not None:
            if not 0 <= top <= MAX_TOP_LOGPROBS:
                message = f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}"
                raise bad_request(message, "prompt_logprobs")
            if body.stream:
                message = "prompt_logprobs is not available with stream (as vLLM answers)"
                raise bad_request(message, "prompt_logprobs")
            self.values["top_logprobs"] = max(top, self.values.get("top_logprobs", 0))
        if top is not None or (self.echo and self.logprobs[0]):
            self.values["logprob_start_len"] = 0
        return top

    @property
    def field_names(self) -> FieldNames:
        """The body's names of the engine's fields, for its refusals."""
        return FieldNames(session="session_params.id", sampling=self.names)

    def choices(
        self, rid: str, prompts: list[PromptInput], n: int, turn: bool = False
    ) -> list[Choice]:
        """n choices per prompt (choice i seeded seed + i), ids `rid-0`, `rid-1`, ... max_tokens
        not given: all the room the prompt leaves (RoomLeft), sized where the engine measures
        the prompt; a session turn's (`turn`): the declared default."""
        sampling = sampling_from(self.values)
        room = None if turn or "max_new_tokens" in self.values else RoomLeft()
        return [
            Choice(f"{rid}-{p * n + i}", prompt, for_choice(sampling, i), room)
            for p, prompt in enumerate(prompts)
            for i in range(n)
        ]


def for_choice(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice i of n samples with seed + i, so n seeded choices differ yet are reproducible."""
    if index == 0 or sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=(sampling.seed + index) % SEED_LIMIT)
