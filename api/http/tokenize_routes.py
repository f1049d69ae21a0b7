"""POST /tokenize and POST /detokenize: the served model's tokenizer, as SGLang and vLLM answer.

    POST /tokenize   {"prompt": "..." | ["...", ...], "add_special_tokens": true}   SGLang, vLLM
                     {"messages": [...], "add_generation_prompt": true}              vLLM's chat
      -> {"tokens": [..] | [[..], ..], "count": N | [N, ..], "max_model_len": context length}
    POST /detokenize {"tokens": [..] | [[..], ..], "skip_special_tokens": true}
      -> {"text": "..." | [...], "prompt": the same}   SGLang says "text", vLLM "prompt": both

One route answers both servers' bodies: where they differ they do not conflict (a list of
prompts is SGLang's, messages vLLM's; each answer carries both names). `model`, when given,
must be the served name (404 otherwise, as on the OpenAI routes). add_special_tokens defaults
to true for a prompt and false for messages (the chat template writes them), as vLLM's do.

Counted before anything is read, with generation's limits (docs/limits.md): prompts and token
lists per body (max_prompts), a prompt's characters and the messages (max_prompt_chars,
max_messages, max_content_parts); a token list longer than the context length is a 400, and so
is an id outside the model's vocabulary. Encoding, the chat template and decoding run on a
worker thread (asyncio.to_thread), never on the event loop, one body at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec
from aiohttp import web

from shoal.actors.tokenizer.encode import render_chat
from shoal.api.http.body import decode_body, json_response
from shoal.api.http.errors import FieldNames, bad_request, from_engine
from shoal.api.http.gateway import Gateway
from shoal.api.http.limits import check_count
from shoal.api.http.openai_params import chat_messages, check_model
from shoal.api.http.openai_protocol import ChatMessage
from shoal.loading.hf_tokenizer import HFTokenizer


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Exactly one of prompt (SGLang's and vLLM's) or messages (vLLM's chat form)."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool | None = None  # messages only; default true


class TokenizeResponse(msgspec.Struct):
    tokens: list[int | list[int]]  # a prompt's ids, or one list per prompt of a list
    count: int | list[int]
    max_model_len: int


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int | list[int]]  # ids, or a list of id lists
    skip_special_tokens: bool = True


class DetokenizeResponse(msgspec.Struct):
    text: str | list[str]  # SGLang's name
    prompt: str | list[str]  # vLLM's name for the same text


class TokenizeRoutes:
    def __init__(self, gateway: Gateway, model_names: Sequence[str]) -> None:
        assert gateway.engine.loaded is not None, "start the engine"
        self.gateway = gateway
        self.model_names = list(model_names)
        self.tokenizer: HFTokenizer = gateway.engine.tokenizer
        self.vocab_size = gateway.engine.loaded.config.vocab_size
        self.worker = asyncio.Semaphore(1)  # one body on the worker thread at a time

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await decode_body(request, TokenizeRequest)
        check_model(body.model, self.model_names)
        gateway = self.gateway
        context = gateway.context_length
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            messages = chat_messages(gateway, body.messages)  # counted and measured
            special = bool(body.add_special_tokens)
            generation = body.add_generation_prompt is not False
            ids = await self._run(self._encode_chat, messages, special, generation)
            return json_response(TokenizeResponse(list(ids), len(ids), context))
        if body.add_generation_prompt is not None:
            message = "add_generation_prompt applies to messages, not to a prompt"
            raise bad_request(message, "add_generation_prompt")
        special = body.add_special_tokens is not False
        if isinstance(body.prompt, str):
            gateway.check_prompt_size(body.prompt, None, "prompt")
            ids = await self._run(self._encode, [body.prompt], special)
            [one] = ids
            return json_response(TokenizeResponse(list(one), len(one), context))
        prompts = body.prompt or []
        check_count(len(prompts), gateway.limits.max_prompts, "prompt", "max_prompts")
        for i, text in enumerate(prompts):
            gateway.check_prompt_size(text, None, f"prompt[{i}]")
        lists = await self._run(self._encode, prompts, special)
        counts = [len(ids) for ids in lists]
        return json_response(TokenizeResponse(list(lists), counts, context))

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await decode_body(request, DetokenizeRequest)
        check_model(body.model, self.model_names)
        tokens = body.tokens
        nested = [t for t in tokens if isinstance(t, list)]
        if nested and len(nested) != len(tokens):
            raise bad_request("tokens must be a list of ids or a list of id lists", "tokens")
        if nested:
            check_count(len(nested), self.gateway.limits.max_prompts, "tokens", "max_prompts")
            lists = nested
        else:
            lists = [[t for t in tokens if isinstance(t, int)]]
        for i, ids in enumerate(lists):
            self._check_ids(ids, f"tokens[{i}]" if nested else "tokens")
        texts = await self._run(self._decode, lists, body.skip_special_tokens)
        text: str | list[str] = texts if nested else texts[0]
        return json_response(DetokenizeResponse(text, text))

    # ---- on the worker thread -------------------------------------------------------------

    async def _run(self, work: Any, *args: Any) -> Any:
        async with self.worker:
            try:
                return await asyncio.to_thread(work, *args)
            except Exception as exc:  # the chat template's refusal: a 400 naming messages
                raise from_engine(exc, FieldNames("messages")) from None

    def _encode(self, texts: list[str], special: bool) -> list[list[int]]:
        return [list(self.tokenizer.encode(text, add_special_tokens=special)) for text in texts]

    def _encode_chat(
        self, messages: list[dict[str, Any]], special: bool, generation: bool
    ) -> list[int]:
        rendered = render_chat(self.tokenizer, messages, add_generation_prompt=generation)
        return list(self.tokenizer.encode(rendered, add_special_tokens=special))

    def _decode(self, lists: list[list[int]], skip_special_tokens: bool) -> list[str]:
        decode = self.tokenizer.decode
        return [decode(ids, skip_special_tokens=skip_special_tokens) for ids in lists]

    def _check_ids(self, ids: list[int], param: str) -> None:
        """At most the context length (counted before read), each inside the vocabulary."""
        context = self.gateway.context_length
        if len(ids) > context:
            message = f"{param} has {len(ids)} ids, more than the context length {context}"
            raise bad_request(message, param, "array_above_max_length")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            message = f"{param} has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            raise bad_request(message, param)
