"""The scheduler's planning, driven with the real KVCache and a fake executor: no model,
no asyncio, milliseconds. Checks laws 1-3 and 5 (docs/architecture.md, "Lifecycle laws")
step by step."""

from __future__ import annotations

import pytest
from planner_sim import Sim, solo

from shoal.actors.scheduler.request import Phase

PROMPTS = {f"r{i}": [(i * 13 + j * 5) % 50 + 3 for j in range(5 + 7 * i)] for i in range(6)}


@pytest.mark.parametrize("max_inflight", [1, 2, 3])
@pytest.mark.parametrize("chunk_size", [3, 64])
def test_batched_tokens_equal_solo_tokens(max_inflight: int, chunk_size: int) -> None:
    sim = Sim(max_inflight=max_inflight, chunk_size=chunk_size)
    for rid, prompt in PROMPTS.items():
        sim.add(rid, prompt, max_new_tokens=9)
    sim.run()
    for rid, prompt in PROMPTS.items():
        assert sim.tokens(rid) == solo(prompt, max_new_tokens=9)
        assert sim.finish(rid) == "length"
        assert len(sim.tokens(rid)) == 9
    assert sorted(sim.released) == sorted(PROMPTS)


def test_chunked_prefill_keeps_one_row_and_samples_once() -> None:
    sim = Sim(chunk_size=4, max_inflight=1)
    sim.add("a", list(range(3, 16)), max_new_tokens=1)
    launches = []
    while sim.plan_and_launch():
        if sim.last_launch is not None:
            launches.append(sim.last_launch)
            sim.complete_one()
    seqs = [launch.all_seqs()[0] for launch in launches]
    assert [s.start for s in seqs] == [0, 4, 8, 12]
    assert len({s.row for s in seqs}) == 1
    assert [s.sample for s in seqs] == [False, False, False, True]
    assert seqs[0].init is not None and all(s.init is None for s in seqs[1:])


@pytest.mark.parametrize("cap", [0, 5, 16])
def test_a_step_that_decodes_takes_at_most_the_mixed_prefill_cap(cap: int) -> None:
    sim = Sim(chunk_size=64, max_inflight=1, max_mixed_prefill_tokens=cap)
    sim.add("first", [4] * 10, max_new_tokens=12)
    assert sim.plan_and_launch()
    sim.complete_one()  # "first" decodes from here on
    for rid, prompt in PROMPTS.items():
        sim.add(rid, prompt, max_new_tokens=3)
    prefill_with_decodes = []
    while not sim.planner.idle:
        if not sim.launched and sim.plan_and_launch():
            continue
        launch = sim.launched[0]
        decodes = sum(1 for seq in launch.all_seqs() if seq.input_ids is None)
        prompt_tokens = sum(
            seq.num_tokens for seq in launch.all_seqs() if seq.input_ids is not None
        )
        if decodes:
            prefill_with_decodes.append(prompt_tokens)
        sim.complete_one()
    # No cap: every prompt (135 tokens, each under chunk_size) rides with the first decode.
    assert max(prefill_with_decodes) == (cap or sum(len(p) for p in PROMPTS.values()))
    for rid, prompt in PROMPTS.items():  # the cap changes when tokens come, never which
        assert sim.tokens(rid) == solo(prompt, max_new_tokens=3)


def test_finished_request_keeps_row_until_the_later_batch_completes() -> None:
    sim = Sim(max_inflight=2)
    sim.add(
        "a", [5, 6, 7], max_new_tokens=8, stop_token_ids=(solo([5, 6, 7], max_new_tokens=1)[0],)
    )
    assert sim.plan_and_launch()  # prefill, samples the stop token
    assert sim.plan_and_launch()  # speculative decode launched before the result is known
    sim.complete_one()
    assert sim.finish("a") == "stop"
    assert sim.planner.reqs["a"].phase is Phase.FINISHING
    # The row is still read by the second launch: it must not be released yet.
    request = sim.planner.propose(sim.step_no)
    assert request is None or not request.releases
    if request is not None:
        sim.planner.apply_plan(sim.cache.plan(request))
    assert sim.kv.holds("a")
    sim.complete_one()  # its extra token is discarded
    assert sim.tokens("a") == solo([5, 6, 7], max_new_tokens=1)
    sim.run()
    assert sim.released == ["a"]


