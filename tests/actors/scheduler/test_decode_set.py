"""The decode set (actors/scheduler/decode_set.py) changes how a steady step is computed, not
what it does: with it and without it, the same workload (arrivals, finishes by EOS, stop ids,
min and max tokens, aborts, retractions for want of pages, logprobs) gives the same launches
step by step, the same outputs and the same releases, and the cache checks clean."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from planner_sim import Sim

from shoal.actors.executor_messages import Launch
from shoal.actors.messages import Output
from shoal.actors.scheduler import decode_set
from shoal.actors.scheduler.decode_set import DecodeSet
from shoal.actors.scheduler.launched_batches import LaunchedBatches

DEFAULT_MIN_MEMBERS = decode_set.MIN_MEMBERS
EOS = 17  # one of the fake device's tokens (3..91), so requests end at different times


@pytest.fixture(autouse=True)
def small_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """These workloads run a handful of requests: let them make decode sets."""
    monkeypatch.setattr(decode_set, "MIN_MEMBERS", 1)


@dataclass
class Trace:
    launches: list[tuple[object, ...]] = field(default_factory=list)
    outputs: dict[str, list[Output]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    steady_launches: int = 0


def launch_key(launch: Launch) -> tuple[object, ...]:
    seqs = tuple((s.row, s.start, s.num_tokens, s.input_ids, s.sample) for s in launch.seqs)
    return (launch.decode_rows, launch.decode_starts, seqs, launch.writes)


def workload(seed: int, num_pages: int) -> Trace:
    """Requests arrive in waves and some are aborted; the device answers in launch order,
    up to two launches in flight."""
    rng = random.Random(seed)
    sim = Sim(num_pages=num_pages, page_size=4, num_rows=8, eos=(EOS,), chunk_size=8)
    trace = Trace()
    arrivals = {0: 6, 40: 3, 90: 4}
    live: list[str] = []
    counter = 0
    for step in range(2000):
        for _ in range(arrivals.get(step, 0)):
            rid = f"r{counter}"
            counter += 1
            extra: dict[str, object] = {}
            if rng.random() < 0.3:
                extra["stop_token_ids"] = (rng.randrange(3, 92),)
            if rng.random() < 0.3:
                extra["min_new_tokens"] = rng.randrange(1, 8)
            if seed % 3 == 0 and rng.random() < 0.15:
                extra["logprobs"] = True  # the per-request code takes its steps
            prompt = [rng.randrange(3, 92) for _ in range(rng.randrange(1, 14))]
            max_new = rng.randrange(2, 48)
            sim.add(rid, prompt, max_new_tokens=max_new, ignore_eos=rng.random() < 0.5, **extra)
            live.append(rid)
        if step in (25, 60, 130) and live:
            victim = live.pop(rng.randrange(len(live)))
            sim.record(sim.planner.abort(victim, "abort", "test abort"))
        if sim.planner.idle and step > max(arrivals):
            break
        if len(sim.launched) < sim.max_inflight and sim.plan_and_launch():
            if sim.last_launch is not None:
                trace.launches.append(launch_key(sim.last_launch))
            continue
        if sim.launched:
            sim.complete_one()
    assert sim.planner.idle
    assert sim.cache.check(loud=True) is None
    trace.outputs, trace.released = sim.outputs, sim.released
    return trace


def run(
    seed: int,
    num_pages: int,
    with_set: bool,
    monkeypatch: pytest.MonkeyPatch,
    recent_steps: int = decode_set.RECENT_STEPS,
) -> Trace:
    with monkeypatch.context() as patch:
        patch.setattr(decode_set, "RECENT_STEPS", recent_steps)
        counts = {"steady": 0}
        form_steady = LaunchedBatches.form_steady

        def counting(self: LaunchedBatches, *args: object) -> Launch | None:
            counts["steady"] += 1
            return form_steady(self, *args)  # type: ignore[arg-type]

        patch.setattr(LaunchedBatches, "form_steady", counting)
        if not with_set:
            patch.setattr(DecodeSet, "of", classmethod(lambda cls, reqs: None))
        trace = workload(seed, num_pages)
        trace.steady_launches = counts["steady"]
    return trace


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_pages", [64, 14])  # 14: extensions fail, requests retract
@pytest.mark.parametrize("recent_steps", [64, 3])  # 3: kept tokens go back to the lists often
def test_the_decode_set_changes_nothing_a_step_does(
    seed: int, num_pages: int, recent_steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_set = run(seed, num_pages, True, monkeypatch, recent_steps)
    without = run(seed, num_pages, False, monkeypatch)
    assert with_set.launches == without.launches
    assert with_set.outputs == without.outputs
    assert with_set.released == without.released
    assert without.steady_launches == 0


def test_the_workloads_end_requests_every_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above sees each way to finish, and the decode set forms many of its
    launches."""
    finishes: set[object] = set()
    steady = launches = 0
    for seed in range(6):
        for num_pages in (64, 14):
            trace = run(seed, num_pages, True, monkeypatch)
            finishes |= {outs[-1].finish for outs in trace.outputs.values()}
            steady += trace.steady_launches
            launches += len(trace.launches)
    assert {"stop", "length", "abort"} <= finishes
    assert steady >= launches // 4


