"""Speculative decoding in the planner (actors/scheduler/speculation.py): which decodes draft,
how a verified chunk's tokens come out and where the row's counters go, against the fake
device's greedy verification (support/planner_sim.py)."""

from __future__ import annotations

import itertools
import random

import pytest
from planner_sim import Sim, solo

from shoal.actors.executor_messages import Launch
from shoal.actors.scheduler.ngram_drafts import NgramDrafts
from shoal.actors.scheduler.request import Req
from shoal.actors.scheduler.speculation import (
    DRAFT_COST,
    PRIOR_KEPT,
    RowDrafts,
    SpecConfig,
    Speculation,
    draft_cost,
    drafts_allowed,
    match_class,
)
from shoal.params import SamplingParams

SPEC = SpecConfig(num_draft_tokens=4, min_n=1, max_n=3, max_batch=4)
CYCLE = list(range(3, 53))  # the counting device's cycle: every draft from it is kept


def drafted_seqs(launches: list[Launch]) -> list[tuple[int, int]]:
    """(start, drafts) of every speculating decode launched."""
    return [(s.start, s.num_drafts) for launch in launches for s in launch.seqs if s.num_drafts]


def decodes(launch: Launch) -> int:
    """The decodes a launch holds, speculating or not (a chunk of one token is a decode)."""
    return len(launch.decode_rows) + sum(
        1 for s in launch.seqs if s.num_drafts or s.input_ids is None
    )


class Recording(Sim):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.all_launches: list[Launch] = []
        self.live: list[int] = []  # requests live when each launch was planned
        self.beside_drafts: list[bool] = []  # ... and whether a speculating one was in flight

    def plan_and_launch(self) -> bool:
        live = len(self.planner.requests.reqs)
        in_flight = bool(drafted_seqs(list(self.launched)))
        planned = super().plan_and_launch()
        if planned and self.last_launch is not None:
            self.all_launches.append(self.last_launch)
            self.live.append(live)
            self.beside_drafts.append(in_flight)
        return planned


def test_copying_request_keeps_every_draft_and_matches_one_at_a_time() -> None:
    sim = Recording(speculative=SPEC, counting=True)
    sim.add("a", CYCLE + CYCLE[:5], max_new_tokens=30, ignore_eos=True)
    sim.run()
    assert sim.tokens("a") == solo(CYCLE + CYCLE[:5], counting=True, max_new_tokens=30)
    spec = sim.planner.spec
    assert spec is not None
    counters = spec.counters
    assert counters.accepted == counters.drafted > 0
    # 30 tokens: the first from the prompt, the second decoded as without drafts (the first
    # on its way), then 5 a step (4 kept drafts and one more: the suffix matches 5 tokens at
    # once, a class whose prior is worth 8 drafts, 4 at most here)
    assert counters.steps == 6 and sim.finish("a") == "length"
    start = len(CYCLE) + 6
    assert drafted_seqs(sim.all_launches)[:3] == [(start, 4), (start + 5, 4), (start + 10, 4)]


@pytest.mark.usefixtures("eager_drafts")  # the hash device's short matches draft too
def test_rejected_drafts_give_the_same_tokens() -> None:
    prompts = {f"r{i}": [(7 * i + j * j) % 40 + 3 for j in range(20 + i)] for i in range(4)}
    sim = Recording(speculative=SPEC, page_size=1)
    for rid, prompt in prompts.items():
        sim.add(rid, prompt, max_new_tokens=25)
    sim.run()
    for rid, prompt in prompts.items():
        assert sim.tokens(rid) == solo(prompt, max_new_tokens=25), rid
    spec = sim.planner.spec
    assert spec is not None and spec.counters.steps > 0


def test_stop_token_among_kept_drafts_ends_there() -> None:
    prompt = CYCLE + CYCLE[:5]
    stop = CYCLE[8]  # the 4th token after the prompt: inside the first verified chunk
    sim = Recording(speculative=SPEC, counting=True)
    sim.add("a", prompt, max_new_tokens=30, stop_token_ids=(stop,))
    sim.run()
    assert sim.tokens("a") == CYCLE[5:9]
    assert sim.finish("a") == "stop"
    assert sum(len(out.token_ids) for out in sim.outputs["a"]) == 4


def test_drafts_never_pass_max_new_tokens() -> None:
    prompt = CYCLE + CYCLE[:5]
    sim = Recording(speculative=SPEC, counting=True)
    sim.add("a", prompt, max_new_tokens=4)
    sim.run()
    assert sim.tokens("a") == CYCLE[5:9]
    # after the first two tokens (the prompt's, then a plain decode) 2 are left: 1 draft and
    # the token after it (4 were worth it)
    assert [k for _, k in drafted_seqs(sim.all_launches)] == [1]


