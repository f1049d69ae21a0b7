"""The tokenizer actor: the front desk every request and every control message from the
Engine passes (docs/architecture.md, "Tokenizer: the front desk").

One mailbox, one `match`; the work is its parts', each owning its own state:

    intake     Intake          prompts into checked ids, seeds, Admit    (intake.py)
    streams    RequestStreams  tokens out: text, stop strings, streams   (output.py)
    lock       UpdateLock      readers, writers, requests queued behind them, the weight
                               version, whether a resume must wait       (update_lock.py)
    writer     WeightWriter    a writer's park, load and flush           (weight_writer.py)
    sessions   SessionBook     every open session and its turns          (sessions.py)

(each in this folder, actors/tokenizer/)

What stays here is routing (control messages go on to the scheduler in order with the
requests before them) and the few steps that span parts: admitting a request, a writer's end,
failing a request wherever it is.
"""

from __future__ import annotations

from typing import Any

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import (
    Abort,
    Advance,
    CacheMsg,
    Deliver,
    EndSession,
    ExecutorMsg,
    FlushWhenIdle,
    Gate,
    Generate,
    OpenSession,
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
from shoal.actors.supervise import FaultInjector, fail_replies, serve
from shoal.actors.tokenizer.intake import Intake
from shoal.actors.tokenizer.output import RequestStreams, aborted_before_admission
from shoal.actors.tokenizer.sessions import SessionBook, SessionState
from shoal.actors.tokenizer.update_lock import UpdateLock
from shoal.actors.tokenizer.weight_writer import WeightWriter
from shoal.results import InternalError, RequestError


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
        max_sessions_per_client: int | None = None,
    ) -> None:
        self.mailbox = mailbox
        self.scheduler = scheduler
        self.faults = faults
        self.intake = Intake(tokenizer, vocab_size, context_length, seed)
        self.lock = UpdateLock()
        self.writer = WeightWriter(mailbox, scheduler, executor, cache)
        self.sessions = SessionBook(
            tokenizer,
            max_sessions,
            self.intake.check,
            self.admit,
            cache,
            mailbox.put,
            max_sessions_per_client,
        )
        self.streams = RequestStreams(tokenizer, scheduler, self.sessions)

    @property
    def weight_version(self) -> int:
        """The weight version serving now (the one value of this actor read outside its
        mailbox: Engine.weight_version, on the same event loop)."""
        return self.lock.version

    async def run(self) -> None:
        await serve("tokenizer", self.mailbox, self.faults, self.handle, self.recover)

    async def handle(self, msg: TokenizerMsg) -> None:
        match msg:
            case Generate() as gen:
                if not self.lock.defer(gen):
                    self.dispatch(gen)
            case Abort(rid=rid) as abort:
                if rid in self.streams:
                    self.scheduler.put(abort)
                else:
                    queued = self.lock.take_queued(rid)
                    if queued is not None:
                        aborted_before_admission(queued, abort.message)
            case Outputs(items=items):
                for item in items:
                    self.streams.deliver(item)
            case Released(rids=rids):
                self.released(rids)
            case OpenSession() as opening:
                self.sessions.open(opening)
            case EndSession() as ending:
                self.sessions.end(ending)
            case UpdateWeights() as update:
                self.lock.request(update)
                if update.abort_all:
                    for rid in self.streams.rids():
                        self.scheduler.put(Abort(rid, "abort", "aborted for a weight update"))
            case Pause(paused=paused):
                self.lock.set_paused(paused)
                if paused or self.lock.may_resume():
                    self.scheduler.put(SetPaused(paused))
            case WriteDone(error=error):
                self.write_done(error)
            case Snapshot() | FlushWhenIdle() | Gate() | Advance() | Deliver() as control:
                self.scheduler.put(control)
            case Shutdown():
                self.writer.cancel()
                self.sessions.shutdown()
                return
        self.maybe_write()

    def recover(self, msg: TokenizerMsg, error: InternalError) -> None:
        """One message failed (actors/supervise.py): end what it stood for, keep the lock's
        books whole so no writer or queued request waits forever."""
        fail_replies(msg, error)
        match msg:
            case Generate() as gen:  # its stream has failed; undo its admission if made
                if self.streams.has_stream(gen.rid, gen.stream):
                    self.fail_request(gen.rid, error)
            case Abort(rid=rid):
                self.fail_request(rid, error)
            case Outputs(items=items):
                for item in items:
                    self.fail_request(item.rid, error)
            case Released(rids=rids):
                self.released(rids)
            case UpdateWeights() as update:
                self.lock.withdraw(update)
            case WriteDone():
                self.write_done(str(error))
        self.maybe_write()

    def fail_request(self, rid: str, error: InternalError) -> None:
        """End one request with an error wherever it is: queued behind a writer, live here
        (its session turn too), and in the scheduler if it was admitted."""
        queued = self.lock.take_queued(rid)
        if queued is not None:
            queued.stream.fail(error)
        self.streams.fail(rid, error)
        if self.lock.is_reader(rid):  # admitted: the scheduler ends it and reports Released
            self.scheduler.put(Abort(rid, "abort", str(error)))

    def released(self, rids: tuple[str, ...]) -> None:
        self.lock.leave(rids)
        for rid in rids:
            self.sessions.released(rid)

    # ---- in --------------------------------------------------------------------------------

    def dispatch(self, gen: Generate) -> None:
        if gen.session_id is None:
            self.admit(gen)
        else:
            self.sessions.turn(gen)

    def admit(self, gen: Generate, session: SessionState | None = None) -> None:
        """Check the prompt, then admit: Admit to the scheduler, a live stream here, a reader
        of the update lock, the session's turn begun."""
        if gen.rid in self.streams or self.lock.is_reader(gen.rid):
            gen.stream.fail(RequestError(f"request id {gen.rid!r} is already in use", "rid"))
            return
        try:
            ids = self.intake.prompt(gen) if session is None else self.sessions.prompt(session, gen)
        except ValueError as exc:
            gen.stream.fail(exc)
            return
        # Admitted first, then booked: a failure after this line finds the request a reader,
        # so its recovery aborts it in the scheduler (which then releases the reader).
        self.scheduler.put(self.intake.admission(gen, ids, session))
        self.streams.open(gen, ids, self.lock.version, session)
        self.lock.enter(gen.rid)
        if session is not None:
            self.sessions.started(session, gen, ids)

    # ---- weight updates (the writer side of the lock) -------------------------------------

    def maybe_write(self) -> None:
        start = self.lock.next_writer()
        if start is not None:
            self.writer.start(*start)

    def write_done(self, error: str | None) -> None:
        """The writer's work ended (error: why it failed): answer it, let a resume through
        and admit the requests that waited for the writers."""
        writer = self.lock.done(error is None)
        if writer is not None:
            message = error or f"weights loaded from {writer.model_path}"
            answer(writer.reply, UpdateOutcome(error is None, message, self.lock.version))
            self.streams.restamp(self.lock.version)  # parked across it: what comes is new
        if self.lock.may_resume():
            self.scheduler.put(SetPaused(False))
        for gen in self.lock.release_queue():
            self.dispatch(gen)

    def fail_all(self, error: BaseException) -> None:
        """The engine stops: every live stream, queued request and writer fails."""
        self.streams.fail_all(error)
        queued, writers = self.lock.abandon()
        for gen in queued:
            gen.stream.fail(error)
        for writer in writers:
            answer(writer.reply, UpdateOutcome(False, str(error), self.lock.version))
