"""Sliding-window trimming (issue 14): a request's own KV pages that lie wholly below every
live reader's window are given back while it runs (`KVCache.trim`, `Planner._trims`).

Three levels: the pure cache (trim frees only own pages below the boundary; a trimmed row
caches nothing past its intact prefix; sessions keep a window keep), the planner over the
real cache with a fake device that checks every key a query reads (never a freed page, never
a page an in-flight batch reads is freed, under max_inflight 1-3), and the engine on a tiny
Mistral with sliding_window 16 (accounting only: pages held stay bounded by the window).
"""

from __future__ import annotations

import random
from collections import deque

import pytest
from engines import EngineFactory
from hypothesis import given, settings
from hypothesis import strategies as st
from page_math import ceil_div
from tiny_families import WINDOW, make_family_folder

from shoal import Engine
from shoal.actors.cache_manager.cache_manager import CacheManager
from shoal.actors.executor_messages import Launch
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import Admit, Output, StepDone
from shoal.actors.scheduler.planner import Planner
from shoal.actors.scheduler.request import PlannerConfig
from shoal.cache.kv import KVCache
from shoal.cache.rows import HOLE
from shoal.models.load import LoadedModel, load_model
from shoal.params import SamplingParams


def make(num_pages: int = 64, page_size: int = 4, window: int | None = 8) -> KVCache:
    return KVCache(
        num_pages=num_pages, page_size=page_size, num_rows=4, max_pages_per_row=64, window=window
    )


def closes(kv: KVCache) -> None:
    kv.check_integrity()
    s = kv.stats()
    assert (
        s.free_pages + s.evictable_pages + s.locked_pages + s.request_pages + s.session_pages
        == s.total_pages
    )


# ---- the pure cache ---------------------------------------------------------------------------


def test_trim_frees_only_own_pages_wholly_below_the_boundary() -> None:
    kv = make()
    prompt = list(range(100, 109))  # 9 tokens
    kv.admit("a", prompt, 9)
    kv.release("a", prompt)  # the tree holds 2 pages: 0..7
    adm = kv.admit("b", [*prompt, 7, 7, 7], 24)
    assert adm is not None and adm.num_cached_tokens == 8
    row = kv.rows.pages(adm.row)
    tree_pages, own = row[:2], row[2:]
    assert kv.trim("b", 6) == []  # below the boundary lie only the tree's pages
    assert kv.trim("b", 15) == own[:1]  # 8..11 wholly below 15; 12..15 is not
    assert kv.rows.pages(adm.row) == [*tree_pages, HOLE, *own[1:]]
    assert kv.trim("b", 12) == []  # already trimmed there
    assert kv.trim("b", 20) == own[1:3]
    assert kv.stats().request_pages == len(own) - 3
    assert kv.stats().trimmed_pages == 3
    assert kv.stats().locked_pages == 2  # the tree's pages stay locked, untouched
    closes(kv)
    assert kv.trim("b", 10_000) == own[3:]  # capped at what the row holds
    assert kv.stats().request_pages == 0
    closes(kv)
    kv.release("b", None)
    closes(kv)
    assert kv.stats().free_pages + kv.stats().evictable_pages == 64


def test_trim_needs_a_window() -> None:
    kv = make(window=None)
    kv.admit("a", [1, 2, 3], 12)
    with pytest.raises(AssertionError, match="window"):
        kv.trim("a", 8)


def test_extend_after_trim_counts_the_holes() -> None:
    kv = make()
    adm = kv.admit("a", list(range(10)), 10)
    assert adm is not None
    kv.trim("a", 8)
    writes = kv.extend("a", 13)
    assert writes is not None and [w.start for w in writes] == [3]
    assert kv.extend("a", 16) == []  # 4 slots cover 16 positions already
    assert kv.rows.pages(adm.row)[:2] == [HOLE, HOLE]
    closes(kv)
    kv.release("a", None)
    closes(kv)


