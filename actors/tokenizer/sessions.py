"""Streaming sessions as the tokenizer actor keeps them (docs/architecture.md, "Sessions").

A session's history is the token sequence of every completed turn, inputs and outputs. A
turn appends new input to it; the KV of the history stays in the cache manager between turns
(keyed by session id), so only the new tokens are prefilled. Turns are serialized:

    idle ──turn──▶ live (stream open) ──stream ends──▶ live (releasing) ──Released──▶ idle
                     │ a second turn: refused          │ a next turn waits here
                     └─ abort / disconnect: the history rolls back to the last completed turn

Closing during a turn waits for the turn's release; an idle session past its timeout is reaped.
At most max_sessions are open, and at most max_sessions_per_client of one client's (the opener
names it: over HTTP the peer address), so one client cannot take every session.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import CacheMsg, CloseSession, EndSession, Generate, OpenSession
from shoal.actors.replies import answer, refuse
from shoal.actors.tokenizer.encode import render_chat
from shoal.results import FinishReason, RequestError


@dataclass
class SessionState:
    session_id: str
    timeout_s: float
    max_tokens: int | None
    client: str | None = None  # who opened it; counted in SessionBook.per_client while open
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
        raise RequestError("a turn needs text, input_ids or messages", "prompt")
    new = list(gen.messages)
    if not state.tokens:
        text = render_chat(tokenizer, new, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    if not state.messages:  # checked first: the template refuses an empty conversation
        raise RequestError(
            "this session's history cannot be extended with messages: it is not a chat "
            "conversation (a turn sent text or input_ids); send text or input_ids",
            "messages",
        )
    before = render_chat(tokenizer, state.messages)
    after = render_chat(tokenizer, state.messages + new, add_generation_prompt=True)
    if not after.startswith(before):
        raise RequestError(
            "this session's history cannot be extended with messages: the chat template does "
            "not render the conversation incrementally; send text or input_ids",
            "messages",
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
    opened = render_chat(tokenizer, history, add_generation_prompt=True)
    history = [*history, {"role": "assistant", "content": reply}]
    closed = render_chat(tokenizer, history)
    suffix = closed[len(opened) + len(reply) :] if closed.startswith(opened + reply) else ""
    emitted = tokenizer.decode(output_ids, skip_special_tokens=False)
    emitted_tail = emitted[len(reply) :] if emitted.startswith(reply) else ""
    closing = suffix[len(emitted_tail) :] if suffix.startswith(emitted_tail) else suffix
    return history, closing


def not_open(session_id: str) -> RequestError:
    return RequestError(f"session {session_id!r} is not open", "session_id", "session_not_found")


class SessionBook:
    """Every open session of the tokenizer actor, and the rules of their turns."""

    def __init__(
        self,
        tokenizer: Any,
        max_sessions: int,
        validate: Callable[[list[int], int], None],
        admit: Callable[[Generate, SessionState], None],
        cache: Mailbox[CacheMsg],
        expire: Callable[[EndSession], None],
        max_sessions_per_client: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_sessions = max_sessions
        self.max_per_client = max_sessions_per_client or max_sessions
        # a client -> how many of states' sessions it opened (no entry at 0)
        self.per_client: dict[str, int] = {}
        self.validate = validate
        self.admit = admit
        self.cache = cache
        self.expire = expire
        self.states: dict[str, SessionState] = {}
        self.turn_of: dict[str, str] = {}  # a live turn's request id -> its session

    def open(self, msg: OpenSession) -> None:
        """Open the session, or refuse the reply with why not."""
        if msg.session_id in self.states:
            in_use = f"session {msg.session_id!r} is already open"
            refuse(msg.reply, RequestError(in_use, "session_id"))
            return
        if len(self.states) >= self.max_sessions:
            many = f"too many open sessions (the cap is {self.max_sessions})"
            refuse(msg.reply, RequestError(many, None, "too_many_sessions"))
            return
        held = self.per_client.get(msg.client, 0) if msg.client is not None else 0
        if held >= self.max_per_client:
            mine = (
                f"this client already holds {held} open sessions, the most one client may "
                "(max_sessions_per_client): close one first"
            )
            refuse(msg.reply, RequestError(mine, None, "too_many_sessions"))
            return
        state = SessionState(msg.session_id, msg.timeout_s, msg.max_tokens, msg.client)
        self.states[msg.session_id] = state
        if msg.client is not None:
            self.per_client[msg.client] = held + 1
        self.arm_timer(state)
        answer(msg.reply, None)

    def turn(self, gen: Generate) -> None:
        assert gen.session_id is not None
        state = self.states.get(gen.session_id)
        if state is None or state.closing is not None:
            gen.stream.fail(not_open(gen.session_id))
        elif state.turn is not None and state.stream_open:
            busy = f"session {gen.session_id!r} already has a turn in progress: one turn at a time"
            gen.stream.fail(RequestError(busy, "session_id", "session_busy"))
        elif state.turn is not None:
            state.queued.append(gen)  # the last turn ended; its KV is still being handed back
        else:
            self.admit(gen, state)

    def prompt(self, state: SessionState, gen: Generate) -> list[int]:
        """The whole history plus this turn's input, checked."""
        new = turn_input_ids(self.tokenizer, state, gen)
        if not new:
            raise RequestError("the turn adds no tokens", "prompt")
        ids = state.tokens + new
        self.validate(ids, gen.sampling.max_new_tokens)
        cap = state.max_tokens
        if cap is not None and len(ids) + gen.sampling.max_new_tokens > cap:
            raise RequestError(
                f"the session would reach {len(ids) + gen.sampling.max_new_tokens} tokens, "
                f"over its max_tokens {cap}",
                "max_new_tokens",
            )
        return ids

    def started(self, state: SessionState, gen: Generate, ids: list[int]) -> None:
        state.turn, state.stream_open = gen.rid, True
        state.turn_prompt, state.turn_gen = ids, gen
        self.turn_of[gen.rid] = state.session_id
        if state.timer is not None:
            state.timer.cancel()

    def ended(
        self, state: SessionState, reply: str, output_ids: list[int], reason: FinishReason
    ) -> None:
        """The turn's stream ended: a completed turn becomes history once released."""
        state.stream_open = False
        if reason in ("stop", "length") and state.turn_gen is not None:
            try:
                messages, closing = completed_messages(
                    self.tokenizer, state, state.turn_gen, reply, output_ids
                )
            except RequestError:  # the template refuses the reply: later turns send tokens
                messages, closing = [], ""
            state.pending = (state.turn_prompt + output_ids, messages, closing)

    def released(self, rid: str) -> None:
        sid = self.turn_of.pop(rid, None)
        state = self.states.get(sid) if sid is not None else None
        if state is None:
            return
        if state.pending is not None:
            state.tokens, state.messages, state.closing_text = state.pending
        state.turn, state.pending, state.turn_gen = None, None, None
        if state.closing is not None:
            self.close(state)
        elif state.queued:
            self.turn(state.queued.popleft())
        else:
            self.arm_timer(state)

    def end(self, msg: EndSession) -> None:
        state = self.states.get(msg.session_id)
        if state is None:
            if msg.reply is not None:
                refuse(msg.reply, not_open(msg.session_id))
            return
        if state.turn is None:
            self.close(state, msg)
        elif msg.reason != "timeout":  # a live turn is never reaped; close when it ends
            state.closing = msg

    def close(self, state: SessionState, msg: EndSession | None = None) -> None:
        msg = msg or state.closing
        del self.states[state.session_id]
        if state.client is not None:
            left = self.per_client.pop(state.client) - 1
            if left:
                self.per_client[state.client] = left
        if state.timer is not None:
            state.timer.cancel()
        for gen in state.queued:
            gen.stream.fail(not_open(state.session_id))
        self.cache.put(CloseSession(state.session_id))
        if msg is not None and msg.reply is not None:
            answer(msg.reply, None)

    def arm_timer(self, state: SessionState) -> None:
        loop = asyncio.get_running_loop()
        timeout = EndSession(state.session_id, "timeout")
        state.timer = loop.call_later(state.timeout_s, self.expire, timeout)

    def shutdown(self) -> None:
        for state in self.states.values():
            if state.timer is not None:
                state.timer.cancel()
