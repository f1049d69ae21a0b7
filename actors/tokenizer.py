"""The tokenizer actor: the front door and the back door of every request.

In: applies the chat template, encodes, validates against the context and vocabulary,
gives unseeded requests a seed, admits them to the scheduler. Out: detokenizes
incrementally, applies stop strings, feeds each caller's stream, and ends it with a reason.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from shoal.actors.detokenize import IncrementalDetokenizer
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import (
    Abort,
    Admit,
    Advance,
    CacheMsg,
    CloseSession,
    Deliver,
    EndSession,
    ExecutorMsg,
    FlushCache,
    FlushWhenIdle,
    Gate,
    Generate,
    LoadWeights,
    OpenSession,
    Output,
    Outputs,
    Park,
    Pause,
    Released,
    SchedulerMsg,
    SetPaused,
    Shutdown,
    Snapshot,
    TokenizerMsg,
    UpdateWeights,
    WriteDone,
)
from shoal.actors.sessions import SessionState, completed_messages, turn_input_ids
from shoal.actors.stops import StopMatcher
from shoal.actors.update_lock import UpdateLock
from shoal.api.stream import Completion, Delta, RequestStream, TokenLogprob, Usage


@dataclass
class Live:
    stream: RequestStream
    detok: IncrementalDetokenizer
    stops: StopMatcher
    num_prompt: int
    output_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    weight_version: int = 0
    session: SessionState | None = None


class Tokenizer:
    def __init__(
        self,
        tokenizer: Any,
        context_length: int,
        vocab_size: int,
        mailbox: Mailbox[TokenizerMsg],
        scheduler: Mailbox[SchedulerMsg],
        cache: Mailbox[CacheMsg],
        executor: Mailbox[ExecutorMsg],
        seed: int | None,
        max_sessions: int = 256,
    ) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.mailbox = mailbox
        self.scheduler = scheduler
        self.cache = cache
        self.executor = executor
        self.rng = random.Random(seed)
        self.live: dict[str, Live] = {}
        self.lock = UpdateLock()
        self.paused = False
        self.max_sessions = max_sessions
        self.sessions: dict[str, SessionState] = {}
        self.turn_of: dict[str, str] = {}  # live turn's request id -> its session
        self.writing: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while True:
            match await self.mailbox.get():
                case Generate() as gen:
                    if self.lock.writing:
                        self.lock.queued.append(gen)
                    else:
                        self.dispatch(gen)
                case Abort(rid=rid) as abort:
                    if rid in self.live:
                        self.scheduler.put(abort)
                    else:
                        self.abort_queued(rid, abort.message)
                case Outputs(items=items):
                    for item in items:
                        self.deliver(item)
                case Released(rids=rids):
                    self.lock.readers.difference_update(rids)
                    for rid in rids:
                        self.turn_released(rid)
                case OpenSession() as opening:
                    _answer(opening.reply, self.open_session(opening))
                case EndSession() as ending:
                    self.end_session(ending)
                case UpdateWeights() as update:
                    self.lock.writers.append(update)
                    if update.abort_all:
                        for rid in self.live:
                            self.scheduler.put(Abort(rid, "abort", "aborted for a weight update"))
                case Pause(paused=paused):
                    self.paused = paused
                    self.scheduler.put(SetPaused(paused))
                case WriteDone(error=error):
                    writer = self.lock.finish(error is None)
                    message = error or f"weights loaded from {writer.model_path}"
                    _answer(writer.reply, (error is None, message, self.lock.version))
                    for gen in self.lock.release_queue():
                        self.dispatch(gen)
                case Snapshot() | FlushWhenIdle() | Gate() | Advance() | Deliver() as control:
                    self.scheduler.put(control)
                case Shutdown():
                    if self.writing is not None:
                        self.writing.cancel()
                    for state in self.sessions.values():
                        if state.timer is not None:
                            state.timer.cancel()
                    return
            self.maybe_write()

    # ---- weight updates (the writer side of the lock) -------------------------------------

    def maybe_write(self) -> None:
        start = self.lock.next_writer(self.paused)
        if start is not None:
            writer, park = start
            self.writing = asyncio.create_task(self.write(writer, park))

    async def write(self, writer: UpdateWeights, park: bool) -> None:
        """Park (if paused), load, flush; report back through the mailbox."""
        loop = asyncio.get_running_loop()
        error: str | None = None
        try:
            if park:
                parked: asyncio.Future[Any] = loop.create_future()
                self.scheduler.put(Park(parked))
                await parked
            loaded: asyncio.Future[Any] = loop.create_future()
            self.executor.put(LoadWeights(writer.model_path, loaded))
            error = await loaded
            if error is None:
                flushed: asyncio.Future[Any] = loop.create_future()
                self.cache.put(FlushCache(flushed))
                error = await flushed
        finally:
            self.mailbox.put(WriteDone(error))

    # ---- sessions -------------------------------------------------------------------------

    def open_session(self, msg: OpenSession) -> str | None:
        """None, or why the session cannot be opened."""
        if msg.session_id in self.sessions:
            return f"session {msg.session_id!r} is already open"
        if len(self.sessions) >= self.max_sessions:
            return f"too many open sessions (the cap is {self.max_sessions})"
        state = SessionState(msg.session_id, msg.timeout_s, msg.max_tokens)
        self.sessions[msg.session_id] = state
        self.arm_timer(state)
        return None

    def session_turn(self, gen: Generate) -> None:
        assert gen.session_id is not None
        state = self.sessions.get(gen.session_id)
        if state is None or state.closing is not None:
            gen.stream.fail(ValueError(f"session {gen.session_id!r} is not open"))
        elif state.turn is not None and state.stream_open:
            gen.stream.fail(
                ValueError(
                    f"session {gen.session_id!r} already has a turn in progress: one turn at a time"
                )
            )
        elif state.turn is not None:
            state.queued.append(gen)  # the last turn ended; its KV is still being handed back
        else:
            self.admit(gen, state)

    def session_prompt(self, state: SessionState, gen: Generate) -> list[int]:
        new = turn_input_ids(self.tokenizer, state, gen)
        if not new:
            raise ValueError("the turn adds no tokens")
        ids = state.tokens + new
        self.validate(ids, gen.sampling.max_new_tokens)
        cap = state.max_tokens
        if cap is not None and len(ids) + gen.sampling.max_new_tokens > cap:
            raise ValueError(
                f"the session would reach {len(ids) + gen.sampling.max_new_tokens} tokens, "
                f"over its max_tokens {cap}"
            )
        return ids

    def turn_ended(self, state: SessionState, live: Live, reason: str) -> None:
        """The turn's stream ended: a completed turn becomes history once released."""
        state.stream_open = False
        if reason in ("stop", "length") and state.turn_gen is not None:
            reply = "".join(live.text)
            messages, closing = completed_messages(
                self.tokenizer, state, state.turn_gen, reply, live.output_ids
            )
            state.pending = (state.turn_prompt + live.output_ids, messages, closing)

    def turn_released(self, rid: str) -> None:
        sid = self.turn_of.pop(rid, None)
        state = self.sessions.get(sid) if sid is not None else None
        if state is None:
            return
        if state.pending is not None:
            state.tokens, state.messages, state.closing_text = state.pending
        state.turn, state.pending, state.turn_gen = None, None, None
        if state.closing is not None:
            self.close_session(state)
        elif state.queued:
            self.session_turn(state.queued.popleft())
        else:
            self.arm_timer(state)

    def end_session(self, msg: EndSession) -> None:
        state = self.sessions.get(msg.session_id)
        if state is None:
            if msg.reply is not None:
                _answer(msg.reply, f"session {msg.session_id!r} is not open")
            return
        if state.turn is None:
            self.close_session(state, msg)
        elif msg.reason != "timeout":  # a live turn is never reaped; close when it ends
            state.closing = msg

    def close_session(self, state: SessionState, msg: EndSession | None = None) -> None:
        msg = msg or state.closing
        del self.sessions[state.session_id]
        if state.timer is not None:
            state.timer.cancel()
        for gen in state.queued:
            gen.stream.fail(ValueError(f"session {state.session_id!r} was closed"))
        self.cache.put(CloseSession(state.session_id))
        if msg is not None and msg.reply is not None:
            _answer(msg.reply, None)

    def arm_timer(self, state: SessionState) -> None:
        loop = asyncio.get_running_loop()
        timeout = EndSession(state.session_id, "timeout")
        state.timer = loop.call_later(state.timeout_s, self.mailbox.put, timeout)

    def abort_queued(self, rid: str, message: str) -> None:
        for gen in self.lock.queued:
            if gen.rid == rid:
                self.lock.queued.remove(gen)
                usage = Usage(0, 0, 0)
                gen.stream.finish(Completion(rid, "", (), "abort", usage, None, message))
                return

    # ---- in --------------------------------------------------------------------------------

    def encode(self, gen: Generate) -> list[int]:
        if gen.input_ids is not None:
            ids = list(gen.input_ids)
        elif gen.messages is not None:
            if not gen.messages:
                raise ValueError("messages must not be empty")
            text = self.tokenizer.apply_chat_template(
                list(gen.messages), add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif gen.text is not None:
            ids = self.tokenizer.encode(gen.text)
        else:
            raise ValueError("one of prompt, input_ids or messages is required")
        self.validate(ids, gen.sampling.max_new_tokens)
        return ids

    def validate(self, ids: list[int], max_new_tokens: int) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids contain ids outside the vocabulary: {bad[:5]}")
        limit = self.context_length
        if len(ids) + max_new_tokens > limit:
            raise ValueError(
                f"prompt of {len(ids)} tokens plus max_new_tokens "
                f"{max_new_tokens} exceeds the context length {limit}"
            )

    def dispatch(self, gen: Generate) -> None:
        if gen.session_id is None:
            self.admit(gen)
        else:
            self.session_turn(gen)

    def admit(self, gen: Generate, session: SessionState | None = None) -> None:
        if gen.rid in self.live or gen.rid in self.lock.readers:
            gen.stream.fail(ValueError(f"request id {gen.rid!r} is already in use"))
            return
        try:
            ids = self.encode(gen) if session is None else self.session_prompt(session, gen)
        except ValueError as exc:
            gen.stream.fail(exc)
            return
        sampling = gen.sampling
        seed = sampling.seed if sampling.seed is not None else self.rng.getrandbits(63)
        detok = IncrementalDetokenizer(self.tokenizer, ids, sampling.skip_special_tokens)
        live = Live(gen.stream, detok, StopMatcher(sampling.stop), len(ids))
        live.logprobs = [] if sampling.wants_logprobs else None
        live.weight_version = self.lock.version
        self.live[gen.rid] = live
        self.lock.readers.add(gen.rid)
        prev_len = 0
        if session is not None:
            live.session, prev_len = session, len(session.tokens)
            session.turn, session.stream_open = gen.rid, True
            session.turn_prompt, session.turn_gen = ids, gen
            self.turn_of[gen.rid] = session.session_id
            if session.timer is not None:
                session.timer.cancel()
        sid = session.session_id if session is not None else None
        self.scheduler.put(Admit(gen.rid, tuple(ids), sampling, seed, sid, prev_len))

    # ---- out -------------------------------------------------------------------------------

    def deliver(self, item: Output) -> None:
        live = self.live.get(item.rid)
        if live is None:
            return  # its stream already ended on a stop string; late tokens are dropped
        if item.num_cached_tokens is not None:
            live.num_cached_tokens = item.num_cached_tokens
        live.output_ids.extend(item.token_ids)
        text = live.detok.push(item.token_ids) if item.token_ids else ""
        if item.finish in ("stop", "length"):
            text += live.detok.flush()
        emit, matched = live.stops.push(text) if text else ("", None)
        if matched is None and item.finish is not None:
            emit += live.stops.flush()
        if item.logprobs is not None and live.logprobs is not None:
            live.logprobs.extend(item.logprobs)
        if emit or item.token_ids:
            live.text.append(emit)
            live.stream.push(Delta(emit, item.token_ids, item.logprobs))
        if matched is not None:
            kept = len(live.output_ids)
            self.scheduler.put(Abort(item.rid, reason="stop", keep_outputs=kept))
            self.end(item.rid, "stop", matched)
        elif item.finish is not None:
            self.end(item.rid, item.finish, item.matched_token, item.message)

    def end(self, rid: str, reason: str, matched: str | int | None, message: str = "") -> None:
        live = self.live.pop(rid)
        if live.session is not None:
            self.turn_ended(live.session, live, reason)
        usage = Usage(live.num_prompt, len(live.output_ids), live.num_cached_tokens)
        logprobs = tuple(live.logprobs) if live.logprobs is not None else None
        completion = Completion(
            rid,
            "".join(live.text),
            tuple(live.output_ids),
            reason,
            usage,
            matched,
            message,
            logprobs,
            live.weight_version,
        )
        live.stream.finish(completion)

    def fail_all(self, error: BaseException) -> None:
        for live in self.live.values():
            live.stream.fail(error)
        self.live.clear()
        for gen in self.lock.queued:
            gen.stream.fail(error)
        self.lock.queued.clear()
        for writer in (self.lock.active, *self.lock.writers):
            if writer is not None:
                _answer(writer.reply, (False, str(error), self.lock.version))


def _answer(reply: asyncio.Future[Any], value: Any) -> None:
    if not reply.done():
        reply.set_result(value)
