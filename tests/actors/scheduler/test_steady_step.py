"""A steady decode step asks the cache manager for nothing it already has (issue 31, item 2),
and the scheduler sends the next step on its way before it hands a step's outputs to the
tokenizer (item 3)."""

from __future__ import annotations

from typing import Any

from planner_sim import Sim

from shoal.actors.executor_messages import Launch
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import Admit, PlanRequest
from shoal.actors.scheduler.pacing import FreeRun
from shoal.actors.scheduler.planner import Planner
from shoal.actors.scheduler.scheduler import Scheduler
from shoal.params import SamplingParams


def run_recording_extends(sim: Sim) -> list[tuple[str, int]]:
    """Run the simulation to the end; every extension the plans asked for, in order."""
    asked: list[tuple[str, int]] = []
    propose = sim.planner.propose

    def recording(step: int) -> PlanRequest | None:
        request = propose(step)
        if request is not None:
            asked.extend((e.rid, e.total_tokens) for e in request.extends)
        return request

    sim.planner.propose = recording  # type: ignore[method-assign]
    sim.run()
    return asked


def test_a_decode_is_extended_only_when_it_crosses_a_page() -> None:
    """Page size 4, a 5-token prompt: admission covers positions 0-7, so of the 19 decodes
    (positions 5-23) only those at 8, 12, 16 and 20 need a page."""
    sim = Sim(page_size=4, max_inflight=2)
    sim.add("a", [3, 4, 5, 6, 7], max_new_tokens=20, ignore_eos=True)
    assert run_recording_extends(sim) == [("a", 9), ("a", 13), ("a", 17), ("a", 21)]
    assert len(sim.tokens("a")) == 20


def test_requests_extend_at_their_own_boundaries_and_decode_alike() -> None:
    """Three requests with prompts of 4, 6 and 7 tokens: each asks for a page exactly when its
    next position is the first of one, and their tokens equal each one's alone."""
    prompts = {"a": [5, 6, 7, 8], "b": [9, 3, 4, 5, 6, 7], "c": [11, 12, 13, 3, 4, 5, 6]}
    sim = Sim(page_size=4)
    for rid, prompt in prompts.items():
        sim.add(rid, prompt, max_new_tokens=10, ignore_eos=True)
    asked = run_recording_extends(sim)
    for rid, prompt in prompts.items():
        mine = [total for r, total in asked if r == rid]
        # decodes at positions len(prompt) .. len(prompt) + 8; a page starts at multiples of 4
        crossing = [p + 1 for p in range(len(prompt), len(prompt) + 9) if p % 4 == 0]
        assert mine == [p for p in crossing if p > -(-len(prompt) // 4) * 4], rid
        alone = Sim(page_size=4)
        alone.add(rid, prompt, max_new_tokens=10, ignore_eos=True)
        alone.run()
        assert sim.tokens(rid) == alone.tokens(rid)


class Recorder(Mailbox[Any]):
    """A mailbox that writes each message, with its own name, into a log it shares."""

    def __init__(self, name: str, log: list[tuple[str, object]]) -> None:
        super().__init__(name)
        self.log = log

    def put(self, msg: Any) -> None:
        self.log.append((self.name, msg))
        super().put(msg)


async def test_the_next_step_is_planned_before_a_step_outputs_are_delivered() -> None:
    """One launch in flight at most: each result frees the pipeline, so the turn that takes
    it plans the next step too, and sends that first."""
    log: list[tuple[str, object]] = []
    sim = Sim(page_size=4)
    planner = Planner(sim.planner.config)
    scheduler = Scheduler(
        planner,
        1,
        Recorder("scheduler", log),
        Recorder("cache", log),
        Recorder("executor", log),
        Recorder("tokenizer", log),
        FreeRun(),
    )
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    await scheduler.handle(Admit("a", (3, 4, 5, 6, 7), greedy, 0))
    answered = 0
    while answered < len(log):  # the cache manager's and the device's answers, in order
        _, msg = log[answered]
        answered += 1
        if isinstance(msg, PlanRequest):
            await scheduler.handle(sim.cache.plan(msg))
        elif isinstance(msg, Launch):
            await scheduler.handle(sim.device.run(msg))
    sent = [(name, type(msg).__name__) for name, msg in log]
    results = [i for i, (_, kind) in enumerate(sent) if kind == "Outputs"]
    assert len(results) == 8  # one a token, the request ran to its end
    for i in results[:-1]:  # each result but the last also planned the next step, first
        assert sent[i - 1] == ("cache", "PlanRequest"), sent
    assert planner.idle or planner.reqs["a"].finish == "length"