def test_decodes_never_run_past_max_new_tokens() -> None:
    sim = Sim(max_inflight=3)
    sim.add("a", [9, 9, 9], max_new_tokens=4)
    sampled = 0
    while not sim.planner.idle:
        if len(sim.launched) < 3 and sim.plan_and_launch():
            if sim.last_launch is not None:
                sampled += sum(s.sample for s in sim.last_launch.all_seqs())
            continue
        sim.complete_one()
    assert sampled == 4


@pytest.mark.parametrize("stage", ["waiting", "prefill", "launched", "running", "finishing"])
def test_abort_at_every_stage_releases_everything(stage: str) -> None:
    # "running" means decoding with no batch in flight, which needs a depth-1 pipeline.
    sim = Sim(chunk_size=4, max_inflight=1 if stage == "running" else 2, num_rows=1)
    sim.add("blocker", [3] * 6, max_new_tokens=3)
    sim.add("a", list(range(3, 30)), max_new_tokens=6)
    free_pages = sim.kv.stats().free_pages
    target = {
        "waiting": Phase.WAITING,
        "prefill": Phase.PREFILL,
        "launched": Phase.RUNNING,
        "running": Phase.RUNNING,
        "finishing": Phase.FINISHING,
    }[stage]
    for _ in range(200):
        req = sim.planner.reqs.get("a")
        in_flight = req is not None and req.inflight > 0
        if (
            req is not None
            and req.phase is target
            and (stage != "launched" or in_flight)
            and (stage != "running" or not in_flight)
        ):
            break
        if len(sim.launched) < sim.max_inflight and sim.plan_and_launch():
            continue
        sim.complete_one()
    else:
        pytest.fail(f"never reached {stage}")
    sim.record(sim.planner.abort("a", "abort", "by test"))
    sim.run()
    finishes = [o.finish for o in sim.outputs.get("a", []) if o.finish]
    assert finishes == (["length"] if stage == "finishing" else ["abort"])
    assert "a" in sim.released
    stats = sim.kv.stats()
    assert stats.free_rows == stats.total_rows
    assert stats.request_pages == stats.locked_pages == 0
    assert stats.free_pages + stats.evictable_pages == free_pages


def test_out_of_pages_retracts_the_youngest_and_tokens_survive() -> None:
    # Three short prompts admit together, then outgrow the pool (3 x 9 pages > 16).
    sim = Sim(num_pages=16, page_size=2, max_inflight=2)
    prompts = {rid: [*PROMPTS["r0"][:4], i + 3] for i, rid in enumerate(("a", "b", "c"))}
    for rid, prompt in prompts.items():
        sim.add(rid, prompt, max_new_tokens=13)
    sim.run()
    assert sim.planner.num_retractions > 0
    for rid, prompt in prompts.items():
        assert sim.tokens(rid) == solo(prompt, max_new_tokens=13)
        assert sim.finish(rid) == "length"


def test_running_cap_queues_the_rest() -> None:
    sim = Sim(num_rows=2, max_inflight=2)
    for rid, prompt in PROMPTS.items():
        sim.add(rid, prompt, max_new_tokens=3)
    while not sim.planner.idle:
        assert len(sim.planner.holding()) <= 2
        if len(sim.launched) < 2 and sim.plan_and_launch():
            continue
        sim.complete_one()
    assert sorted(sim.released) == sorted(PROMPTS)


def test_rows_are_reused_only_after_every_reader_completed() -> None:
    """Law 3 (docs/architecture.md): no two launches pending at once use one row for two
    different requests."""
    sim = Sim(num_rows=2, max_inflight=3)
    for rid, prompt in PROMPTS.items():
        sim.add(rid, prompt, max_new_tokens=6, stop_token_ids=tuple(range(3, 30)))
    reuses = 0
    last_owner: dict[int, str] = {}
    while not sim.planner.idle:
        if len(sim.launched) < 3 and sim.plan_and_launch():
            owners_per_launch = []
            for launch in sim.launched:
                rids = [m.rid for m in sim.planner.batches[launch.batch_id].members()]
                owners_per_launch.append(
                    {s.row: rid for s, rid in zip(launch.all_seqs(), rids, strict=False)}
                )
            for row in {row for owners in owners_per_launch for row in owners}:
                assert len({o[row] for o in owners_per_launch if row in o}) == 1
            for row, rid in owners_per_launch[-1].items() if owners_per_launch else ():
                reuses += last_owner.get(row, rid) != rid
                last_owner[row] = rid
            continue
        sim.complete_one()
    assert reuses >= 4  # rows really were handed from one request to the next