def test_more_running_than_max_batch_speculates_nothing() -> None:
    sim = Recording(speculative=SpecConfig(max_batch=2), counting=True)
    for i in range(3):
        sim.add(f"a{i}", CYCLE + CYCLE[: 5 + i], max_new_tokens=10 + 10 * i)
    sim.run()
    launches = zip(sim.all_launches, sim.live, strict=True)
    live = [n for launch, n in launches if drafted_seqs([launch])]
    assert live and max(live) <= 2  # the last two, once the first ended
    assert all(sim.tokens(f"a{i}") == CYCLE[5 + i : 15 + 11 * i] for i in range(3))


def test_rows_that_arrived_apart_draft_in_one_launch() -> None:
    """A decode launched beside a speculating one in flight would split the rows into groups
    that alternate, each paying a whole step for a part of the rows: no decode is launched
    while any row's drafts are in flight, so the groups merge at its result."""
    sim = Recording(speculative=SPEC, counting=True, num_pages=256)  # no retraction
    prompts = {rid: CYCLE[i:] + CYCLE[: 5 + i] for i, rid in enumerate("abcd")}
    sim.add("a", prompts["a"], max_new_tokens=60, ignore_eos=True)
    assert sim.plan_and_launch()  # a's prefill alone, then the others' together
    for rid in "bcd":
        sim.add(rid, prompts[rid], max_new_tokens=60, ignore_eos=True)
    sim.run()
    for rid, prompt in prompts.items():
        assert sim.tokens(rid) == solo(prompt, counting=True, max_new_tokens=60, ignore_eos=True)
    launched = list(zip(sim.all_launches, sim.beside_drafts, strict=True))
    assert not any(decodes(launch) and beside for launch, beside in launched)
    together = [len(drafted_seqs([launch])) for launch in sim.all_launches]
    assert together.count(4) >= 6, together


def prompt_chunks(launch: Launch | None) -> list[int]:
    """The prompt chunks' lengths of a launch (a speculating decode is not one)."""
    assert launch is not None
    return [s.num_tokens for s in launch.seqs if s.input_ids is not None and not s.num_drafts]


def test_no_drafts_while_a_prompt_waits_or_prefills() -> None:
    """A step with a prompt chunk computes, so a draft beside it costs its whole share; and a
    burst's first request would draft, and wait for its token to, before the rest came (found
    at 16 streams: it lost its overlap and the burst's first tokens came later)."""
    sim = Recording(speculative=SPEC, counting=True, max_mixed_prefill_tokens=8, num_pages=256)
    sim.add("a", CYCLE + CYCLE[:5], max_new_tokens=40, ignore_eos=True)
    assert sim.plan_and_launch()  # a's prompt; its first token on its way
    sim.add("b", CYCLE[7:47], max_new_tokens=20, ignore_eos=True)
    assert sim.plan_and_launch()
    assert decodes(sim.all_launches[-1]) == 1  # a decodes, overlapped, as without drafts ...
    assert prompt_chunks(sim.last_launch) == [8]  # ... beside b's first 8 prompt tokens
    sim.run()
    assert not any(drafted_seqs([launch]) and prompt_chunks(launch) for launch in sim.all_launches)
    assert drafted_seqs(sim.all_launches)  # once b's prompt is in, both draft
    for rid, prompt, most in (("a", CYCLE + CYCLE[:5], 40), ("b", CYCLE[7:47], 20)):
        assert sim.tokens(rid) == solo(prompt, counting=True, max_new_tokens=most, ignore_eos=True)


def test_a_prompt_beside_drafts_in_flight_is_capped_as_beside_decodes() -> None:
    """The mixed-prefill cap keeps a newcomer's prompt from stalling the running streams: a
    row whose drafts are in flight is one of them though it launches nothing this step."""
    sim = Recording(speculative=SPEC, counting=True, max_mixed_prefill_tokens=8, num_pages=256)
    sim.add("a", CYCLE + CYCLE[:5], max_new_tokens=40, ignore_eos=True)
    while not drafted_seqs(list(sim.launched)):  # a's drafts in flight
        if len(sim.launched) < sim.max_inflight and sim.plan_and_launch():
            continue
        sim.complete_one()
    sim.add("c", CYCLE[11:41], max_new_tokens=4, ignore_eos=True)
    assert sim.plan_and_launch()
    assert decodes(sim.all_launches[-1]) == 0 and prompt_chunks(sim.last_launch) == [8]
    sim.run()
    for rid, prompt, most in (("a", CYCLE + CYCLE[:5], 40), ("c", CYCLE[11:41], 4)):
        assert sim.tokens(rid) == solo(prompt, counting=True, max_new_tokens=most, ignore_eos=True)