def test_release_after_trim_caches_nothing_past_the_intact_prefix() -> None:
    kv = make()
    shared = list(range(50, 58))  # 2 pages
    kv.admit("p", [*shared, 1], 9)
    kv.release("p", [*shared, 1])
    tokens = [*shared, *range(200, 230)]
    adm = kv.admit("a", tokens, len(tokens))
    assert adm is not None and adm.num_cached_tokens == 8
    kv.trim("a", 20)  # frees the own pages at 8..11 and 12..15
    before = kv.stats().cached_tokens
    kv.release("a", tokens)
    assert kv.stats().cached_tokens == before == 8  # nothing inserted
    assert kv.stats().request_pages == 0 and kv.stats().locked_pages == 0
    closes(kv)
    again = kv.admit("b", [*tokens, 1], len(tokens) + 1)
    assert again is not None and again.num_cached_tokens == 8
    kv.release("b", None)
    closes(kv)


def test_an_untrimmed_release_still_caches_everything() -> None:
    kv = make()
    tokens = list(range(20))
    kv.admit("a", tokens, 20)
    assert kv.trim("a", 3) == []  # nothing wholly below position 3
    kv.release("a", tokens)
    assert kv.stats().cached_tokens == 20
    closes(kv)


def test_publish_after_trim_hands_nothing_over_and_trim_spares_published_pages() -> None:
    kv = make()
    tokens = list(range(300, 324))  # 6 pages
    kv.admit("a", tokens, 24)
    assert kv.publish("a", tokens[:8]) == 8  # 2 pages become the tree's, locked by "a"
    assert kv.trim("a", 16) != []  # frees the own pages at 8..15 only
    assert kv.stats().locked_pages == 2
    assert kv.publish("a", tokens[:20]) == 8  # no longer whole from 0: nothing more
    assert kv.stats().cached_tokens == 8
    closes(kv)
    kv.release("a", tokens)
    assert kv.stats().cached_tokens == 8
    closes(kv)


def test_a_trimmed_session_keeps_its_window_and_the_next_turn_continues_on_it() -> None:
    kv = make(window=8)
    history = list(range(10, 33))  # 23 tokens
    kv.admit("t1", history[:10], 10, session="s")
    kv.extend("t1", 23)
    assert kv.trim("t1", 12) != []  # pages 0..3, 4..7, 8..11 given back
    kv.release("t1", history, session="s")
    keep = kv.sessions.get("s")
    assert keep is not None and keep.num_trimmed == 3 and len(keep.pages) == 3
    stats = kv.stats()
    assert stats.session_pages == 3 and stats.cached_tokens == 0 and stats.request_pages == 0
    closes(kv)

    turn = [*history, 40, 41, 42]
    got = kv.admit("t2", turn, len(turn), session="s")
    assert got is not None and got.num_cached_tokens == 23  # only the window was needed
    assert [w.start for w in got.writes] == [3]  # the holes get no device write
    assert kv.rows.pages(got.row)[:3] == [HOLE] * 3
    assert kv.rows.pages(got.row)[3:6] == keep.pages
    assert kv.stats().session_pages == 0 and kv.sessions.get("s") is None
    closes(kv)
    kv.extend("t2", 30)
    kv.trim("t2", 20)
    kv.release("t2", [*turn, 43, 44, 45, 46], session="s")  # 30 computed
    keep = kv.sessions.get("s")
    assert keep is not None and keep.num_trimmed == 5 and len(keep.pages) == 3
    closes(kv)
    kv.close_session("s")
    stats = kv.stats()
    assert stats.session_pages == stats.locked_pages == stats.request_pages == 0
    assert stats.free_pages == stats.total_pages
    closes(kv)


def test_a_session_trimmed_past_its_matched_prefix_keeps_the_tree_lock() -> None:
    kv = make(window=8)
    prefix = list(range(60, 68))  # 2 pages, cached by another request
    kv.admit("p", [*prefix, 1], 9)
    kv.release("p", [*prefix, 1])
    history = [*prefix, *range(70, 90)]  # 28 tokens
    got = kv.admit("t1", history, 28, session="s")
    assert got is not None and got.num_cached_tokens == 8
    kv.trim("t1", 20)  # 8..19 given back
    kv.release("t1", history, session="s")
    keep = kv.sessions.get("s")
    assert keep is not None and keep.num_trimmed == 3 and len(keep.pages) == 2
    assert kv.stats().locked_pages == 2  # the keep locks the matched prefix
    closes(kv)
    turn = [*history, 5, 6]
    again = kv.admit("t2", turn, 30, session="s")
    assert again is not None and again.num_cached_tokens == 28
    assert kv.rows.pages(again.row)[2:5] == [HOLE] * 3
    closes(kv)
    kv.release("t2", None, session="s")  # dropped: the session keeps nothing
    assert kv.sessions.get("s") is None
    closes(kv)
    assert kv.stats().locked_pages == 0


