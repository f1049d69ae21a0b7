"""A request's way from the front of the tokenizer's line to the scheduler (intake.py has
the line and its invariant): the steps that span the tokenizer actor's parts. It keeps no
state of its own; it asks the parts, as the Tokenizer would.

    admission.measured(entry, encoded)   # its prompt measured: the stream told, or refused
    admission.begin_turn(entry)          # a turn at the front: its session decides
    admission.admit(entry)               # measured and at the front: into the scheduler
    admission.withdraw(rid, message)     # aborted before its admission
    admission.fail(entry, error)         # failed before its admission
"""

from __future__ import annotations

import logging

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import Encoded, Generate, SchedulerMsg
from shoal.actors.tokenizer.encode import ChatHistory
from shoal.actors.tokenizer.intake import Intake, Waiting
from shoal.actors.tokenizer.output import RequestStreams, aborted_before_admission
from shoal.actors.tokenizer.sessions import SessionBook
from shoal.actors.tokenizer.update_lock import UpdateLock
from shoal.results import InternalError, RequestError

log = logging.getLogger("shoal.supervise")


class Admission:
    def __init__(
        self,
        intake: Intake,
        lock: UpdateLock,
        sessions: SessionBook,
        streams: RequestStreams,
        scheduler: Mailbox[SchedulerMsg],
    ) -> None:
        self.intake = intake
        self.lock = lock
        self.sessions = sessions
        self.streams = streams
        self.scheduler = scheduler

    def begin_turn(self, entry: Waiting) -> None:
        """A turn at the front: refused or queued by its session (it leaves the line), or its
        session reserved for it while its prompt is measured against the history."""
        gen = entry.msg
        assert isinstance(gen, Generate)
        state = self.sessions.decide(gen)
        if state is None or self.in_use(gen):
            self.intake.pop()
            return
        entry.session = state
        self.intake.measure_turn(entry, self.sessions.reserve(state, gen))

    def measured(self, entry: Waiting, encoded: Encoded) -> None:
        """A request's prompt is measured: its stream is told at once (a turn's when it is
        admitted), or fails with the refusal; it is admitted in its turn."""
        entry.measuring = None
        gen = entry.msg
        assert isinstance(gen, Generate)
        if encoded.prompt is None:
            error = encoded.error
            if not isinstance(error, ValueError):  # not the caller's mistake: a bug
                log.error("the tokenizer failed to measure a prompt", exc_info=error)
                error = InternalError("internal error in the tokenizer while measuring a prompt")
            self.fail(entry, error)
            return
        entry.prompt = encoded.prompt
        if entry.session is None:
            gen.stream.accept(len(encoded.prompt.ids))

    def in_use(self, gen: Generate) -> bool:
        """Its request id is another live request's: its stream fails."""
        if gen.rid in self.streams or self.lock.is_reader(gen.rid):
            gen.stream.fail(RequestError(f"request id {gen.rid!r} is already in use", "rid"))
            return True
        return False

    def admit(self, entry: Waiting) -> None:
        """Admit a measured request: Admit to the scheduler, a live stream here, a reader of
        the update lock, the session's turn begun."""
        gen, prompt, session = entry.msg, entry.prompt, entry.session
        assert isinstance(gen, Generate) and prompt is not None
        if self.in_use(gen):
            self.left_unadmitted(entry)
            return
        if session is not None:
            gen.stream.accept(len(prompt.ids))
        # Admitted first, then booked: a failure after this line finds the request a reader,
        # so its recovery aborts it in the scheduler (which then releases the reader).
        self.scheduler.put(self.intake.admission(gen, prompt, session))
        self.streams.open(gen, prompt.ids, prompt.sampling, self.lock.version, session)
        self.lock.enter(gen.rid)
        if session is not None:
            self.sessions.started(session, gen, prompt.ids, prompt.chat or ChatHistory())

    def withdraw(self, rid: str, message: str) -> None:
        """An Abort of a request not admitted: it leaves the line (or its place behind a
        writer) and its stream ends; its measuring, if not begun, never runs."""
        entry = self.intake.withdraw(rid)
        if entry is not None:
            assert isinstance(entry.msg, Generate)
            if entry.aside:
                self.lock.take_queued(rid)
            aborted_before_admission(entry.msg, message)
            self.left_unadmitted(entry)

    def fail(self, entry: Waiting, error: BaseException, withdrawn: bool = False) -> None:
        """A request that waits (in line or aside) fails, and leaves."""
        gen = entry.msg
        assert isinstance(gen, Generate)
        if not withdrawn:
            self.intake.remove(entry)
        if entry.aside:
            self.lock.take_queued(gen.rid)
        gen.stream.fail(error)
        self.left_unadmitted(entry)

    def left_unadmitted(self, entry: Waiting) -> None:
        """A request left the line unadmitted: a turn's session, reserved for it, is free."""
        if entry.session is not None:
            following = self.sessions.withdrawn(entry.session)
            entry.session = None
            self.intake.to_front([following] if following is not None else [])
