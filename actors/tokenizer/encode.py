"""Prompts into token ids, and the checks every prompt passes before it is admitted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shoal.results import RequestError


def encode_prompt(
    tokenizer: Any,
    text: str | None,
    input_ids: Sequence[int] | None,
    messages: Sequence[dict[str, Any]] | None,
) -> list[int]:
    """Token ids of exactly one of text (special tokens added as the tokenizer does),
    input_ids (as given) or chat messages (the model's template, generation prompt on)."""
    if input_ids is not None:
        return list(input_ids)
    if messages is not None:
        if not messages:
            raise RequestError("messages must not be empty", "messages")
        rendered = render_chat(tokenizer, messages, add_generation_prompt=True)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    if text is not None:
        return list(tokenizer.encode(text))
    raise RequestError("one of prompt, input_ids or messages is required", "prompt")


def render_chat(
    tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False
) -> str:
    """The model's chat template applied to messages. A template that refuses them (its
    `raise_exception`, a missing key) is the caller's error, never the actor's."""
    try:
        rendered = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # jinja2 TemplateError and whatever a template may raise
        raise RequestError(
            f"messages could not be formatted by the chat template: {exc}",
            "messages",
            "invalid_messages",
        ) from None
    assert isinstance(rendered, str)
    return rendered


def check_prompt(
    ids: Sequence[int], max_new_tokens: int, vocab_size: int, context_length: int
) -> None:
    """RequestError naming the problem: empty, ids outside the vocabulary, or too long."""
    if not ids:
        raise RequestError("the prompt is empty", "prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"input_ids contain ids outside the vocabulary: {bad[:5]}", "prompt")
    if len(ids) + max_new_tokens > context_length:
        raise RequestError(
            f"prompt of {len(ids)} tokens plus max_new_tokens {max_new_tokens} exceeds the "
            f"context length {context_length}",
            "prompt" if len(ids) >= context_length else "max_new_tokens",
            "context_length_exceeded",
        )
