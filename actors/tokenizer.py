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
from shoal.actors.encode import check_prompt, encode_prompt
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import (
    Abort,
    Admit,
    Advance,
    CacheMsg,
    Deliver,
    EndSession,
    ExecutorMsg,
    FlushWhenIdle,
    Gate,
    Generate,
    OpenSession,
    Output,
    Outputs,
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
from shoal.actors.replies import UpdateOutcome, answer
from shoal.actors.sessions import SessionBook, SessionState
from shoal.actors.stops import StopMatcher
from shoal.actors.supervise import FaultInjector, fail_replies, serve
from shoal.actors.update_lock import UpdateLock, write_weights
from shoal.results import (
    Completion,
    Delta,
    FinishReason,
    InternalError,
    RequestError,
    RequestStream,
    TokenLogprob,
    Usage,
)


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
        faults: FaultInjector | None = None,
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
        self.sessions = SessionBook(
            tokenizer, max_sessions, self.validate, self.admit, cache, mailbox.put
        )
        self.writing: asyncio.Task[None] | None = None
        self.faults = faults

    async def run(self) -> None:
        await serve("tokenizer", self.mailbox, self.faults, self.handle, self.recover)

    async def handle(self, msg: TokenizerMsg) -> None:
        match msg:
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
                    self.sessions.released(rid)
            case OpenSession() as opening:
                self.sessions.open(opening)
            case EndSession() as ending:
                self.sessions.end(ending)
            case UpdateWeights() as update:
                self.lock.writers.append(update)
                if update.abort_all:
                    for rid in self.live:
                        self.scheduler.put(Abort(rid, "abort", "aborted for a weight update"))
            case Pause(paused=paused):
                self.paused = paused
                # A writer at work may have parked the requests it found: they stay parked
                # (the scheduler paused) until its load and flush are done, so none holds
                # pages or reads KV of the old weights when the flush lands.
                if paused or self.lock.active is None:
                    self.scheduler.put(SetPaused(paused))
            case WriteDone(error=error):
                writer = self.lock.finish(error is None)
                message = error or f"weights loaded from {writer.model_path}"
                answer(writer.reply, UpdateOutcome(error is None, message, self.lock.version))
                for live in self.live.values():  # parked across it: what comes next is new
                    live.weight_version = self.lock.version
                if not self.paused:
                    self.scheduler.put(SetPaused(False))
                for gen in self.lock.release_queue():
                    self.dispatch(gen)
            case Snapshot() | FlushWhenIdle() | Gate() | Advance() | Deliver() as control:
                self.scheduler.put(control)
            case Shutdown():
                if self.writing is not None:
                    self.writing.cancel()
                self.sessions.shutdown()
                return
        self.maybe_write()

    def recover(self, msg: TokenizerMsg, error: InternalError) -> None:
        """One message failed (actors/supervise.py): end what it stood for, keep the lock's
        books whole so no writer or queued request waits forever."""
        fail_replies(msg, error)
        match msg:
            case Generate() as gen:  # its stream has failed; undo its admission if made
                live = self.live.get(gen.rid)
                if live is not None and live.stream is gen.stream:
                    self.fail_request(gen.rid, error)
            case Abort(rid=rid):
                self.fail_request(rid, error)
            case Outputs(items=items):
                for item in items:
                    self.fail_request(item.rid, error)
            case Released(rids=rids):
                self.lock.readers.difference_update(rids)
                for rid in rids:
                    self.sessions.released(rid)
            case UpdateWeights() as update:
                if update in self.lock.writers:
                    self.lock.writers.remove(update)
            case WriteDone():
                if self.lock.active is not None:
                    writer = self.lock.finish(False)
                    answer(writer.reply, UpdateOutcome(False, str(error), self.lock.version))
                for gen in self.lock.release_queue():
                    self.dispatch(gen)
        self.maybe_write()

    def fail_request(self, rid: str, error: InternalError) -> None:
        """End one request with an error wherever it is: queued behind a writer, live here
        (its session turn too), and in the scheduler if it was admitted."""
        for gen in self.lock.queued:
            if gen.rid == rid:
                self.lock.queued.remove(gen)
                gen.stream.fail(error)
                break
        live = self.live.pop(rid, None)
        if live is not None:
            if live.session is not None:
                self.sessions.ended(live.session, "", [], "error")
            live.stream.fail(error)
        if rid in self.lock.readers:  # admitted: the scheduler ends it and reports Released
            self.scheduler.put(Abort(rid, "abort", str(error)))

    # ---- weight updates (the writer side of the lock) -------------------------------------

    def maybe_write(self) -> None:
        start = self.lock.next_writer(self.paused)
        if start is not None:
            self.writing = asyncio.create_task(self.write(*start))

    async def write(self, writer: UpdateWeights, park: bool) -> None:
        """Run the writer's work; report back through the mailbox whatever happens."""
        error: str | None = "the weight update was interrupted"
        try:
            error = await write_weights(writer, park, self.scheduler, self.executor, self.cache)
        except InternalError as exc:  # a step of it failed (see actors/supervise.py)
            error = str(exc)
        finally:
            self.mailbox.put(WriteDone(error))

    def abort_queued(self, rid: str, message: str) -> None:
        for gen in self.lock.queued:
            if gen.rid == rid:
                self.lock.queued.remove(gen)
                usage = Usage(0, 0, 0)
                gen.stream.finish(Completion(rid, "", (), "abort", usage, None, message))
                return

    # ---- in --------------------------------------------------------------------------------

    def encode(self, gen: Generate) -> list[int]:
        ids = encode_prompt(self.tokenizer, gen.text, gen.input_ids, gen.messages)
        self.validate(ids, gen.sampling.max_new_tokens)
        return ids

    def validate(self, ids: list[int], max_new_tokens: int) -> None:
        check_prompt(ids, max_new_tokens, self.vocab_size, self.context_length)

    def dispatch(self, gen: Generate) -> None:
        if gen.session_id is None:
            self.admit(gen)
        else:
            self.sessions.turn(gen)

    def admit(self, gen: Generate, session: SessionState | None = None) -> None:
        if gen.rid in self.live or gen.rid in self.lock.readers:
            gen.stream.fail(RequestError(f"request id {gen.rid!r} is already in use", "rid"))
            return
        try:
            ids = self.encode(gen) if session is None else self.sessions.prompt(session, gen)
        except ValueError as exc:
            gen.stream.fail(exc)
            return
        sampling = gen.sampling
        seed = sampling.seed if sampling.seed is not None else self.rng.getrandbits(63)
        detok = IncrementalDetokenizer(self.tokenizer, ids, sampling.skip_special_tokens)
        live = Live(gen.stream, detok, StopMatcher(sampling.stop), len(ids))
        live.logprobs = [] if sampling.wants_logprobs else None
        live.weight_version = self.lock.version
        sid = session.session_id if session is not None else None
        prev_len = len(session.tokens) if session is not None else 0
        # Admitted first, then booked: a failure after this line finds the request a reader,
        # so its recovery aborts it in the scheduler (which then releases the reader).
        self.scheduler.put(Admit(gen.rid, tuple(ids), sampling, seed, sid, prev_len))
        self.live[gen.rid] = live
        self.lock.readers.add(gen.rid)
        if session is not None:
            live.session = session
            self.sessions.started(session, gen, ids)

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

    def end(
        self, rid: str, reason: FinishReason, matched: str | int | None, message: str = ""
    ) -> None:
        live = self.live.pop(rid)
        if live.session is not None:
            self.sessions.ended(live.session, "".join(live.text), live.output_ids, reason)
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
                answer(writer.reply, UpdateOutcome(False, str(error), self.lock.version))
