"""When the scheduler may plan a step and process a step's result: its pacer.

The scheduler asks, and holds no stepping of its own:

    if pacer.may_plan(): ... propose, send the PlanRequest ...   then exactly one
    pacer.launched(batch_id or None)      (at the Plan; None at once: nothing to plan, full)
    if pacer.may_process(done): ...       else the pacer keeps `done`
    for done in pacer.due(): ...          kept results handed back, in arrival order
    pacer = pacer.told(order)             a Pace message's order (tests only)

`FreeRun` (production) says yes to everything and keeps nothing. `Stepper` (the tests' step
gate: engine.testing.hold / advance / deliver / release, api/testing.py) plans one step per
`Advance` and processes one result per `Deliver` while held, and runs freely otherwise. A
FreeRun told to hold becomes a Stepper, which stays (free while released).

The orders reach the scheduler inside a `Pace` message that passes the tokenizer's mailbox
(actors/messages.py), so an order keeps its order with the requests sent before it: an
`Advance` never overtakes the `Generate` it follows (docs/architecture.md, "Where the code
moved past the brief", point 2).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

import msgspec

from shoal.actors.messages import StepDone
from shoal.actors.replies import answer


class Hold(msgspec.Struct, frozen=True, tag=True):
    """Stop between steps: nothing is planned or processed but per Advance and Deliver."""


class Release(msgspec.Struct, frozen=True, tag=True):
    """Run freely again; the results kept meanwhile are processed at once, in order."""


class Advance(msgspec.Struct, frozen=True, tag=True):
    """While held: plan and launch one step; the reply is the launched batch id or None."""

    reply: asyncio.Future[int | None]


class Deliver(msgspec.Struct, frozen=True, tag=True):
    """While held: process the oldest result (waiting for one); the reply is its batch id."""

    reply: asyncio.Future[int]


PaceOrder = Hold | Release | Advance | Deliver


class Pacer(Protocol):
    def may_plan(self) -> bool:
        """Whether the scheduler may plan now (it has no plan outstanding). A True is
        followed by exactly one `launched`."""
        ...

    def launched(self, batch_id: int | None) -> None:
        """What came of that turn: the batch launched, or None (nothing to plan, no room for
        another launch, a plan that launched nothing)."""
        ...

    def may_process(self, done: StepDone) -> bool:
        """A step's result came back: process it now, or False: the pacer keeps it."""
        ...

    def due(self) -> list[StepDone]:
        """Kept results to process now, in arrival order (asked after every message)."""
        ...

    def held_results(self) -> tuple[int, ...]:
        """The batch ids of the results kept (SchedulerSnapshot.held_results)."""
        ...

    def told(self, order: PaceOrder) -> Pacer:
        """A test's order; the pacer to ask from now on."""
        ...


def not_held(order: Advance | Deliver) -> None:
    """A step asked of an engine that runs freely: there is no step to wait for."""
    if not order.reply.done():
        order.reply.set_exception(RuntimeError("the step gate is not held: call hold() first"))


class FreeRun:
    """Production: plan whenever the scheduler can, process every result as it comes."""

    def may_plan(self) -> bool:
        return True

    def launched(self, batch_id: int | None) -> None:
        pass

    def may_process(self, done: StepDone) -> bool:
        return True

    def due(self) -> list[StepDone]:
        return []

    def held_results(self) -> tuple[int, ...]:
        return ()

    def told(self, order: PaceOrder) -> Pacer:
        match order:
            case Hold():
                return Stepper()
            case Advance() | Deliver():
                not_held(order)
        return self


class Stepper:
    """The tests' step gate. While held, a plan is made only per Advance (answered with the
    batch it launched), a result processed only per Deliver; results that arrive meanwhile
    wait in `results`. Released, it runs as FreeRun does."""

    def __init__(self) -> None:
        self.held = True
        self.advances: deque[asyncio.Future[int | None]] = deque()
        self.planning: asyncio.Future[int | None] | None = None  # the Advance being served
        self.delivers: deque[asyncio.Future[int]] = deque()
        self.results: deque[StepDone] = deque()

    def may_plan(self) -> bool:
        if not self.held:
            return True
        if not self.advances:
            return False
        self.planning = self.advances.popleft()
        return True

    def launched(self, batch_id: int | None) -> None:
        if self.planning is not None:
            answer(self.planning, batch_id)
            self.planning = None

    def may_process(self, done: StepDone) -> bool:
        if self.held:
            self.results.append(done)
        return not self.held

    def due(self) -> list[StepDone]:
        """Released: every kept result. Held: one per waiting Deliver, which is answered
        with it (the scheduler processes it in this same turn, before the caller runs)."""
        out: list[StepDone] = []
        while self.results and (not self.held or self.delivers):
            done = self.results.popleft()
            if self.held:
                answer(self.delivers.popleft(), done.batch_id)
            out.append(done)
        return out

    def held_results(self) -> tuple[int, ...]:
        return tuple(done.batch_id for done in self.results)

    def told(self, order: PaceOrder) -> Pacer:
        match order:
            case Hold():
                self.held = True
            case Release():
                self.held = False
            case Advance(reply=reply) if self.held:
                self.advances.append(reply)
            case Deliver(reply=reply) if self.held:
                self.delivers.append(reply)
            case Advance() | Deliver():
                not_held(order)
        return self