def test_prefix_hit_on_a_repeated_prompt() -> None:
    sim = Sim(page_size=4)
    prompt = list(range(3, 23))
    sim.add("first", prompt, max_new_tokens=3)
    sim.run()
    sim.add("again", prompt, max_new_tokens=3)
    sim.run()
    first = [o.num_cached_tokens for o in sim.outputs["first"] if o.num_cached_tokens is not None]
    again = [o.num_cached_tokens for o in sim.outputs["again"] if o.num_cached_tokens is not None]
    assert first == [0] and again == [16]
    assert sim.tokens("again") == sim.tokens("first")


@pytest.mark.parametrize("max_inflight", [1, 2])
def test_requests_arriving_together_compute_a_shared_prefix_once(max_inflight: int) -> None:
    """One computes the 64-token prefix (publishing its pages as its chunks finish) while the
    others wait; they are then admitted with the prefix cached and prefill only their own
    suffix. Their tokens are what each would get alone."""
    shared = list(range(3, 67))
    prompts = {f"r{i}": [*shared, 70 + i, 80 + i, 90 + i] for i in range(4)}
    sim = Sim(page_size=4, chunk_size=16, max_inflight=max_inflight)
    for rid, prompt in prompts.items():
        sim.add(rid, prompt, max_new_tokens=4)
    prefill_tokens = 0
    overlapped = False  # were the others admitted while r0 still ran (not after its release)?
    while not sim.planner.idle:
        if len(sim.launched) < sim.max_inflight and sim.plan_and_launch():
            launch = sim.last_launch
            if launch is not None:
                prefill_tokens += sum(s.num_tokens for s in launch.all_seqs() if s.input_ids)
            r1 = sim.planner.reqs.get("r1")
            overlapped |= r1 is not None and r1.row is not None and "r0" not in sim.released
            continue
        sim.complete_one()
    assert overlapped
    assert sim.cache.check(loud=True) is None
    cached = {
        rid: next(o.num_cached_tokens for o in sim.outputs[rid] if o.num_cached_tokens is not None)
        for rid in prompts
    }
    assert cached == {"r0": 0, "r1": 64, "r2": 64, "r3": 64}
    assert prefill_tokens == 67 + 3 * 3
    for rid, prompt in prompts.items():
        alone = Sim(page_size=4, chunk_size=16)
        alone.add(rid, prompt, max_new_tokens=4)
        alone.run()
        assert sim.tokens(rid) == alone.tokens(rid)


def test_a_request_that_can_never_fit_ends_with_an_error_not_a_hang() -> None:
    sim = Sim(num_pages=8, page_size=2)
    sim.add("big", list(range(3, 15)), max_new_tokens=8)  # needs 10 pages of 8
    sim.run()
    assert sim.finish("big") == "error"
    assert sim.released == ["big"]


@pytest.mark.parametrize("admits", [True, False])
def test_abort_while_the_admission_is_in_flight(admits: bool) -> None:
    """Law 5 (docs/architecture.md) in the window "admission sent to the cache manager, its
    answer not back yet": the request may already hold a row there, so it must be released,
    not forgotten."""
    sim = Sim(num_rows=1, num_pages=64 if admits else 2, page_size=4)
    sim.add("a", list(range(3, 20)), max_new_tokens=4)
    request = sim.planner.propose(sim.step_no)
    assert request is not None and [a.rid for a in request.admits] == ["a"]
    sim.record(sim.planner.abort("a", "abort", "by test"))  # inside the window
    plan = sim.cache.plan(request)
    assert bool(plan.admitted) == admits  # the cache manager admitted it (or could not)
    assert sim.planner.apply_plan(plan) is None  # nothing of it is launched
    sim.record([])
    sim.run()
    assert [o.finish for o in sim.outputs["a"]] == ["abort"]
    assert sim.released == ["a"]
    stats = sim.kv.stats()
    assert stats.free_rows == stats.total_rows and stats.request_pages == 0
