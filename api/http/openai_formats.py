"""How one OpenAI request's engine events become response bodies and stream chunks.

A format is made per request and is stateful (text offsets for completions' logprobs); it is
a StreamFormat (api/http/relay.py):

    first(i)        the chunk that opens choice i (chat: the assistant role), or None
    delta(i, d)     the chunk carrying a Delta's text / logprobs, or None if it has neither
    finish(i, c)    the chunk that closes choice i with its finish_reason
    last(cs)        the `choices: []` chunk of stream_options.include_usage, or None
    whole(cs)       the non-streamed response
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from shoal.api.http.chat_text import ChoiceText, whole_message
from shoal.api.http.chat_tools import ToolPlan
from shoal.api.http.openai_logprobs import (
    TokenBytes,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    vllm_prompt_logprobs,
)
from shoal.api.http.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    PromptTokensDetails,
    TextCompletion,
    UsageInfo,
)
from shoal.api.http.reasoning import ReasoningParser
from shoal.results import Completion, Delta, PromptLogprobs, TokenLogprob


@dataclass(frozen=True)
class Answer:
    """What every chunk and body of one OpenAI answer says the same: its id, creation time,
    model name, the logprobs asked for (whether, how many alternatives), the choices per
    prompt, whether a stream ends with the usage chunk; completions' echo (each prompt's text,
    choice i's prompt i // n) and vLLM's prompt_logprobs (how many alternatives)."""

    rid: str
    created: int
    model: str
    logprobs: tuple[bool, int]
    tokens: TokenBytes
    n: int
    include_usage: bool
    echo: tuple[str, ...] | None = None
    prompt_top: int | None = None


class Format(Protocol):
    def first(self, index: int) -> msgspec.Struct | None: ...
    def delta(self, index: int, delta: Delta) -> msgspec.Struct | None: ...
    def finish(self, index: int, completion: Completion) -> msgspec.Struct: ...
    def last(self, completions: list[Completion]) -> msgspec.Struct | None: ...
    def whole(self, completions: list[Completion]) -> msgspec.Struct: ...


def usage(completions: Sequence[Completion], n: int) -> UsageInfo:
    """Prompt tokens once per prompt (n choices share it), completion tokens for all."""
    prompt = cached = generated = 0
    for start in range(0, len(completions), n):
        group = completions[start : start + n]
        prompt += group[0].usage.prompt_tokens
        cached += min(c.usage.cached_tokens for c in group)
        generated += sum(c.usage.completion_tokens for c in group)
    return UsageInfo(prompt, generated, prompt + generated, PromptTokensDetails(cached))


class ChatFormat:
    """`plan`: the request's tools (api/http/chat_tools.py), `reasoning`: the server's
    reasoning parser; with either, each choice's text is split into its parts
    (api/http/chat_text.py)."""

    def __init__(
        self,
        answer: Answer,
        plan: ToolPlan | None = None,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self.rid, self.created, self.model = answer.rid, answer.created, answer.model
        self.want_logprobs, self.top = answer.logprobs
        self.tokens = answer.tokens
        self.n, self.include_usage = answer.n, answer.include_usage
        self.prompt_top = answer.prompt_top
        self.plan, self.reasoning = plan, reasoning
        self.texts: dict[int, ChoiceText] = {}  # a streamed choice's parts so far

    def _text(self, index: int) -> ChoiceText:
        if index not in self.texts:
            self.texts[index] = ChoiceText(self.plan, self.reasoning)
        return self.texts[index]

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.rid, self.created, self.model, [choice])

    def first(self, index: int) -> ChatCompletionChunk:
        return self._chunk(ChatChunkChoice(index, ChatDelta(role="assistant", content="")))

    def delta(self, index: int, delta: Delta) -> ChatCompletionChunk | None:
        logprobs = self._logprobs(delta.logprobs)
        parts = self._text(index).feed(delta.text) if delta.text else None
        if parts is None and logprobs is None:
            return None
        return self._chunk(ChatChunkChoice(index, parts or ChatDelta(), logprobs))

    def finish(self, index: int, completion: Completion) -> ChatCompletionChunk:
        parts, finish = self._text(index).end(completion.finish_reason)
        return self._chunk(ChatChunkChoice(index, parts, None, finish))

    def last(self, completions: list[Completion]) -> ChatCompletionChunk | None:
        if not self.include_usage:
            return None
        total = usage(completions, self.n)
        return ChatCompletionChunk(self.rid, self.created, self.model, [], total)

    def whole(self, completions: list[Completion]) -> ChatCompletion:
        choices = []
        for i, c in enumerate(completions):
            message, finish = whole_message(c.text, c.finish_reason, self.plan, self.reasoning)
            choices.append(ChatChoice(i, message, self._logprobs(c.logprobs), finish))
        total = usage(completions, self.n)
        whole = ChatCompletion(self.rid, self.created, self.model, choices, total)
        if self.prompt_top is not None and completions:  # vLLM's: the one prompt's
            prompt = completions[0].prompt_logprobs
            whole.prompt_logprobs = vllm_prompt_logprobs(prompt, self.tokens, self.prompt_top)
        return whole

    def _logprobs(self, items: tuple[TokenLogprob, ...] | None) -> ChatLogprobs | None:
        if not self.want_logprobs or not items:
            return None
        return chat_logprobs(items, self.tokens, self.top)


class TextFormat:
    def __init__(self, answer: Answer) -> None:
        self.rid, self.created, self.model = answer.rid, answer.created, answer.model
        self.want_logprobs, self.top = answer.logprobs
        self.tokens = answer.tokens
        self.n, self.include_usage = answer.n, answer.include_usage
        self.echo, self.prompt_top = answer.echo, answer.prompt_top
        self.offsets: dict[int, int] = {}  # a choice's text streamed so far; absent: none yet

    def _chunk(self, choice: CompletionChoice) -> TextCompletion:
        return TextCompletion(self.rid, self.created, self.model, [choice])

    def first(self, index: int) -> None:
        return None

    def delta(self, index: int, delta: Delta) -> TextCompletion | None:
        if self.echo is not None and index not in self.offsets:  # the prompt first
            return self._echoed(index, delta.text, delta.logprobs, delta.prompt_logprobs)
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(delta.text)
        logprobs = None
        if self.want_logprobs and delta.logprobs:
            logprobs = completion_logprobs(delta.logprobs, self.tokens, self.top, offset)
        if not delta.text and logprobs is None:
            return None
        return self._chunk(CompletionChoice(index, delta.text, logprobs))

    def finish(self, index: int, completion: Completion) -> TextCompletion:
        if self.echo is not None and index not in self.offsets:  # no delta came (max_tokens 0)
            chunk = self._echoed(index, "", None, completion.prompt_logprobs)
            chunk.choices[0].finish_reason = completion.finish_reason
            return chunk
        return self._chunk(CompletionChoice(index, "", None, completion.finish_reason))

    def _echoed(
        self,
        index: int,
        text: str,
        logprobs: tuple[TokenLogprob, ...] | None,
        prompt: PromptLogprobs | None,
    ) -> TextCompletion:
        """Choice `index`'s first chunk with echo: its prompt, then what it generated so far."""
        assert self.echo is not None
        echoed = self.echo[index // self.n]
        self.offsets[index] = len(echoed) + len(text)
        out = None
        if self.want_logprobs:
            out = echo_logprobs(prompt, logprobs, self.tokens, self.top, len(echoed))
        return self._chunk(CompletionChoice(index, echoed + text, out))

    def last(self, completions: list[Completion]) -> TextCompletion | None:
        if not self.include_usage:
            return None
        total = usage(completions, self.n)
        return TextCompletion(self.rid, self.created, self.model, [], total)

    def whole(self, completions: list[Completion]) -> TextCompletion:
        choices = []
        for i, c in enumerate(completions):
            logprobs = None
            text = c.text
            if self.echo is not None:  # the prompt's text and tokens first
                echoed = self.echo[i // self.n]
                text = echoed + c.text
                if self.want_logprobs:
                    prompt = c.prompt_logprobs
                    logprobs = echo_logprobs(prompt, c.logprobs, self.tokens, self.top, len(echoed))
            elif self.want_logprobs and c.logprobs:
                logprobs = completion_logprobs(c.logprobs, self.tokens, self.top, 0)
            choice = CompletionChoice(i, text, logprobs, c.finish_reason)
            if self.prompt_top is not None:
                choice.prompt_logprobs = vllm_prompt_logprobs(
                    c.prompt_logprobs, self.tokens, self.prompt_top
                )
            choices.append(choice)
        total = usage(completions, self.n)
        return TextCompletion(self.rid, self.created, self.model, choices, total)
