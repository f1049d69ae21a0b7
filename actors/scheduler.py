"""The scheduler actor: owns every live request (through its Planner) and drives steps.

One step is one round trip: PlanRequest → cache manager → Plan → Launch → executor →
StepDone. Up to `max_inflight` launches are outstanding at once, so the results of step N
are processed while step N+1 runs.
"""

from __future__ import annotations

import logging

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import (
    Abort,
    Admit,
    CacheMsg,
    CheckIntegrity,
    ExecutorMsg,
    Outputs,
    Plan,
    Released,
    SchedulerMsg,
    Shutdown,
    Snapshot,
    StepDone,
    TokenizerMsg,
)
from shoal.actors.planner import Planner

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

    async def run(self) -> None:
        planner = self.planner
        while True:
            outputs = []
            match await self.mailbox.get():
                case Admit() as admit:
                    planner.add(admit)
                case Abort(rid=rid, reason=reason, message=message):
                    outputs = planner.abort(rid, reason, message)
                case Plan() as plan:
                    launch = planner.apply_plan(plan)
                    outputs = planner.take_errors()
                    if launch is not None:
                        self.executor.put(launch)
                case StepDone() as done:
                    outputs = planner.process(done)
                case Snapshot(reply=reply):
                    if not reply.done():
                        reply.set_result(planner.snapshot())
                case Shutdown():
                    return
            if outputs:
                self.tokenizer.put(Outputs(tuple(outputs)))
            released = planner.take_released()
            if released:
                self.tokenizer.put(Released(tuple(released)))
            self._maybe_plan()
            self._check_when_idle()

    def _maybe_plan(self) -> None:
        planner = self.planner
        if planner.plan_pending or len(planner.batches) >= self.max_inflight:
            return
        request = planner.propose(self.step)
        if request is not None:
            self.step += 1
            self.cache.put(request)

    def _check_when_idle(self) -> None:
        idle = self.planner.idle
        if idle and not self.was_idle:
            self.cache.put(CheckIntegrity())
        self.was_idle = idle
