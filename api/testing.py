"""The engine's test hooks, in one namespace: `engine.testing`.

    engine.testing.hold()                  # stop the scheduler between steps
    stream = engine.generate(...)
    batch = await engine.testing.advance() # plan and launch one step: its batch id, or None
    await engine.testing.deliver()         # process the oldest result (waits for it)
    engine.testing.release()               # run freely again
    engine.testing.faults.arm("scheduler", "Admit")   # fail one message (actors/supervise.py)
    engine.testing.stages.hold(1)          # hold a pipeline stage (actors/executor/stages.py)

Stepping is the scheduler's pacer's (actors/scheduler/pacing.py); its orders go through the
tokenizer's mailbox like every control message, so an `advance()` never overtakes the
`generate()` before it. Production code never calls these.
"""

from __future__ import annotations

from collections.abc import Callable

from shoal.actors.executor.stages import StageMonitor
from shoal.actors.messages import Pace
from shoal.actors.replies import ask
from shoal.actors.scheduler.pacing import Advance, Deliver, Hold, PaceOrder, Release
from shoal.actors.supervise import FaultInjector
from shoal.actors.wiring import Actors


class EngineTesting:
    def __init__(self, actors: Callable[[], Actors]) -> None:
        """`actors`: the engine's running actors (raising if it is not started or dead)."""
        self._actors = actors
        self.faults = FaultInjector()  # armed before or after the start: the actors share it

    @property
    def stages(self) -> StageMonitor:
        """The pipeline stages' microbatch counts, and the seam to hold a stage or fail its
        next microbatch; one stage without `pipeline_stages`."""
        return self._actors().stages

    def hold(self) -> None:
        """Stop the scheduler between steps: nothing is planned or processed until
        `advance()` / `deliver()`; `release()` lets it run freely again."""
        self._order(Hold())

    def release(self) -> None:
        self._order(Release())

    async def advance(self) -> int | None:
        """Plan and launch one step; the launched batch id, or None if nothing to launch.
        RuntimeError unless held."""
        box = self._actors().tokenizer_box
        return await ask(box, lambda reply: Pace(Advance(reply)))

    async def deliver(self) -> int:
        """Process the oldest launched batch's result (waiting for it); its batch id.
        RuntimeError unless held."""
        box = self._actors().tokenizer_box
        return await ask(box, lambda reply: Pace(Deliver(reply)))

    def _order(self, order: PaceOrder) -> None:
        self._actors().tokenizer_box.put(Pace(order))
