"""The tokenizer actor: the front desk every request and every control message from the
Engine passes (docs/architecture.md, "Tokenizer: the front desk").

One mailbox, one `match`; the work is its parts', each owning its own state:

    intake     Intake          the line the Engine's messages keep their order in, prompts
                               measured off the event loop, seeds, Admit (intake.py)
    admission  Admission       a request's steps from the front of the line to the
                               scheduler, over the other parts          (admission.py)
    streams    RequestStreams  tokens out: text, stop strings, streams   (output.py)
    lock       UpdateLock      readers, writers, requests queued behind them, the weight
                               version, whether a resume must wait       (update_lock.py)
    writer     WeightWriter    a writer's park, load and flush           (weight_writer.py)
    sessions   SessionBook     every open session and its turns          (sessions.py)

(each in this folder, actors/tokenizer/)

What stays here is routing and the few steps that span parts: letting the line through
(admitting a request, a control on to the scheduler in order with the requests before it), a
writer's end, failing a request wherever it is. The line's invariant is intake.py's.
"""

from __future__ import annotations

import logging

from shoal.actors.executor_messages import ExecutorMsg
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import (
    Abort,
    CacheMsg,
    Encoded,
    EndSession,
    FlushWhenIdle,
    Generate,
    OpenSession,
    Outputs,
    Pace,
    Park,
    Released,
    SchedulerMsg,
    SetPaused,
    Shutdown,
    Snapshot,
    TokenizerMsg,
)
from shoal.actors.replies import answer, unread
from shoal.actors.supervise import FaultInjector, fail_replies, serve
from shoal.actors.tokenizer.admission import Admission
from shoal.actors.tokenizer.intake import Intake, Waiting
from shoal.actors.tokenizer.output import RequestStreams
from shoal.actors.tokenizer.sessions import SessionBook
from shoal.actors.tokenizer.update_lock import UpdateLock
from shoal.actors.tokenizer.weight_writer import WeightWriter
from shoal.actors.writer_messages import ChangeMemory, Pause, UpdateWeights, WriteDone, Writer
from shoal.kernels.grammars import Grammars
from shoal.loading.hf_tokenizer import HFTokenizer
from shoal.results import InternalError, OperationRefused, UpdateResult

