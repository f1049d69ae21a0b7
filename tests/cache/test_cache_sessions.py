"""Session-kept KV in KVCache: full pages locked in the tree, the partial page the session's
own; the next turn reuses both; a rollback restores the previous turn; pressure reclaims."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.cache.kv import KVCache


def cache(num_pages: int = 64, page_size: int = 4, row_pages: int = 32) -> KVCache:
    return KVCache(
        num_pages=num_pages, page_size=page_size, num_rows=4, max_pages_per_row=row_pages
    )


def test_a_turn_keeps_full_pages_locked_and_the_tail_page_as_its_own() -> None:
    kv = cache()
    history = list(range(10, 23))  # 13 tokens: 3 full pages and 1 token on a 4th
    assert kv.admit("t1", history[:10], 10, session="s") is not None
    assert kv.extend("t1", 13) is not None  # decoded three tokens
    kv.release("t1", history, session="s")
    stats = kv.stats()
    assert stats.locked_pages == 3 and stats.session_pages == 1
    assert stats.request_pages == 0 and stats.free_rows == 4
    kv.check_integrity()

    turn = [*history, 50, 51, 52]
    got = kv.admit("t2", turn, len(turn), session="s")
    assert got is not None and got.num_cached_tokens == 13  # the partial page reused too
    assert kv.stats().session_pages == 0 and kv.session_tokens("s") is None
    kv.check_integrity()
    kv.release("t2", turn, session="s")
    assert kv.session_tokens("s") == tuple(turn)
    kv.close_session("s")
    stats = kv.stats()
    assert stats.locked_pages == stats.session_pages == 0
    assert stats.free_pages + stats.evictable_pages == stats.total_pages
    kv.check_integrity()


def test_rollback_restores_the_previous_turn() -> None:
    kv = cache()
    history = list(range(10, 23))
    kv.admit("t1", history, 13, session="s")
    kv.release("t1", history, session="s")
    tail_before = kv.sessions.get("s").pages
    turn = [*history, 60, 61, 62, 63, 64, 65]
    assert kv.admit("t2", turn, len(turn), session="s") is not None
    kv.extend("t2", len(turn) + 8)
    kv.release("t2", history, session="s")  # aborted: back to the last completed turn
    assert kv.session_tokens("s") == tuple(history)
    assert kv.sessions.get("s").pages == tail_before
    assert kv.stats().request_pages == 0
    kv.check_integrity()
    again = kv.admit("t3", [*history, 70], 14, session="s")
    assert again is not None and again.num_cached_tokens == 13


def test_a_turn_that_does_not_extend_the_history_drops_the_session_kv() -> None:
    kv = cache()
    history = list(range(10, 23))
    kv.admit("t1", history, 13, session="s")
    kv.release("t1", history, session="s")
    other = [99, *history]
    got = kv.admit("t2", other, len(other), session="s")
    assert got is not None and got.num_cached_tokens == 0
    assert kv.stats().session_pages == 0
    kv.check_integrity()
    kv.release("t2", None)
    kv.check_integrity()


def test_pressure_reclaims_idle_sessions_least_recently_used_first() -> None:
    kv = cache(num_pages=12)
    for name, start in (("old", 100), ("new", 200)):
        tokens = list(range(start, start + 13))
        kv.admit(name, tokens, 13)
        kv.release(name, tokens, session=name)
    assert kv.stats().free_pages == 4  # each session keeps 4 pages
    big = list(range(300, 330))  # needs 8 pages: only "old" must give its KV back
    assert kv.admit("big", big, 30) is not None
    assert kv.session_tokens("old") is None and kv.session_tokens("new") is not None
    assert kv.stats().sessions_reclaimed == 1
    kv.check_integrity()
    kv.release("big", None)
    kv.check_integrity()


def test_flush_drops_session_kv_but_nothing_else() -> None:
    kv = cache()
    tokens = list(range(10, 23))
    kv.admit("t1", tokens, 13)
    kv.release("t1", tokens, session="s")
    kv.flush()
    assert kv.stats().free_pages == kv.stats().total_pages
    kv.check_integrity()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    turns=st.lists(
        st.tuples(st.integers(1, 9), st.integers(0, 6), st.booleans()), min_size=1, max_size=12
    ),
)
def test_every_turn_reuses_exactly_the_last_completed_history(
    page_size: int, turns: list[tuple[int, int, bool]]
) -> None:
    kv = cache(num_pages=400, page_size=page_size, row_pages=200)
    history: list[int] = []
    for i, (new, out, aborted) in enumerate(turns):
        prompt = history + [1000 + 10 * i + j for j in range(new)]
        got = kv.admit(f"t{i}", prompt, len(prompt) + out, session="s")
        assert got is not None
        assert got.num_cached_tokens == len(history)
        computed = prompt + [2000 + j for j in range(out)]
        kv.extend(f"t{i}", len(computed))
        if not aborted:
            history = computed
        kv.release(f"t{i}", history, session="s")
        kv.check_integrity()
        assert kv.session_tokens("s") == tuple(history)
    kv.close_session("s")
    kv.check_integrity()
    assert kv.stats().locked_pages == 0
