"""Streaming sessions as the tokenizer actor keeps them (DESIGN.md, "Sessions").

A session's history is the token sequence of every completed turn, inputs and outputs. A
turn appends new input to it; the KV of the history stays in the cache manager between turns
(keyed by session id), so only the new tokens are prefilled. Turns are serialized:

    idle ──turn──▶ live (stream open) ──stream ends──▶ live (releasing) ──Released──▶ idle
                     │ a second turn: refused          │ a next turn waits here
                     └─ abort / disconnect: the history rolls back to the last completed turn

Closing during a turn waits for the turn's release; an idle session past its timeout is reaped.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shoal.actors.messages import EndSession, Generate


@dataclass
class SessionState:
    session_id: str
    timeout_s: float
    max_tokens: int | None
    tokens: list[int] = field(default_factory=list)  # the history of completed turns
    messages: list[dict[str, Any]] = field(default_factory=list)  # same, as chat messages
    closing_text: str = ""  # what the template adds after a reply that the model did not emit
    turn: str | None = None  # the live turn's request id, until its release
    turn_prompt: list[int] = field(default_factory=list)  # the history plus the turn's input
    turn_gen: Generate | None = None
    stream_open: bool = False
    pending: tuple[list[int], list[dict[str, Any]], str] | None = None  # history once released
    queued: deque[Generate] = field(default_factory=deque)
    closing: EndSession | None = None
    timer: asyncio.TimerHandle | None = None


def turn_input_ids(tokenizer: Any, state: SessionState, gen: Generate) -> list[int]:
    """The new tokens a turn appends to the history."""
    if gen.input_ids is not None:
        return list(gen.input_ids)
    if gen.text is not None:
        return list(tokenizer.encode(gen.text, add_special_tokens=not state.tokens))
    if not gen.messages:
        raise ValueError("a turn needs text, input_ids or messages")
    new = list(gen.messages)
    if not state.tokens:
        text = tokenizer.apply_chat_template(new, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    before = tokenizer.apply_chat_template(state.messages, tokenize=False)
    after = tokenizer.apply_chat_template(
        state.messages + new, add_generation_prompt=True, tokenize=False
    )
    if not state.messages or not after.startswith(before):
        raise ValueError(
            "this session's history cannot be extended with messages (its turns used text or "
            "input_ids, or the chat template is not incremental): send text or input_ids"
        )
    delta = state.closing_text + after[len(before) :]
    return list(tokenizer.encode(delta, add_special_tokens=False))


def completed_messages(
    tokenizer: Any, state: SessionState, gen: Generate, reply: str, output_ids: list[int]
) -> tuple[list[dict[str, Any]], str]:
    """The chat history after a messages turn, and the closing text the template expects
    after the reply beyond what the model emitted (e.g. the newline after an end-of-turn)."""
    if gen.messages is None:
        return [], ""
    history = state.messages + list(gen.messages)
    opened = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    history = [*history, {"role": "assistant", "content": reply}]
    closed = tokenizer.apply_chat_template(history, tokenize=False)
    suffix = closed[len(opened) + len(reply) :] if closed.startswith(opened + reply) else ""
    emitted = tokenizer.decode(output_ids, skip_special_tokens=False)
    emitted_tail = emitted[len(reply) :] if emitted.startswith(reply) else ""
    closing = suffix[len(emitted_tail) :] if suffix.startswith(emitted_tail) else suffix
    return history, closing