def test_a_finished_member_is_released_only_after_its_last_batch() -> None:
    """Law 3 inside the set: a member that finished on one batch's token while the next
    batch (launched before the finish was known) still reads its row is released only after
    that batch came back, and the token that batch sampled for it is discarded."""
    sim = Sim(page_size=4, max_inflight=2)
    # alone it decodes 56, 69, 34, 24, 77, 36, ...: its stop id ends it at the fifth
    sim.add("short", [5, 6, 7], max_new_tokens=20, ignore_eos=True, stop_token_ids=(77,))
    sim.add("long", [8, 9, 10], max_new_tokens=30, ignore_eos=True)
    reading: list[bool] = []  # after each result while "short" is finished, not released
    row = -1
    while not sim.planner.idle:
        if len(sim.launched) < sim.max_inflight and sim.plan_and_launch():
            if "short" in sim.released:  # no launched batch reads its row any more
                assert row >= 0
                assert all(s.row != row for launch in sim.launched for s in launch.all_seqs())
            continue
        sim.complete_one()
        decode_set = sim.planner.steady.decode_set
        if decode_set is None or "short" in sim.released:
            continue
        for dying in decode_set.dying:
            in_flight = [b for b in sim.planner.batches.values() if dying in b.decodes]
            assert dying.rid == "short" and dying.inflight == len(in_flight)
            assert dying.row is not None
            row = dying.row
            reading.append(bool(in_flight))
    assert reading == [True]  # finished with a batch still reading its row
    assert "short" in sim.released
    assert sim.tokens("short") == [56, 69, 34, 24, 77] and sim.finish("short") == "stop"
    assert len(sim.tokens("long")) == 30


def run_counting_steady(sim: Sim) -> int:
    """Run the simulation to the end; how many launches a decode set formed."""
    steady = 0
    while not sim.planner.idle:
        if len(sim.launched) < sim.max_inflight and sim.plan_and_launch():
            steady += sim.planner.steady.decode_set is not None
            continue
        sim.complete_one()
    return steady


def test_min_new_tokens_hold_back_a_stop_inside_the_set() -> None:
    """Alone, [8, 9, 10] decodes 17 as its 4th, 9th and 15th tokens: with stop id 17 and at
    least 10 tokens, the first two do not end it, the third does; beside it, a request that
    ignores EOS keeps the set alive."""
    sim = Sim(page_size=4)
    sim.add("a", [8, 9, 10], max_new_tokens=40, stop_token_ids=(17,), min_new_tokens=10)
    sim.add("b", [5, 6, 7], max_new_tokens=40, ignore_eos=True)
    steady = run_counting_steady(sim)
    tokens = sim.tokens("a")
    assert steady > 20
    assert [i + 1 for i, t in enumerate(tokens) if t == 17] == [4, 9, 15] and len(tokens) == 15
    assert sim.finish("a") == "stop" and len(sim.tokens("b")) == 40


@pytest.mark.parametrize("running", [DEFAULT_MIN_MEMBERS - 1, DEFAULT_MIN_MEMBERS])
def test_a_set_is_made_only_for_enough_requests(
    running: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below MIN_MEMBERS running requests the per-request code is cheaper, and plans."""
    monkeypatch.setattr(decode_set, "MIN_MEMBERS", DEFAULT_MIN_MEMBERS)
    sim = Sim(page_size=4, num_rows=running, num_pages=running * 16)
    for i in range(running):
        sim.add(f"r{i}", [5 + i, 6, 7], max_new_tokens=12, ignore_eos=True)
    steady = run_counting_steady(sim)
    assert all(len(sim.tokens(f"r{i}")) == 12 for i in range(running))
    assert (steady > 0) == (running >= DEFAULT_MIN_MEMBERS)
