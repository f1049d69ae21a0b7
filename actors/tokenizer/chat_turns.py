"""A session turn's prompt: the new tokens it appends to its session's history, measured like
any prompt (encode.py), off the event loop (the tokenizer actor's worker thread, intake.py).

    prompt = measure_turn(tokenizer, history, gen, vocab_size, context_length)

A session keeps its history as tokens (every completed turn, inputs and outputs) and, while
its turns send chat messages, as a conversation (`ChatHistory`). A completed turn is kept
unfolded (`TurnEnd`: its messages, the reply, the ids the model emitted) until the next turn
folds it into the conversation here: the two renderings of the whole conversation that takes
happen on the worker thread, never on the loop when the turn ends.

The session snapshot a turn is measured from (`History`) is taken on the event loop when the
turn reaches the front of the line; its session is reserved for it meanwhile (sessions.py), so
nothing replaces the history under the worker.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.actors.messages import Generate
from shoal.actors.tokenizer.encode import ChatHistory, Prompt, checked, render_chat
from shoal.loading.hf_tokenizer import HFTokenizer
from shoal.results import RequestError


class TurnEnd(msgspec.Struct, frozen=True):
    """A completed turn, not yet folded into its session's conversation."""

    messages: tuple[dict[str, Any], ...] | None  # its new chat messages; None: text or ids
    reply: str
    output_ids: tuple[int, ...]


class History(msgspec.Struct, frozen=True):
    """What a turn's prompt is made from: its session as the turn found it."""

    tokens: list[int]  # every completed turn; the session replaces the list, never mutates it
    chat: ChatHistory
    unfolded: TurnEnd | None
    max_tokens: int | None  # the session's cap on its whole history


def measure_turn(
    tokenizer: HFTokenizer, history: History, gen: Generate, vocab_size: int, context_length: int
) -> Prompt:
    """The whole history plus this turn's input, checked (the history's own ids were checked
    by the turns that made them), with the conversation its session keeps if it is admitted."""
    chat = fold(tokenizer, history.chat, history.unfolded)
    new = turn_input_ids(tokenizer, bool(history.tokens), chat, gen)
    if not new:
        raise RequestError("the turn adds no tokens", "prompt")
    ids = history.tokens + new
    num_history = len(history.tokens)
    sampling = checked(ids, gen.sampling, gen.room, vocab_size, context_length, num_history)
    cap = history.max_tokens
    if cap is not None and len(ids) + sampling.max_new_tokens > cap:
        raise RequestError(
            f"the session would reach {len(ids) + sampling.max_new_tokens} tokens, "
            f"over its max_tokens {cap}",
            "max_new_tokens",
        )
    return Prompt(ids, sampling, chat)


def turn_input_ids(
    tokenizer: HFTokenizer, has_history: bool, chat: ChatHistory, gen: Generate
) -> list[int]:
    """The new tokens a turn appends to the history."""
    if gen.input_ids is not None:
        return list(gen.input_ids)
    if gen.text is not None:
        return list(tokenizer.encode(gen.text, add_special_tokens=not has_history))
    if not gen.messages:
        raise RequestError("a turn needs text, input_ids or messages", "prompt")
    new = list(gen.messages)
    if not has_history:
        text = render_chat(tokenizer, new, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    if not chat.messages:  # checked first: the template refuses an empty conversation
        raise RequestError(
            "this session's history cannot be extended with messages: it is not a chat "
            "conversation (a turn sent text or input_ids); send text or input_ids",
            "messages",
        )
    before = render_chat(tokenizer, chat.messages)
    after = render_chat(tokenizer, [*chat.messages, *new], add_generation_prompt=True)
    if not after.startswith(before):
        raise RequestError(
            "this session's history cannot be extended with messages: the chat template does "
            "not render the conversation incrementally; send text or input_ids",
            "messages",
        )
    delta = chat.closing_text + after[len(before) :]
    return list(tokenizer.encode(delta, add_special_tokens=False))


def fold(tokenizer: HFTokenizer, chat: ChatHistory, end: TurnEnd | None) -> ChatHistory:
    """The conversation with the last completed turn in it. A turn that sent text or ids ends
    the conversation (later turns send tokens), as does a reply the template refuses."""
    if end is None:
        return chat
    if end.messages is None:
        return ChatHistory()
    try:
        return completed(tokenizer, chat, end.messages, end.reply, list(end.output_ids))
    except RequestError:
        return ChatHistory()


def completed(
    tokenizer: HFTokenizer,
    chat: ChatHistory,
    messages: tuple[dict[str, Any], ...],
    reply: str,
    output_ids: list[int],
) -> ChatHistory:
    """The conversation after a messages turn, and the closing text the template expects
    after the reply beyond what the model emitted (e.g. the newline after an end-of-turn)."""
    history = [*chat.messages, *messages]
    opened = render_chat(tokenizer, history, add_generation_prompt=True)
    history = [*history, {"role": "assistant", "content": reply}]
    closed = render_chat(tokenizer, history)
    suffix = closed[len(opened) + len(reply) :] if closed.startswith(opened + reply) else ""
    emitted = tokenizer.decode(output_ids, skip_special_tokens=False)
    emitted_tail = emitted[len(reply) :] if emitted.startswith(reply) else ""
    closing = suffix[len(emitted_tail) :] if suffix.startswith(emitted_tail) else suffix
    return ChatHistory(tuple(history), closing)
