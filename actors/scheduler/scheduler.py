"""The scheduler actor: owns every live request (through its Planner) and drives steps.

One step is one round trip: PlanRequest → cache manager → Plan → Launch → executor →
StepDone. Up to `max_inflight` launches are outstanding at once, so the results of step N
are processed while step N+1 runs.

Operations that need the engine idle (a cache flush) or quiet (a weight update during a
pause) are deferred here until the planner says so — never asserted (docs/architecture.md,
"Lifecycle laws", law 5). Because the cache manager's mailbox is FIFO, a flush sent while
idle lands before any later admission.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field

import msgspec

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import (
    Abort,
    Admit,
    Advance,
    CacheMsg,
    CheckIntegrity,
    Deliver,
    ExecutorMsg,
    FlushCache,
    FlushDeadline,
    FlushWhenIdle,
    Gate,
    Output,
    Outputs,
    Park,
    Plan,
    Released,
    SchedulerMsg,
    SetPaused,
    Shutdown,
    Snapshot,
    StepDone,
    TokenizerMsg,
    TransferEnded,
)
from shoal.actors.replies import answer
from shoal.actors.scheduler.planner import Planner
from shoal.actors.scheduler.planner_transfers import concerns
from shoal.actors.supervise import Fatal, FaultInjector, fail_replies, serve
from shoal.actors.transfer_messages import TransferMsg
from shoal.results import InternalError

log = logging.getLogger("shoal.scheduler")


@dataclass
class StepGate:
    """Test stepping. While held, a plan is made only per Advance, a result processed only
    per Deliver; results that arrive meanwhile wait in `results`."""

    held: bool = False
    advances: deque[asyncio.Future[int | None]] = field(default_factory=deque)
    planning: asyncio.Future[int | None] | None = None
    delivers: deque[asyncio.Future[int]] = field(default_factory=deque)
    results: deque[StepDone] = field(default_factory=deque)


class Scheduler:
    def __init__(
        self,
        planner: Planner,
        max_inflight: int,
        mailbox: Mailbox[SchedulerMsg],
        cache: Mailbox[CacheMsg],
        executor: Mailbox[ExecutorMsg],
        tokenizer: Mailbox[TokenizerMsg],
        faults: FaultInjector | None = None,
        transfer: Mailbox[TransferMsg] | None = None,
    ) -> None:
        assert max_inflight >= 1
        self.planner = planner
        self.max_inflight = max_inflight
        self.mailbox = mailbox
        self.cache = cache
        self.executor = executor
        self.tokenizer = tokenizer
        self.step = 0
        self.was_idle = True
        self.gate = StepGate()
        self.flushes: dict[int, tuple[asyncio.Future[str | None], asyncio.TimerHandle]] = {}
        self.parks: list[asyncio.Future[None]] = []
        self.faults = faults
        self.transfer = transfer  # disaggregation's transfer actor (actors/transfer/kv_transfer.py)

    async def run(self) -> None:
        await serve("scheduler", self.mailbox, self.faults, self.handle, self.recover)

    async def handle(self, msg: SchedulerMsg) -> None:
        if isinstance(msg, Shutdown):
            return
        self.apply(msg)
        self._pump_gate()
        self._maybe_plan()
        self._when_quiet()
        self._send_transfers()

    def recover(self, msg: SchedulerMsg, error: InternalError) -> None:
        """One message failed (actors/supervise.py): end the request or operation it stood
        for. A plan that could not be applied leaves unknown which rows and pages are held:
        that stops the engine."""
        fail_replies(msg, error)
        planner = self.planner
        match msg:
            case Admit(rid=rid) if rid not in planner.reqs:
                self.tokenizer.put(Outputs((Output(rid, (), "error", str(error)),)))
                self.tokenizer.put(Released((rid,)))
            case Admit(rid=rid) | Abort(rid=rid):
                self._send(planner.fail(rid, str(error)))
            case StepDone(batch_id=batch_id) if batch_id in planner.batches:
                self._send(planner.process(StepDone(batch_id, (), error=str(error))))
            case FlushDeadline(flush_id=flush_id) if flush_id in self.flushes:
                reply, _ = self.flushes.pop(flush_id)
                answer(reply, f"not flushed: {error}")
            case Plan():
                raise Fatal("the scheduler could not apply a plan") from error
            case TransferEnded(rid=rid) as ended if concerns(planner.reqs.get(rid), ended):
                # the transfer is over, whatever failed (for its pages too, unless held)
                planner.reqs[rid].transfer_open = ended.held
                self._send(planner.fail(rid, str(error)))
        self._maybe_plan()
        self._send_transfers()

    def apply(self, msg: SchedulerMsg) -> None:
        planner = self.planner
        match msg:
            case Admit() as admit:
                planner.add(admit)
            case Abort(rid=rid, reason=reason, message=message, keep_outputs=keep):
                self._send(planner.abort(rid, reason, message, keep))
            case Plan() as plan:
                launch = planner.apply_plan(plan)
                self._send(planner.take_errors())
                if launch is not None:
                    self.executor.put(launch)
                if self.gate.planning is not None:
                    answer(self.gate.planning, launch.batch_id if launch else None)
                    self.gate.planning = None
            case TransferEnded() as ended:
                self._send(planner.transfer_ended(ended))
            case StepDone() as done:
                if self.gate.held:
                    self.gate.results.append(done)
                else:
                    self._send(planner.process(done))
            case Snapshot(reply=reply):
                held = tuple(d.batch_id for d in self.gate.results)
                answer(reply, msgspec.structs.replace(planner.snapshot(), held_results=held))
            case FlushWhenIdle(flush_id=flush_id, timeout_s=timeout_s, reply=reply):
                loop = asyncio.get_running_loop()
                timer = loop.call_later(timeout_s, self.mailbox.put, FlushDeadline(flush_id))
                self.flushes[flush_id] = (reply, timer)
            case FlushDeadline(flush_id=flush_id):
                if flush_id in self.flushes:
                    reply, _ = self.flushes.pop(flush_id)
                    busy = planner.snapshot().busy_summary()
                    answer(reply, f"not flushed: the engine did not become idle in time ({busy})")
            case SetPaused(paused=paused):
                planner.set_paused(paused)
            case Park(reply=reply):
                planner.park_all()
                self.parks.append(reply)
            case Gate(hold=hold):
                self.gate.held = hold
                if not hold:
                    for done in self.gate.results:
                        self._send(planner.process(done))
                    self.gate.results.clear()
            case Advance(reply=reply) | Deliver(reply=reply) if not self.gate.held:
                # The engine runs freely: there is no step to wait for.
                reply.set_exception(RuntimeError("the step gate is not held: call hold() first"))
            case Advance(reply=reply):
                self.gate.advances.append(reply)
            case Deliver(reply=reply):
                self.gate.delivers.append(reply)

    def _send(self, outputs: list[Output]) -> None:
        if outputs:
            self.tokenizer.put(Outputs(tuple(outputs)))
        released = self.planner.take_released()
        if released:
            self.tokenizer.put(Released(tuple(released)))

    def _send_transfers(self) -> None:
        for msg in self.planner.take_transfers():
            assert self.transfer is not None, "a transfer without disaggregation"
            self.transfer.put(msg)

    def _pump_gate(self) -> None:
        gate = self.gate
        while gate.delivers and gate.results:
            done = gate.results.popleft()
            self._send(self.planner.process(done))
            answer(gate.delivers.popleft(), done.batch_id)

    def _maybe_plan(self) -> None:
        planner = self.planner
        if planner.plan_pending:
            return
        gate = self.gate
        if gate.held and (not gate.advances or gate.planning is not None):
            return
        if len(planner.batches) >= self.max_inflight:
            if gate.held:
                answer(gate.advances.popleft(), None)  # the pipeline is full
            return
        request = planner.propose(self.step)
        if request is not None:
            self.step += 1
            self.cache.put(request)
            if self.gate.held:
                self.gate.planning = self.gate.advances.popleft()
        elif self.gate.held:
            answer(self.gate.advances.popleft(), None)

    def _when_quiet(self) -> None:
        """Serve deferred operations; run the integrity self-check on becoming idle."""
        planner = self.planner
        if self.parks:
            planner.park_all()  # again: an admission in flight when parking began has landed
            if planner.parked:
                for parked in self.parks:
                    answer(parked, None)
                self.parks.clear()
        idle = planner.idle
        if idle and self.flushes:
            for flushed, timer in self.flushes.values():
                timer.cancel()
                self.cache.put(FlushCache(flushed))
            self.flushes.clear()
        if idle and not self.was_idle:
            self.cache.put(CheckIntegrity())
        self.was_idle = idle