def copying_row(spec: Speculation, prompt: list[int]) -> Req:
    sim = Sim()
    sim.add("a", prompt, max_new_tokens=200)
    req = sim.planner.requests.reqs["a"]
    assert spec.draft(req, 1) is not None  # its n-gram index built
    req.draft_state = None
    return req


def test_a_row_whose_drafts_fail_backs_off() -> None:
    """Drafts of a 5-token match (its class's prior: worth 8) all refused: fewer each time,
    then one after 1, 2, 4 .. 16 decodes that send none."""
    spec = Speculation(SPEC)
    req = copying_row(spec, CYCLE + CYCLE[:5])
    sent = []
    for _ in range(80):
        drafts = spec.draft(req, 1)
        assert drafts is not None
        sent.append(len(drafts))
        if drafts:
            spec.verified(req, len(drafts), 0)
    assert sent[:8] == [4, 4, 2, 2, 1, 1, 1, 1]
    probes = [i for i, n in enumerate(sent) if n][8:]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps == [2, 3, 5, 9, 17, 17, 17], sent  # each after 1, 2, 4, 8, 16 that sent none
    # one that keeps a draft again is back to its estimate's length at once
    spec.verified(req, 1, 1)
    assert req.draft_state is not None and req.draft_state.backoff[3] == 1


def test_a_row_sends_as_many_drafts_as_its_kept_ones_pay_for() -> None:
    rows = RowDrafts(NgramDrafts())
    # the priors: a match of one token is worth no draft, of 2 two, of 3 four, of 4 or more 8
    assert [match_class(n) for n in (1, 2, 3, 4, 7, 8, 16)] == [0, 1, 2, 3, 3, 4, 4]
    assert [rows.length(c, 8) for c in range(len(PRIOR_KEPT))] == [0, 2, 4, 8, 8]
    rows.kept[1], rows.refused[1] = 9.0, 1.0  # nine in ten
    assert rows.length(1, 8) == 8 and rows.length(1, 4) == 4
    rows.kept[1], rows.refused[1] = 0.0, 5.0
    assert rows.length(1, 8) == 0  # not even one (Speculation waits, then sends one to learn)
    assert rows.length(2, 8) == 4  # each class learns apart
    assert DRAFT_COST < 0.5**2  # two drafts at one in two: worth sending
    # more rows decoding, a draft costs more of a token's time: fewer are worth it
    rows.kept[1], rows.refused[1] = 9.0, 1.0
    assert draft_cost(1) == DRAFT_COST and draft_cost(4) > 0.4 and draft_cost(8) > 0.58
    assert rows.length(1, 8, draft_cost(4)) == 8 and rows.length(1, 8, draft_cost(8)) == 5
    rows.kept[1], rows.refused[1] = 1.0, 1.0
    assert rows.length(1, 8, draft_cost(4)) == 1 and rows.length(1, 8, draft_cost(8)) == 0


def test_a_row_not_worth_one_draft_waits_then_sends_one() -> None:
    """A class whose estimate is below even one draft's cost sends one after 1, 2, 4 ..
    decodes (its estimate moves only by verifications); a match of one token, whose prior is
    below the cost, never drafts."""
    spec = Speculation(SPEC)
    req = copying_row(spec, CYCLE + CYCLE[:5])
    req.draft_state = RowDrafts(NgramDrafts(1, 3, 4))
    req.draft_state.kept[3], req.draft_state.refused[3] = 0.0, 5.0
    assert [len(spec.draft(req, 1) or ()) for _ in range(10)] == [1, 0, 1, 0, 0, 1, 0, 0, 0, 0]
    short = copying_row(spec, [7, 8, 9, 7])  # "7" occurred once: a match of one token
    assert not any(spec.draft(short, 1) for _ in range(40))