def test_a_rollback_to_before_the_window_keeps_nothing_and_the_next_turn_re_prefills() -> None:
    kv = make(window=8)
    history = list(range(10, 23))  # 13 tokens
    kv.admit("t1", history, 13, session="s")
    kv.release("t1", history, session="s")
    turn = [*history, *range(100, 120)]  # 33 tokens
    kv.admit("t2", turn, 33, session="s")
    kv.extend("t2", 40)
    kv.trim("t2", 28)  # the turn decoded on; positions below 28 given back
    kv.release("t2", history, session="s")  # aborted: back to 13 tokens, whose keys are gone
    assert kv.sessions.get("s") is None and kv.session_tokens("s") is None
    closes(kv)
    again = kv.admit("t3", [*history, 7], 14, session="s")
    # The tree holds the first turn's 3 full pages (inserted untrimmed), not its tail.
    assert again is not None and again.num_cached_tokens == 12
    kv.release("t3", None)
    closes(kv)


def test_a_window_keep_is_reclaimed_under_pressure_and_dropped_by_flush() -> None:
    kv = make(num_pages=12, window=4)
    history = list(range(30))
    kv.admit("t1", history, 30, session="s")
    kv.trim("t1", 24)
    kv.release("t1", history, session="s")
    assert kv.stats().session_pages == 2
    closes(kv)
    assert kv.admit("big", list(range(41)), 41) is not None  # 11 pages: reclaims the keep
    assert kv.sessions.get("s") is None and kv.stats().sessions_reclaimed == 1
    kv.release("big", None)
    closes(kv)
    kv.admit("t2", history, 30, session="s2")
    kv.trim("t2", 24)
    kv.release("t2", history, session="s2")
    kv.flush()
    assert kv.stats().free_pages == 12
    closes(kv)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 2, 4]), window=st.integers(1, 9))