log = logging.getLogger("shoal.supervise")


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
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
        grammars: Grammars | None = None,
        grammar_compile_timeout_s: float = 10.0,
    ) -> None:
        self.mailbox = mailbox
        self.scheduler = scheduler
        self.faults = faults
        self.intake = Intake(
            tokenizer,
            vocab_size,
            context_length,
            seed,
            mailbox.put,
            grammars,
            grammar_compile_timeout_s,
        )
        self.lock = UpdateLock()
        self.writer = WeightWriter(mailbox, scheduler, executor, cache)
        self.sessions = SessionBook(max_sessions, cache, mailbox.put, max_sessions_per_client)
        self.streams = RequestStreams(tokenizer, scheduler, self.sessions)
        self.admission = Admission(self.intake, self.lock, self.sessions, self.streams, scheduler)

    @property
    def weight_version(self) -> str:
        """The weight version serving now (the one value of this actor read outside its
        mailbox: Engine.weight_version, on the same event loop)."""
        return self.lock.version

    async def run(self) -> None:
        await serve("tokenizer", self.mailbox, self.faults, self.handle, self.recover)

    async def handle(self, msg: TokenizerMsg) -> None:
        match msg:
            case Abort(rid=rid) as abort:
                if rid in self.streams:
                    self.scheduler.put(abort)
                else:
                    self.admission.withdraw(rid, abort.message)
            case Outputs(items=items, steady_rids=rids, steady_tokens=tokens):
                if rids:
                    self.streams.deliver_steady(rids, tokens)
                self.streams.deliver_all(items)
            case Released(rids=rids):
                self.released(rids)
            case WriteDone(failure=failure):
                self.write_done(failure)
            case Encoded(ticket=ticket) as encoded:
                entry = self.intake.find(ticket)
                if entry is not None:  # None: withdrawn meanwhile
                    self.admission.measured(entry, encoded)
            case Shutdown():
                self.writer.cancel()
                self.sessions.shutdown()
                self.intake.close()
                return
            case Generate() as gen:  # ordered: it waits its turn in the line (intake.py)
                entry = self.intake.arrive(gen)
                done = None if gen.session_id is not None else self.intake.measure(entry)
                if done is not None:
                    self.admission.measured(entry, done)
            case _:  # every other message of the Engine's is ordered too
                self.intake.arrive(msg)
        self.let_through()
        self.maybe_write()

    def in_order(self, msg: TokenizerMsg) -> None:
        """An ordered message other than a request, at the front of the line."""
        match msg:
            case OpenSession() as opening:
                self.sessions.open(opening)
            case EndSession() as ending:
                self.sessions.end(ending)
            case UpdateWeights() as update:
                self.lock.request(update)
                if update.abort_all:
                    self.abort_live("aborted for a weight update")
            case ChangeMemory() as change:
                self.lock.request(change)
            case Pause(paused=paused, mode=mode):
                self.lock.set_paused(paused)
                if paused or self.lock.may_resume():
                    self.scheduler.put(SetPaused(paused))
                if paused and mode == "abort":
                    self.abort_live("aborted by pause_generation")
                elif paused and mode == "retract":
                    self.scheduler.put(Park(unread()))
            case Snapshot() | FlushWhenIdle() | Pace() as control:
                self.scheduler.put(control)

    def abort_live(self, message: str) -> None:
        """End every request in the engine, each with what it generated."""
        for rid in self.streams.rids():
            self.scheduler.put(Abort(rid, "abort", message))

    def recover(self, msg: TokenizerMsg, error: InternalError) -> None:
        """One message failed (actors/supervise.py): end what it stood for, keep the lock's
        books whole so no writer or queued request waits forever, and the line moving."""
        self.undo(msg, error)
        self.let_through()
        self.maybe_write()

    def undo(self, msg: TokenizerMsg, error: InternalError) -> None:
        fail_replies(msg, error)
        match msg:
            case Generate() as gen:  # its stream has failed; it leaves, or is undone
                entry = self.intake.take(gen)
                if entry is not None:  # in line or aside: it leaves (its session freed)
                    self.admission.fail(entry, error, withdrawn=True)
                if self.streams.has_stream(gen.rid, gen.stream):
                    self.fail_request(gen.rid, error)
            case Encoded(ticket=ticket):
                entry = self.intake.find(ticket)
                if entry is not None:
                    self.admission.fail(entry, error)
            case Abort(rid=rid):
                self.fail_request(rid, error)
            case Outputs(items=items, steady_rids=rids):
                for rid in (*rids, *(item.rid for item in items)):
                    self.fail_request(rid, error)
            case Released(rids=rids):
                self.released(rids)
            case UpdateWeights() | ChangeMemory() as writer:
                self.lock.withdraw(writer)
            case WriteDone():
                self.write_done(error)

    def fail_request(self, rid: str, error: InternalError) -> None:
        """End one request with an error wherever it is: in line or queued behind a writer,
        live here (its session turn too), and in the scheduler if it was admitted."""
        entry = self.intake.withdraw(rid)
        if entry is not None:
            self.admission.fail(entry, error, withdrawn=True)
        self.streams.fail(rid, error)
        if self.lock.is_reader(rid):  # admitted: the scheduler ends it and reports Released
            self.scheduler.put(Abort(rid, "abort", str(error)))

    def released(self, rids: tuple[str, ...]) -> None:
        self.lock.leave(rids)
        following = [self.sessions.released(rid) for rid in rids]
        self.intake.to_front(gen for gen in following if gen is not None)

    # ---- in (the line: intake.py) -------------------------------------------------------

    def let_through(self) -> None:
        """Let through the line, in order, whatever may go. One entry's failure fails that
        entry only, as supervise.serve does for a message."""
        while (entry := self.intake.front()) is not None:
            try:
                if not self.let_go(entry):
                    return
            except Exception as exc:
                kind = type(entry.msg).__name__
                log.error("the tokenizer failed while handling %s", kind, exc_info=exc)
                self.undo(
                    entry.msg,
                    InternalError(f"internal error in the tokenizer while handling {kind}"),
                )
                if self.intake.front() is entry:
                    self.intake.pop()

    def let_go(self, entry: Waiting) -> bool:
        """The front of the line: a message takes effect; a request waits aside if a writer
        waits or works, is decided by its session if it is a turn (and measured then), and is
        admitted once measured. False: the front must wait for its Encoded."""
        msg = entry.msg
        if not isinstance(msg, Generate):
            self.intake.pop()
            self.in_order(msg)
            return True
        if not entry.cleared:
            entry.cleared = True
            if self.lock.defer(msg):
                self.intake.set_aside(entry)  # back at the front when the writers are done
                return True
        if entry.prompt is None:
            if msg.session_id is None or entry.session is not None:
                return False  # being measured
            self.admission.begin_turn(entry)
            return True
        self.intake.pop()
        self.admission.admit(entry)
        return True

    # ---- weight updates (the writer side of the lock) -------------------------------------

    def maybe_write(self) -> None:
        start = self.lock.next_writer()
        if start is not None:
            self.writer.start(*start)

    def write_done(self, failure: OperationRefused | InternalError | None) -> None:
        """The writer's work ended (failure: what stopped it): answer it, let a resume through
        and admit the requests that waited for the writers."""
        writer = self.lock.done(failure is None)
        if writer is not None:
            message = _done_message(writer) if failure is None else str(failure)
            answer(writer.reply, UpdateResult(failure is None, message, self.lock.version))
            self.streams.restamp(self.lock.version)  # parked across it: what comes is new
        if self.lock.may_resume():
            self.scheduler.put(SetPaused(False))
        self.intake.to_front(self.lock.release_queue())

    def fail_all(self, error: BaseException) -> None:
        """The engine stops: every live stream, request in line or queued, ordered message
        waiting in line, and writer fails."""
        self.streams.fail_all(error)
        queued, writers = self.lock.abandon()
        for gen in queued:
            gen.stream.fail(error)
        for entry in self.intake.abandon():
            fail_replies(entry.msg, error)
        for writer in writers:
            answer(writer.reply, UpdateResult(False, str(error), self.lock.version))


def _done_message(writer: Writer) -> str:
    if isinstance(writer, UpdateWeights):
        return f"weights loaded {writer.source.describe()}"
    return f"memory {writer.describe()}"