def test_a_row_with_a_token_on_its_way_waits_only_for_a_match_worth_drafts() -> None:
    """Its token on its way makes the known match one token longer at most: a row waits for
    it (None, no overlap) when that match is worth drafts, else decodes overlapped; but never
    for its first token, its prompt's (see `Speculation.draft`)."""
    spec = Speculation(SPEC)
    for prompt, waits, then in (
        (CYCLE + CYCLE[:5], True, 4),  # 5 tokens agree, 6 with the next: worth 4 (at most)
        ([7, 8, 9, 7], True, 0),  # one, two with the next: worth 2; in, it agreed in one
        ([7, 8, 9, 10], False, 0),  # none, one with the next: worth none
    ):
        req = copying_row(spec, prompt)
        req.pending = 1
        assert spec.draft(req, 1) == (), prompt  # its first token on its way
        req.num_prompt -= 1  # its last token its first output, its second on its way
        assert (spec.draft(req, 1) is None) == waits, prompt
        req.pending = 0  # (its token in: the same tokens here)
        drafts = spec.draft(req, 1)
        assert drafts is not None and len(drafts) == then, prompt


def test_sampling_that_edits_per_token_never_drafts() -> None:
    assert drafts_allowed(SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1))
    for refused in (
        SamplingParams(repetition_penalty=1.1),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(logit_bias={5: 1.0}),
        SamplingParams(logprobs=True),
        SamplingParams(regex="[a-z]+"),
    ):
        assert not drafts_allowed(refused)
    sim = Recording(speculative=SPEC, counting=True)
    sim.add("a", CYCLE + CYCLE[:5], max_new_tokens=12, presence_penalty=0.5)
    sim.add("b", CYCLE + CYCLE[:5], max_new_tokens=12, min_new_tokens=6, ignore_eos=True)
    sim.run()
    assert sim.tokens("a") == sim.tokens("b") == CYCLE[5:17]
    starts = [start for start, _ in drafted_seqs(sim.all_launches)]
    # only b, and only once its min_new_tokens are out (its stop tokens are masked till then)
    assert starts and min(starts) >= len(CYCLE) + 5 + 6 - 1


def test_retraction_with_drafts_in_flight_loses_nothing() -> None:
    prompts = {f"r{i}": CYCLE[i:] + CYCLE[: 5 + i] for i in range(4)}
    sim = Recording(speculative=SPEC, counting=True, num_pages=40, page_size=4)
    for rid, prompt in prompts.items():
        sim.add(rid, prompt, max_new_tokens=40, ignore_eos=True)
    sim.run()
    for rid, prompt in prompts.items():
        assert sim.tokens(rid) == solo(prompt, counting=True, max_new_tokens=40), rid
    assert sim.planner.num_retractions > 0
    spec = sim.planner.spec
    assert spec is not None and spec.counters.accepted > 0


def test_results_that_land_while_a_plan_is_out_end_no_request() -> None:
    """The scheduler applies a plan when the cache manager answers, and a step's result may
    land first. A row about to draft waits for its token on the way (`draft` answers None),
    so a plan proposed then may launch nothing; applied after the result, it must not leave
    the planner stalled with nothing in flight to wake it (the stress test's hang: a request
    that never finished). Seeded interleavings of arrivals, plans and results."""
    stuck = []
    for seed in range(60):
        rng = random.Random(seed)
        sim = Recording(
            speculative=SPEC, counting=True, max_inflight=rng.choice([1, 2]),
            chunk_size=rng.choice([8, 16, 64]),
        )  # fmt: skip
        prompts = {}
        for i in range(rng.randint(1, 4)):
            start = rng.randrange(40)
            phrase = CYCLE[start : start + rng.randint(5, 40)]
            prompts[f"r{i}"] = phrase + CYCLE[: rng.randint(3, 10)]
        arriving = list(prompts.items())
        planner, step = sim.planner, 0
        while arriving or not planner.idle:
            if arriving and rng.random() < 0.3:
                rid, prompt = arriving.pop(0)
                sim.add(rid, prompt, max_new_tokens=20, ignore_eos=True)
                continue
            request = planner.propose(step)
            if request is None:
                if not sim.launched and not arriving:
                    stuck.append(seed)
                    break
                if sim.launched:
                    sim.complete_one()
                continue
            step += 1
            answer = sim.cache.plan(request)
            if sim.launched and rng.random() < 0.5:
                sim.complete_one()  # the result lands while the plan is out
            launch = planner.apply_plan(answer)
            sim.record([])
            if launch is not None:
                sim.launched.append(launch)
        else:
            assert sim.cache.check(loud=True) is None
            for rid, prompt in prompts.items():
                want = solo(prompt, counting=True, max_new_tokens=20, ignore_eos=True)
                assert sim.tokens(rid) == want, (seed, rid)
    assert not stuck, f"stalled with nothing in flight: seeds {stuck}"
