"""Prompts into token ids, and the checks every prompt passes before it is admitted: the one
place a prompt is measured, for every door (docs/architecture.md, "In: a request enters").

    prompt = measure(tokenizer, gen, vocab_size, context_length)      # a request's prompt
    prompt = measure_turn(tokenizer, history, gen, ...)               # a session turn's
                                                                      # (chat_turns.py)

Pure functions over their arguments: the tokenizer actor runs them on its worker thread
(intake.py), never on the event loop. Every refusal is a RequestError naming the field as the
engine calls it ("prompt", "messages", "max_new_tokens"); its message leads with that name
(`named`), so each door says it in its own ("input_ids[1] is 300 tokens; ...").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from shoal.actors.messages import Generate
from shoal.loading.hf_tokenizer import HFTokenizer
from shoal.params import ChatTemplateArgs, RoomLeft, SamplingParams
from shoal.results import RequestError


class ChatHistory(msgspec.Struct, frozen=True):
    """A session's history as chat messages, for turns that send messages: the conversation
    so far (empty: the history is not a chat conversation) and the text the template expects
    after the last reply beyond what the model emitted (the newline after an end-of-turn)."""

    messages: tuple[dict[str, Any], ...] = ()
    closing_text: str = ""


class Prompt(msgspec.Struct, frozen=True):
    """A request's prompt, encoded and checked: its ids and the sampling it runs with
    (max_new_tokens sized to the room when the door left it so). A session turn's also carries
    the chat history its session keeps once the turn is admitted (chat_turns.py)."""

    ids: list[int]
    sampling: SamplingParams
    chat: ChatHistory | None = None


def measure(tokenizer: HFTokenizer, gen: Generate, vocab_size: int, context_length: int) -> Prompt:
    """A request's prompt as checked ids (its text, chat messages or input_ids), and its
    sampling sized: RequestError naming what is wrong."""
    ids = encode_prompt(tokenizer, gen.text, gen.input_ids, gen.messages, gen.template)
    sampling = checked(ids, gen.sampling, gen.room, vocab_size, context_length)
    return Prompt(ids, sampling)


def encode_prompt(
    tokenizer: HFTokenizer,
    text: str | None,
    input_ids: Sequence[int] | None,
    messages: Sequence[dict[str, Any]] | None,
    template: ChatTemplateArgs | None = None,
) -> list[int]:
    """Token ids of exactly one of text (special tokens added as the tokenizer does),
    input_ids (as given) or chat messages (the model's template, generation prompt on, with
    `template`'s tools and variables)."""
    if input_ids is not None:
        return list(input_ids)
    if messages is not None:
        if not messages:
            raise RequestError(" must not be empty", "messages", named=True)
        rendered = render_chat(tokenizer, messages, add_generation_prompt=True, template=template)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    if text is not None:
        return list(tokenizer.encode(text))
    raise RequestError("one of prompt, input_ids or messages is required", "prompt")


def render_chat(
    tokenizer: HFTokenizer,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = False,
    template: ChatTemplateArgs | None = None,
) -> str:
    """The model's chat template applied to messages (with `template`'s tools, if any, and
    its variables). A template that refuses them (its `raise_exception`, a missing key) is
    the caller's error, never the actor's."""
    extra: dict[str, Any] = {}
    if template is not None:
        extra = dict(template.kwargs)
        if template.tools:
            extra["tools"] = list(template.tools)
    try:
        rendered = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except Exception as exc:  # jinja2 TemplateError and whatever a template may raise
        raise RequestError(
            f" could not be formatted by the chat template: {exc}",
            "messages",
            "invalid_messages",
            named=True,
        ) from None
    assert isinstance(rendered, str)
    return rendered


def checked(
    ids: Sequence[int],
    sampling: SamplingParams,
    room: RoomLeft | None,
    vocab_size: int,
    context_length: int,
    num_checked: int = 0,
) -> SamplingParams:
    """The sampling this prompt runs with, once the prompt is checked: not empty, no longer
    than the context leaves room for, inside the vocabulary (but its first `num_checked` ids,
    a session's history, checked before), logprob_start_len and (when asked)
    routed_experts_start_len inside it, and max_new_tokens within the room left; `room`:
    max_new_tokens was not given, and is sized here (RoomLeft). RequestError otherwise."""
    num_prompt = len(ids)
    if not num_prompt:
        raise RequestError(" must not be empty", "prompt", named=True)
    if num_prompt >= context_length:  # before reading them: a long list costs nothing
        raise RequestError(
            f" is {num_prompt} tokens; this model's context length is {context_length} "
            "tokens, which leaves no room to generate",
            "prompt",
            "context_length_exceeded",
            named=True,
        )
    bad = [t for t in ids[num_checked:] if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f" has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
            "prompt",
            named=True,
        )
    if sampling.logprob_start_len >= num_prompt:  # SGLang's rule: a prompt position
        raise RequestError(
            f" must be below the prompt's length {num_prompt} (or -1: no prompt logprobs), "
            f"got {sampling.logprob_start_len}",
            "logprob_start_len",
            named=True,
        )
    start = sampling.routed_experts_start_len
    if sampling.return_routed_experts and start > num_prompt:  # SGLang's: [0, prompt_tokens]
        raise RequestError(
            f" must be in [0, the prompt's length {num_prompt}], got {start}",
            "routed_experts_start_len",
            named=True,
        )
    left = context_length - num_prompt
    if room is None:
        if num_prompt + sampling.max_new_tokens > context_length:
            raise RequestError(
                f" {sampling.max_new_tokens} plus the prompt's {num_prompt} tokens exceeds the "
                f"context length {context_length}; ask for at most {left}",
                "max_new_tokens",
                "context_length_exceeded",
                named=True,
            )
        return sampling
    sized = left if room.at_most is None else min(room.at_most, left)
    if sampling.min_new_tokens > sized:  # SamplingParams.validate's rule, on the sized value
        raise RequestError(
            f" must be in [0, max_new_tokens], got {sampling.min_new_tokens!r}",
            "min_new_tokens",
            named=True,
        )
    return msgspec.structs.replace(sampling, max_new_tokens=sized)
