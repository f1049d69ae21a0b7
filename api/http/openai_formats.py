"""How one OpenAI request's engine events become response bodies and stream chunks.

A format is made per request and is stateful (text offsets for completions' logprobs):

    first(i)        the chunk that opens choice i (chat: the assistant role), or None
    delta(i, d)     the chunk carrying a Delta's text / logprobs, or None if it has neither
    finish(i, c)    the chunk that closes choice i with its finish_reason
    usage_chunk(u)  the `choices: []` chunk of stream_options.include_usage
    whole(cs, u)    the non-streamed response
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from shoal.api.http.openai_logprobs import TokenBytes, chat_logprobs, completion_logprobs
from shoal.api.http.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    TextCompletion,
    UsageInfo,
)
from shoal.results import Completion, Delta, TokenLogprob


class Format(Protocol):
    def first(self, index: int) -> msgspec.Struct | None: ...
    def delta(self, index: int, delta: Delta) -> msgspec.Struct | None: ...
    def finish(self, index: int, completion: Completion) -> msgspec.Struct: ...
    def usage_chunk(self, usage: UsageInfo) -> msgspec.Struct: ...
    def whole(self, completions: list[Completion], usage: UsageInfo) -> msgspec.Struct: ...


class ChatFormat:
    def __init__(
        self, rid: str, created: int, model: str, logprobs: tuple[bool, int], tokens: TokenBytes
    ) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.want_logprobs, self.top = logprobs
        self.tokens = tokens

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.rid, self.created, self.model, [choice])

    def first(self, index: int) -> ChatCompletionChunk:
        return self._chunk(ChatChunkChoice(index, ChatDelta(role="assistant", content="")))

    def delta(self, index: int, delta: Delta) -> ChatCompletionChunk | None:
        logprobs = self._logprobs(delta.logprobs)
        if not delta.text and logprobs is None:
            return None
        return self._chunk(ChatChunkChoice(index, ChatDelta(content=delta.text), logprobs))

    def finish(self, index: int, completion: Completion) -> ChatCompletionChunk:
        return self._chunk(ChatChunkChoice(index, ChatDelta(), None, completion.finish_reason))

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.rid, self.created, self.model, [], usage)

    def whole(self, completions: list[Completion], usage: UsageInfo) -> ChatCompletion:
        choices = [
            ChatChoice(
                i,
                AssistantMessage("assistant", c.text),
                self._logprobs(c.logprobs),
                c.finish_reason,
            )
            for i, c in enumerate(completions)
        ]
        return ChatCompletion(self.rid, self.created, self.model, choices, usage)

    def _logprobs(self, items: tuple[TokenLogprob, ...] | None) -> ChatLogprobs | None:
        if not self.want_logprobs or not items:
            return None
        return chat_logprobs(items, self.tokens, self.top)


class TextFormat:
    def __init__(
        self, rid: str, created: int, model: str, logprobs: tuple[bool, int], tokens: TokenBytes
    ) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.want_logprobs, self.top = logprobs
        self.tokens = tokens
        self.offsets: dict[int, int] = {}

    def _chunk(self, choice: CompletionChoice) -> TextCompletion:
        return TextCompletion(self.rid, self.created, self.model, [choice])

    def first(self, index: int) -> None:
        return None

    def delta(self, index: int, delta: Delta) -> TextCompletion | None:
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(delta.text)
        logprobs = None
        if self.want_logprobs and delta.logprobs:
            logprobs = completion_logprobs(delta.logprobs, self.tokens, self.top, offset)
        if not delta.text and logprobs is None:
            return None
        return self._chunk(CompletionChoice(index, delta.text, logprobs))

    def finish(self, index: int, completion: Completion) -> TextCompletion:
        return self._chunk(CompletionChoice(index, "", None, completion.finish_reason))

    def usage_chunk(self, usage: UsageInfo) -> TextCompletion:
        return TextCompletion(self.rid, self.created, self.model, [], usage)

    def whole(self, completions: list[Completion], usage: UsageInfo) -> TextCompletion:
        choices = []
        for i, c in enumerate(completions):
            logprobs = None
            if self.want_logprobs and c.logprobs:
                logprobs = completion_logprobs(c.logprobs, self.tokens, self.top, 0)
            choices.append(CompletionChoice(i, c.text, logprobs, c.finish_reason))
        return TextCompletion(self.rid, self.created, self.model, choices, usage)
