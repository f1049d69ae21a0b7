"""Streaming sessions as the tokenizer actor keeps them (docs/architecture.md, "Sessions").

A session's history is the token sequence of every completed turn, inputs and outputs. A
turn appends new input to it; the KV of the history stays in the cache manager between turns
(keyed by session id), so only the new tokens are prefilled. Turns are serialized:

    idle ──turn──▶ measured ──admitted──▶ live (stream open) ──stream ends──▶ live (releasing)
                     │ refused, aborted: idle   │ a second turn: refused   a next turn waits ┘
                     └ a second turn: refused   └ abort / disconnect: the history rolls back to
                                                  the last completed turn     ──Released──▶ idle

"measured": the turn's prompt is being encoded on the tokenizer's worker thread (chat_turns.py)
from a snapshot of the session, which is reserved for it meanwhile.

Closing during a turn waits for the turn's release; an idle session past its timeout is reaped.
At most max_sessions are open, and at most max_sessions_per_client of one client's (the opener
names it: over HTTP the peer address), so one client cannot take every session.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import CacheMsg, CloseSession, EndSession, Generate, OpenSession
from shoal.actors.replies import answer, refuse
from shoal.actors.tokenizer.chat_turns import History, TurnEnd
from shoal.actors.tokenizer.encode import ChatHistory
from shoal.results import FinishReason, RequestError


@dataclass
class SessionState:
    session_id: str
    timeout_s: float
    max_tokens: int | None
    client: str | None = None  # who opened it; counted in SessionBook.per_client while open
    tokens: list[int] = field(default_factory=list)  # the history of completed turns
    chat: ChatHistory = field(default_factory=ChatHistory)  # the same as chat messages, but
    unfolded: TurnEnd | None = None  # the last completed turn, folded in by the next one
    turn: str | None = None  # the live turn's request id (reserved while it is measured)
    turn_prompt: list[int] = field(default_factory=list)  # the history plus the turn's input
    turn_gen: Generate | None = None
    stream_open: bool = False
    pending: tuple[list[int], TurnEnd] | None = None  # the history once the turn is released
    queued: deque[Generate] = field(default_factory=deque)
    closing: EndSession | None = None
    timer: asyncio.TimerHandle | None = None


def not_open(session_id: str) -> RequestError:
    return RequestError(f"session {session_id!r} is not open", "session_id", "session_not_found")


class SessionBook:
    """Every open session of the tokenizer actor, and the rules of their turns. Plain state:
    no template work happens here (a turn's prompt is measured on the worker thread,
    chat_turns.py); the tokenizer asks it at each step of a turn:

        state = book.decide(gen)            # at the front of the line: None if refused/queued
        history = book.reserve(state, gen)  # measured meanwhile: the session is busy
        book.started(state, gen, prompt)    # admitted
        book.withdrawn(state)               # or never started (refused, aborted)
        book.ended(...); book.released(rid) # its stream ended; its KV is handed back
    """

    def __init__(
        self,
        max_sessions: int,
        cache: Mailbox[CacheMsg],
        expire: Callable[[EndSession], None],
        max_sessions_per_client: int | None = None,
    ) -> None:
        self.max_sessions = max_sessions
        self.max_per_client = max_sessions_per_client or max_sessions
        # a client -> how many of states' sessions it opened (no entry at 0)
        self.per_client: dict[str, int] = {}
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

    def decide(self, gen: Generate) -> SessionState | None:
        """A turn at the front of the line: its session, free for it; or None: refused (its
        stream fails), or queued behind the session's last turn, still being released."""
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
            return state
        return None

    def reserve(self, state: SessionState, gen: Generate) -> History:
        """The turn's prompt is being measured: the session is busy (another turn is refused,
        a close waits, no timeout reaps it). The snapshot it is measured from."""
        state.turn, state.stream_open, state.turn_gen = gen.rid, True, gen
        if state.timer is not None:
            state.timer.cancel()
        return History(state.tokens, state.chat, state.unfolded, state.max_tokens)

    def started(
        self, state: SessionState, gen: Generate, ids: list[int], chat: ChatHistory
    ) -> None:
        """Admitted: its prompt is the history plus its input; the conversation folded
        forward by its measuring is the session's."""
        state.turn_prompt = ids
        state.chat, state.unfolded = chat, None
        self.turn_of[gen.rid] = state.session_id

    def withdrawn(self, state: SessionState) -> Generate | None:
        """The reserved turn never started (refused, aborted, failed): the session is free;
        the next turn to put at the front of the line, if one waited."""
        state.turn, state.stream_open, state.turn_gen = None, False, None
        return self._free(state)

    def ended(
        self, state: SessionState, reply: str, output_ids: list[int], reason: FinishReason
    ) -> None:
        """The turn's stream ended: a completed turn becomes history once released."""
        state.stream_open = False
        gen = state.turn_gen
        if reason in ("stop", "length") and gen is not None:
            end = TurnEnd(gen.messages, reply, tuple(output_ids))
            state.pending = (state.turn_prompt + output_ids, end)

    def released(self, rid: str) -> Generate | None:
        """The turn's KV is handed back: the session is free; the next turn to put at the
        front of the line, if one waited for this release."""
        sid = self.turn_of.pop(rid, None)
        state = self.states.get(sid) if sid is not None else None
        if state is None:
            return None
        if state.pending is not None:
            state.tokens, state.unfolded = state.pending
        state.turn, state.pending, state.turn_gen = None, None, None
        return self._free(state)

    def _free(self, state: SessionState) -> Generate | None:
        if state.closing is not None:
            self.close(state)
        elif state.queued:
            return state.queued.popleft()
        else:
            self.arm_timer(state)
        return None

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