def test_random_trims_keep_the_books_and_never_cache_a_broken_prefix(
    data: st.DataObject, page_size: int, window: int
) -> None:
    """Random admit / extend / publish / trim / release, sessions among them. After every
    step the integrity check; a trimmed row's publish and release add nothing to the tree."""
    kv = KVCache(num_pages=40, page_size=page_size, num_rows=3, max_pages_per_row=24, window=window)
    live: dict[str, tuple[list[int], str | None, int]] = {}  # rid -> (computed, session, row)
    histories: dict[str, list[int]] = {}
    for step in range(data.draw(st.integers(1, 30), label="steps")):
        action = data.draw(st.sampled_from(["admit", "extend", "publish", "trim", "release"]))
        if action == "admit" or not live:
            session = data.draw(st.sampled_from([None, "s0", "s1"]), label="session")
            if session is not None and any(s == session for _, s, _ in live.values()):
                continue
            base = histories.get(session, []) if session else []
            more = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=6), label="more")
            tokens = (base + more)[: 24 * page_size - 8]
            if len(tokens) <= len(base):
                continue
            adm = kv.admit(f"r{step}", tokens, len(tokens), session)
            if adm is not None:
                live[f"r{step}"] = (tokens, session, adm.row)
        else:
            rid = data.draw(st.sampled_from(sorted(live)), label="rid")
            tokens, session, row = live[rid]
            trimmed = HOLE in kv.rows.pages(row)
            tree_pages = kv.tree.total_pages
            if action == "extend":
                more = data.draw(st.lists(st.integers(0, 2), max_size=5), label="decoded")
                grown = (tokens + more)[: 24 * page_size]
                if kv.extend(rid, len(grown)) is not None:
                    live[rid] = (grown, session, row)
            elif action == "publish":
                kv.publish(rid, tokens)
                assert not trimmed or kv.tree.total_pages == tree_pages
            elif action == "trim":
                # What the planner may ask: below the window of the next query.
                kv.trim(rid, max(len(tokens) - window + 1, 0) // page_size * page_size)
            else:
                del live[rid]
                keep = data.draw(st.integers(0, len(tokens)), label="computed")
                kv.release(rid, tokens[:keep], session)
                assert not trimmed or kv.tree.total_pages == tree_pages
                if session is not None:
                    histories[session] = tokens[:keep]
                    kept = kv.sessions.get(session)
                    assert kept is None or kept.tokens == tuple(tokens[: len(kept.tokens)])
        kv.check_integrity()
    for rid in list(live):
        kv.release(rid, None)
    kv.flush()
    assert kv.stats().free_pages == 40


# ---- the planner over the cache: no freed page is ever read -----------------------------------


class WindowDevice:
    """Runs launches in order against a fake KV pool: each key slot holds a digest of the
    tokens up to its position, and every query checks every key in its window."""

    def __init__(self, page_size: int, window: int) -> None:
        self.ps, self.window = page_size, window
        self.table: dict[int, dict[int, int]] = {}  # row -> slot -> page (device side)
        self.pool: dict[tuple[int, int], int] = {}  # (page, offset) -> digest
        self.tokens: dict[int, list[int]] = {}  # row -> its tokens
        self.last: dict[int, int] = {}

    def run(self, launch: Launch) -> StepDone:
        for w in launch.writes:
            for i, page in enumerate(w.pages):
                self.table.setdefault(w.row, {})[w.start + i] = page
        out = []
        for seq in launch.all_seqs():
            if seq.init is not None:
                self.tokens[seq.row] = [*seq.init.prompt_ids, *seq.init.output_ids]
            toks = self.tokens[seq.row]
            if seq.input_ids is None:
                assert len(toks) == seq.start
                toks.append(self.last[seq.row])
            else:
                assert toks[seq.start : seq.start + seq.num_tokens] == list(seq.input_ids)
            for pos in range(seq.start, seq.start + seq.num_tokens):
                page = self.table[seq.row][pos // self.ps]
                self.pool[page, pos % self.ps] = hash(tuple(toks[: pos + 1]))
                for key in range(max(pos - self.window + 1, 0), pos + 1):
                    kpage = self.table[seq.row][key // self.ps]
                    got = self.pool.get((kpage, key % self.ps))
                    assert got == hash(tuple(toks[: key + 1])), (
                        f"row {seq.row}: query {pos} read a wrong key {key} (page {kpage})"
                    )
            if seq.sample:
                token = (toks[-1] * 31 + len(toks) * 7) % 89 + 3
                self.last[seq.row] = token
                out.append(token)
        return StepDone(launch.batch_id, tuple(out))


class WindowSim:
    def __init__(
        self, *, window: int, page_size: int, max_inflight: int, chunk_size: int, prefix: bool
    ) -> None:
        self.window, self.ps = window, page_size
        self.kv = KVCache(
            num_pages=400, page_size=page_size, num_rows=4, max_pages_per_row=200, window=window
        )
        self.cache = CacheManager(self.kv, Mailbox("c"), Mailbox("s"), strict=True)
        config = PlannerConfig(4, chunk_size, 64, (), prefix_cache=prefix, page_size=page_size)
        self.planner = Planner(config, kv_window=window)
        self.device = WindowDevice(page_size, window)
        self.max_inflight = max_inflight
        self.launched: deque[tuple[Launch, set[int]]] = deque()
        self.outputs: dict[str, list[int]] = {}
        self.max_request_pages = 0  # the most own pages all requests held, from output 40 on
        trim = self.kv.trim

        def checked_trim(rid: str, keep_from_token: int) -> list[int]:
            freed = trim(rid, keep_from_token)
            for launch, reads in self.launched:
                assert not reads & set(freed), f"freed {freed} read by batch {launch.batch_id}"
            return freed

        self.kv.trim = checked_trim  # type: ignore[method-assign]

    def add(self, rid: str, prompt: list[int], n: int, session: str | None = None) -> None:
        params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
        self.planner.add(Admit(rid, tuple(prompt), params, 0, session))

    def reads(self, launch: Launch) -> set[int]:
        """The pages each query of the launch reads: keys from start - W + 1 on."""
        pages = set()
        for seq in launch.all_seqs():
            row = self.kv.rows.pages(seq.row)
            for key in range(max(seq.start - self.window + 1, 0), seq.start + seq.num_tokens):
                assert row[key // self.ps] != HOLE, f"launch reads a hole at {key}"
                pages.add(row[key // self.ps])
        return pages

    def run(self) -> None:
        for _ in range(100_000):
            planner = self.planner
            if planner.idle:
                break
            request = None
            if len(self.launched) < self.max_inflight:
                request = planner.propose(0)
            if request is not None:
                launch = planner.apply_plan(self.cache.plan(request))
                self.collect([])
                if launch is not None:
                    self.launched.append((launch, self.reads(launch)))
                continue
            assert self.launched, f"stuck: {planner.snapshot()}"
            launch, _ = self.launched.popleft()
            self.collect(planner.process(self.device.run(launch)))
            if sum(map(len, self.outputs.values())) >= 40:  # past the prompts' admissions
                pages = self.kv.stats().request_pages
                self.max_request_pages = max(self.max_request_pages, pages)
        assert self.planner.idle
        assert self.cache.check(loud=True) is None

    def collect(self, outputs: list[Output]) -> None:
        for rids, tokens in self.planner.take_steady():  # a steady step's, as columns
            for rid, token in zip(rids, tokens, strict=True):
                self.outputs.setdefault(rid, []).append(token)
        for out in outputs + self.planner.take_errors():
            assert out.finish != "error", out
            self.outputs.setdefault(out.rid, []).extend(out.token_ids)
        self.planner.take_released()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    window=st.integers(1, 12),
    page_size=st.sampled_from([1, 2, 4]),
    max_inflight=st.integers(1, 3),
    chunk_size=st.sampled_from([3, 8, 32]),
    prefix=st.booleans(),
)
def test_planned_trims_never_free_a_page_a_batch_reads(
    seed: int, window: int, page_size: int, max_inflight: int, chunk_size: int, prefix: bool
) -> None:
    sim = WindowSim(
        window=window,
        page_size=page_size,
        max_inflight=max_inflight,
        chunk_size=chunk_size,
        prefix=prefix,
    )
    rng = random.Random(seed)
    shared = [rng.randrange(3, 90) for _ in range(40)]
    for i in range(3):
        prompt = shared[: rng.randrange(1, 40)] + [rng.randrange(3, 90) for _ in range(5)]
        sim.add(f"r{i}", prompt, rng.randrange(1, 60))
    sim.run()
    # Several requests run together: each holds at most its window, its next chunk and the
    # pages in flight, plus a partial page at either end.
    per_request = ceil_div(window + chunk_size + max_inflight, page_size) + 2
    if not prefix:  # with prefix caching, published prompt pages are the tree's instead
        assert sim.max_request_pages <= 3 * max(per_request, ceil_div(45, page_size) + 1)
    assert sim.kv.stats().trimmed_pages > 0 or window >= 30


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    window=st.integers(2, 10),
    page_size=st.sampled_from([1, 2, 4]),
    max_inflight=st.integers(1, 3),
)
def test_session_turns_over_a_trimmed_window_read_only_intact_keys(
    seed: int, window: int, page_size: int, max_inflight: int
) -> None:
    rng = random.Random(seed)
    sim = WindowSim(
        window=window, page_size=page_size, max_inflight=max_inflight, chunk_size=8, prefix=True
    )
    history: list[int] = []
    for turn in range(4):
        new = [rng.randrange(3, 90) for _ in range(rng.randrange(1, 10))]
        n = rng.randrange(5, 40)
        sim.add(f"t{turn}", history + new, n, session="s")
        sim.run()
        history += new + sim.outputs[f"t{turn}"]
        keep = sim.kv.sessions.get("s")
        assert keep is not None and keep.tokens == tuple(history[:-1])  # the last: no KV yet
    assert sim.kv.stats().session_pages <= ceil_div(window, page_size) + 2
    sim.kv.close_session("s")
    assert sim.cache.check(loud=True) is None


def test_one_long_generation_holds_pages_bounded_by_the_window() -> None:
    sim = WindowSim(window=16, page_size=4, max_inflight=2, chunk_size=8, prefix=False)
    sim.add("a", list(range(3, 40)), 300)
    sim.run()
    assert len(sim.outputs["a"]) == 300
    assert sim.max_request_pages <= ceil_div(16 + 2, 4) + 1


# ---- the engine on a tiny Mistral with sliding_window 16 ---------------------------------------


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = make_family_folder(tmp_path_factory.mktemp("tiny-mistral"), "mistral")
    loaded = load_model(folder, progress=False)
    assert loaded.config.kv_window == WINDOW
    return loaded


# Decoding, a request holds the window's W keys, the positions launched ahead of their
# results (max_inflight, 2) and a partial page: 5 pages here (the planner's bound is exact).
PAGE_BOUND = ceil_div(WINDOW + 2, 4) + 1


async def generate_watching_pages(
    engine: Engine, input_ids: list[int], n: int, **extra: object
) -> int:
    """Generate n tokens greedily; the most request pages held from token 40 on."""
    stream = engine.generate(
        input_ids=input_ids, max_new_tokens=n, temperature=0.0, ignore_eos=True, **extra
    )
    seen, most = 0, 0
    async for delta in stream:
        seen += len(delta.token_ids)
        if seen >= 40:
            most = max(most, (await engine.cache_stats()).request_pages)
    assert seen == n
    return most


@pytest.mark.parametrize("prefix_cache", [False, True])
async def test_a_long_generation_on_a_windowed_model_holds_pages_bounded_by_the_window(
    make_engine: EngineFactory, tiny_mistral: LoadedModel, prefix_cache: bool
) -> None:
    engine = await make_engine(
        tiny_mistral, page_size=4, chunk_size=8, prefix_cache=prefix_cache, kv_cache_tokens=4096
    )
    prompt = [(i * 7) % 500 + 3 for i in range(30)]
    most = await generate_watching_pages(engine, prompt, 300)
    assert 0 < most <= PAGE_BOUND, most
    await engine.wait_idle()
    await engine.check_integrity()
    stats = await engine.cache_stats()
    assert stats.trimmed_pages >= (330 - WINDOW - 8) // 4 - ceil_div(30, 4)
    assert stats.request_pages == 0
    if prefix_cache:  # the prompt's full pages were published whole; nothing after them
        assert stats.cached_tokens == 28
        again = await engine.generate(input_ids=prompt, max_new_tokens=3).result()
        assert again.usage.cached_tokens == 28


async def test_session_turns_on_a_windowed_model_keep_only_the_window(
    make_engine: EngineFactory, tiny_mistral: LoadedModel
) -> None:
    engine = await make_engine(tiny_mistral, page_size=4, chunk_size=8, kv_cache_tokens=4096)
    session = await engine.open_session()
    history_len = 0
    for turn in range(3):
        new = [(turn * 13 + i * 5) % 500 + 3 for i in range(10)]
        most = await generate_watching_pages(engine, new, 120, session_id=session.id)
        assert most <= PAGE_BOUND, most
        history_len += len(new) + 120
        await engine.wait_idle()
        await engine.check_integrity()
        stats = await engine.cache_stats()
        assert stats.sessions == 1 and 0 < stats.session_pages <= ceil_div(WINDOW, 4) + 2
    done = await session.turn(input_ids=[5, 6, 7], max_new_tokens=2, temperature=0.0).result()
    # All but the last output's KV, from a keep of only the window's pages.
    assert done.usage.cached_tokens == history_len - 1
    await session.close()
    await engine.wait_idle()
    stats = await engine.cache_stats()
    assert stats.sessions == stats.session_pages == stats.locked_pages == 0
