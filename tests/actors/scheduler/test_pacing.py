"""The scheduler's pacer (actors/scheduler/pacing.py) on plain data: FreeRun lets everything
through and keeps nothing; a Stepper plans once per Advance and processes once per Deliver
while held, keeps results in arrival order, and runs freely once released."""

from __future__ import annotations

import asyncio

import pytest

from shoal.actors.messages import StepDone
from shoal.actors.scheduler.pacing import (
    Advance,
    Deliver,
    FreeRun,
    Hold,
    Pacer,
    Release,
    Stepper,
)


def done(batch_id: int) -> StepDone:
    return StepDone(batch_id, (1,))


async def test_free_run_plans_and_processes_everything_and_keeps_nothing() -> None:
    pacer: Pacer = FreeRun()
    assert pacer.may_plan() and pacer.may_process(done(0))
    pacer.launched(0)
    assert pacer.due() == [] and pacer.held_results() == ()
    assert pacer.told(Release()) is pacer


async def test_a_step_asked_while_running_freely_is_refused() -> None:
    loop = asyncio.get_running_loop()
    for pacer in (FreeRun(), FreeRun().told(Hold()).told(Release())):
        advanced: asyncio.Future[int | None] = loop.create_future()
        delivered: asyncio.Future[int] = loop.create_future()
        assert pacer.told(Advance(advanced)).told(Deliver(delivered)) is pacer
        for reply in (advanced, delivered):
            with pytest.raises(RuntimeError, match="not held"):
                await reply


async def test_held_it_plans_once_per_advance_and_answers_with_the_launch() -> None:
    loop = asyncio.get_running_loop()
    pacer = FreeRun().told(Hold())
    assert isinstance(pacer, Stepper)
    assert not pacer.may_plan()  # no Advance yet
    first: asyncio.Future[int | None] = loop.create_future()
    second: asyncio.Future[int | None] = loop.create_future()
    pacer.told(Advance(first)).told(Advance(second))
    assert pacer.may_plan()
    pacer.launched(None)  # nothing to plan: the first Advance is answered None
    assert first.result() is None and not second.done()
    assert pacer.may_plan()
    pacer.launched(7)
    assert second.result() == 7
    assert not pacer.may_plan()


async def test_held_it_keeps_results_and_hands_one_per_deliver_in_arrival_order() -> None:
    loop = asyncio.get_running_loop()
    pacer = FreeRun().told(Hold())
    assert not pacer.may_process(done(3)) and not pacer.may_process(done(4))
    assert pacer.held_results() == (3, 4) and pacer.due() == []
    delivered: asyncio.Future[int] = loop.create_future()
    pacer.told(Deliver(delivered))
    assert pacer.due() == [done(3)] and delivered.result() == 3
    assert pacer.held_results() == (4,) and pacer.due() == []
    waiting: asyncio.Future[int] = loop.create_future()
    pacer.told(Deliver(waiting))  # waits for a result to come back
    assert pacer.due() == [done(4)] and waiting.result() == 4
    later: asyncio.Future[int] = loop.create_future()
    pacer.told(Deliver(later))
    assert pacer.due() == [] and not later.done()
    assert not pacer.may_process(done(5))
    assert pacer.due() == [done(5)] and later.result() == 5


async def test_released_it_hands_back_every_kept_result_and_runs_freely() -> None:
    pacer = FreeRun().told(Hold())
    for batch_id in (1, 2):
        assert not pacer.may_process(done(batch_id))
    assert pacer.told(Release()) is pacer
    assert pacer.due() == [done(1), done(2)] and pacer.held_results() == ()
    assert pacer.may_plan() and pacer.may_process(done(3))
    pacer.told(Hold())
    assert not pacer.may_plan() and not pacer.may_process(done(4))
