"""The scheduler actor: owns every live request (through its Planner) and drives steps.

One step is one round trip: PlanRequest → cache manager → Plan → Launch → executor →
StepDone. Up to `max_inflight` launches are outstanding at once, so the results of step N
are processed while step N+1 runs.

Operations that need the engine idle (a cache flush) or quiet (a weight update during a
pause) are deferred here until the planner says so — never asserted (docs/architecture.md,
"Lifecycle laws", law 5). Because the cache manager's mailbox is FIFO, a flush sent while
idle lands before any later admission.

When to plan and when to process a result is its pacer's to say (actors/scheduler/pacing.py):
free-running in production, stepped by the tests' `Pace` orders.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from shoal.actors.executor_messages import ExecutorMsg
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import (
    Abort,
    Admit,
    CacheMsg,
    CheckIntegrity,
    FlushCache,
    FlushDeadline,
    FlushWhenIdle,
    Output,
    Outputs,
    Pace,
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
from shoal.actors.replies import answer, refuse
from shoal.actors.scheduler.pacing import Pacer
from shoal.actors.scheduler.planner import Planner
from shoal.actors.scheduler.planner_transfers import concerns
from shoal.actors.supervise import Fatal, FaultInjector, fail_replies, serve
from shoal.actors.transfer_messages import TransferMsg
from shoal.results import InternalError, OperationRefused

log = logging.getLogger("shoal.scheduler")


class Scheduler:
    def __init__(
        self,
        planner: Planner,
        max_inflight: int,
        mailbox: Mailbox[SchedulerMsg],
        cache: Mailbox[CacheMsg],
        executor: Mailbox[ExecutorMsg],
        tokenizer: Mailbox[TokenizerMsg],
        pacer: Pacer,
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
        self.pacer = pacer  # when to plan, when to process a result (pacing.py)
        self.flushes: dict[int, tuple[asyncio.Future[None], asyncio.TimerHandle]] = {}
        self.parks: list[asyncio.Future[None]] = []
        self.faults = faults
        self.transfer = transfer  # disaggregation's transfer actor (actors/transfer/kv_transfer.py)
        self.for_tokenizer: list[TokenizerMsg] = []  # outputs and releases, sent at turn end

    async def run(self) -> None:
        await serve("scheduler", self.mailbox, self.faults, self.handle, self.recover)

    async def handle(self, msg: SchedulerMsg) -> None:
        if isinstance(msg, Shutdown):
            return
        self.apply(msg)
        self._process_due()
        self._maybe_plan()  # the next step goes out before this one's outputs
        self._when_quiet()
        self._send_transfers()
        self._deliver()

    def recover(self, msg: SchedulerMsg, error: InternalError) -> None:
        """One message failed (actors/supervise.py): end the request or operation it stood
        for. A plan that could not be applied leaves unknown which rows and pages are held:
        that stops the engine."""
        fail_replies(msg, error)
        planner = self.planner
        match msg:
            case Admit(rid=rid) if rid not in planner.reqs:
                self.for_tokenizer.append(Outputs((Output(rid, (), "error", str(error)),)))
                self.for_tokenizer.append(Released((rid,)))
            case Admit(rid=rid) | Abort(rid=rid):
                self._send(planner.fail(rid, str(error)))
            case StepDone(batch_id=batch_id) if batch_id in planner.batches:
                self._send(planner.process(StepDone(batch_id, (), error=str(error))))
            case FlushDeadline(flush_id=flush_id) if flush_id in self.flushes:
                reply, _ = self.flushes.pop(flush_id)
                refuse(reply, error)
            case Plan():
                raise Fatal("the scheduler could not apply a plan") from error
            case TransferEnded(rid=rid) as ended if concerns(planner.reqs.get(rid), ended):
                # the transfer is over, whatever failed (for its pages too, unless held)
                planner.reqs[rid].transfer_open = ended.held
                self._send(planner.fail(rid, str(error)))
        self._maybe_plan()
        self._send_transfers()
        self._deliver()

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
                self.pacer.launched(launch.batch_id if launch else None)
            case TransferEnded() as ended:
                self._send(planner.transfer_ended(ended))
            case StepDone() as done:
                if self.pacer.may_process(done):
                    self._send(planner.process(done))
            case Snapshot(reply=reply):
                held = self.pacer.held_results()
                answer(reply, msgspec.structs.replace(planner.snapshot(), held_results=held))
            case FlushWhenIdle(flush_id=flush_id, timeout_s=timeout_s, reply=reply):
                loop = asyncio.get_running_loop()
                timer = loop.call_later(timeout_s, self.mailbox.put, FlushDeadline(flush_id))
                self.flushes[flush_id] = (reply, timer)
            case FlushDeadline(flush_id=flush_id):
                if flush_id in self.flushes:
                    reply, _ = self.flushes.pop(flush_id)
                    busy = planner.snapshot().busy_summary()
                    why = f"not flushed: the engine did not become idle in time ({busy})"
                    refuse(reply, OperationRefused(why, "engine_busy"))
            case SetPaused(paused=paused):
                planner.set_paused(paused)
                if not paused:  # a pause's retraction is moot once generation continues
                    for parked in self.parks:  # (a writer's: continue waits for its end)
                        answer(parked, None)
                    self.parks.clear()
            case Park(reply=reply):
                planner.park_all()
                self.parks.append(reply)
            case Pace(order=order):
                self.pacer = self.pacer.told(order)

    def _send(self, outputs: list[Output]) -> None:
        """For the tokenizer, in order, once this message's turn is over (`_deliver`)."""
        for rids, tokens in self.planner.take_steady():
            self.for_tokenizer.append(Outputs((), rids, tokens))
        if outputs:
            self.for_tokenizer.append(Outputs(tuple(outputs)))
        released = self.planner.take_released()
        if released:
            self.for_tokenizer.append(Released(tuple(released)))

    def _deliver(self) -> None:
        """What `_send` kept, to the tokenizer: after the turn's plan request went out, so
        the next step is planned (and on its way to the device) while the tokenizer actor
        detokenizes and streams this one's outputs."""
        for msg in self.for_tokenizer:
            self.tokenizer.put(msg)
        self.for_tokenizer.clear()

    def _send_transfers(self) -> None:
        for msg in self.planner.take_transfers():
            assert self.transfer is not None, "a transfer without disaggregation"
            self.transfer.put(msg)

    def _process_due(self) -> None:
        """The results the pacer kept and hands back now."""
        for done in self.pacer.due():
            self._send(self.planner.process(done))

    def _maybe_plan(self) -> None:
        planner = self.planner
        if planner.plan_pending or not self.pacer.may_plan():
            return
        if len(planner.batches) >= self.max_inflight:
            self.pacer.launched(None)  # the pipeline is full
            return
        request = planner.propose(self.step)
        if request is None:
            self.pacer.launched(None)
            return
        self.step += 1
        self.cache.put(request)  # the Plan that answers it says what was launched

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
