"""Unit tests for cache/kv.py: admit / extend / release / flush and page ownership."""

import msgspec
import pytest

from shoal.cache.kv import Admission, KVCache
from shoal.cache.node import IntegrityError
from shoal.cache.rows import RowWrite


def make(
    num_pages: int = 16, page_size: int = 1, num_rows: int = 4, max_pages_per_row: int = 16
) -> KVCache:
    return KVCache(
        num_pages=num_pages,
        page_size=page_size,
        num_rows=num_rows,
        max_pages_per_row=max_pages_per_row,
    )


def closes(cache: KVCache) -> None:
    """Integrity plus the accounting identity, from the public stats."""
    cache.check_integrity()
    s = cache.stats()
    assert (
        s.free_pages + s.evictable_pages + s.locked_pages + s.request_pages + s.session_pages
        == s.total_pages
    )


def row_of(writes: list[RowWrite]) -> list[int]:
    pages: list[int] = []
    for write in writes:
        assert write.start == len(pages)
        pages.extend(write.pages)
    return pages


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_admit_release_readmit_hits_the_prefix(ps: int) -> None:
    cache = make(num_pages=32, page_size=ps, max_pages_per_row=8)
    prompt = list(range(100, 100 + 3 * ps + 1))  # 3 full pages + 1 token
    adm = cache.admit("a", prompt, reserve_tokens=len(prompt))
    assert adm is not None and adm.num_cached_tokens == 0 and adm.row == 0
    row_pages = row_of(adm.writes)
    assert len(row_pages) == 4 and cache.num_request_pages == 4
    assert cache.holds("a")
    closes(cache)

    cache.release("a", prompt)  # all computed: 3 full pages + a partial one (ps > 1)
    full = len(prompt) // ps
    assert not cache.holds("a")
    assert cache.num_evictable_pages == full and cache.num_request_pages == 0
    assert cache.num_free_pages == 32 - full  # a partial last page came back
    assert cache.stats().cached_tokens == full * ps
    closes(cache)

    adm2 = cache.admit("b", prompt + [7] * ps, reserve_tokens=len(prompt) + ps)
    assert adm2 is not None
    assert adm2.num_cached_tokens == full * ps
    assert row_of(adm2.writes)[:full] == row_pages[:full]  # the tree's pages, reused
    assert cache.num_locked_pages == full and cache.num_evictable_pages == 0
    closes(cache)


@pytest.mark.parametrize("ps", [1, 4])
def test_cached_prefix_leaves_at_least_the_last_token_to_compute(ps: int) -> None:
    cache = make(page_size=ps)
    prompt = list(range(1, 2 * ps + 1))  # exactly 2 pages
    assert cache.admit("a", prompt, len(prompt)) is not None
    cache.release("a", prompt)
    adm = cache.admit("b", prompt, len(prompt))
    assert adm is not None and adm.num_cached_tokens == ((2 * ps - 1) // ps) * ps
    closes(cache)


def test_reserve_is_clamped_to_the_cached_prefix() -> None:
    cache = make(page_size=2)
    prompt = [1, 2, 3, 4, 5]
    assert cache.admit("a", prompt, 5) is not None
    cache.release("a", prompt)
    adm = cache.admit("b", prompt, reserve_tokens=0)
    assert adm is not None and adm.num_cached_tokens == 4
    assert len(row_of(adm.writes)) == 2 and cache.num_request_pages == 0
    assert cache.extend("b", 4) == []
    writes = cache.extend("b", 6)
    assert writes is not None and writes[0].start == 2 and len(writes[0].pages) == 1
    closes(cache)


def test_admit_with_nothing_to_reserve_has_no_writes() -> None:
    cache = make()
    assert cache.admit("a", [], 0) == Admission(0, 0, [])
    cache.release("a", [])
    closes(cache)


def test_admit_fails_cleanly_without_a_row() -> None:
    cache = make(num_rows=1)
    assert cache.admit("a", [1, 2, 3], 3) is not None
    before = cache.stats()
    assert cache.admit("b", [1, 2, 3], 3) is None
    assert cache.stats() == before and not cache.holds("b")
    closes(cache)


def test_admit_fails_cleanly_without_pages_and_evicts_nothing() -> None:
    cache = make(num_pages=8, page_size=2)
    prompt = [1, 1, 2, 2, 3]
    assert cache.admit("a", prompt, 5) is not None  # 3 pages
    cache.release("a", prompt)  # 2 pages cached (evictable), 6 free
    assert cache.admit("b", [9] * 8, 8) is not None  # 4 request pages; 2 free
    before = cache.stats()
    # Needs 4 new pages; only 2 free + 1 evictable once its matched page is locked.
    assert cache.admit("c", [1, 1, 4, 4], 10) is None
    assert cache.stats() == before
    assert cache.tree.num_evicted_pages == 0
    closes(cache)


def test_admit_evicts_but_never_the_prefix_it_matched() -> None:
    cache = make(num_pages=6, page_size=1)
    cache.admit("a", [1, 2, 3, 4], 4)
    cache.release("a", [1, 2, 3, 4])  # tree: (1,2,3,4)
    cache.admit("x", [7, 8], 2)
    cache.release("x", [7, 8])  # tree also: (7,8); now 0 free
    assert cache.num_free_pages == 0
    adm = cache.admit("b", [1, 2, 3, 9], 5)  # matches 3, needs 2 more
    assert adm is not None and adm.num_cached_tokens == 3
    # The unlocked (4) and (7,8) nodes were candidates; LRU took (4) then (7,8).
    assert cache.tree.match([1, 2, 3])[0] == row_of(adm.writes)[:3]
    assert cache.num_locked_pages == 3
    closes(cache)


def test_extend_allocates_evicts_and_fails_cleanly() -> None:
    cache = make(num_pages=6, page_size=2, max_pages_per_row=8)
    cache.admit("a", [1, 1, 2, 2], 4)
    cache.release("a", [1, 1, 2, 2])  # 2 evictable
    adm = cache.admit("b", [5, 5], 2)
    assert adm is not None
    writes = cache.extend("b", 9)  # 5 pages: 4 new, 3 free, so evict 1+
    assert writes == [RowWrite(adm.row, 1, writes[0].pages)] and len(writes[0].pages) == 4
    assert cache.num_evictable_pages == 0
    before = cache.stats()
    assert cache.extend("b", 13) is None
    assert cache.stats() == before
    assert cache.extend("b", 10) == []
    closes(cache)


def test_concurrent_duplicates_are_freed_on_release() -> None:
    cache = make(num_pages=16, page_size=2)
    prompt = [1, 1, 2, 2, 3, 3, 4]
    a = cache.admit("a", prompt, 7)
    b = cache.admit("b", prompt, 7)
    assert a is not None and b is not None
    a_pages, b_pages = row_of(a.writes), row_of(b.writes)
    cache.release("a", prompt)
    assert sorted(cache.tree.all_pages()) == sorted(a_pages[:3])
    cache.release("b", prompt)  # same 3 pages computed again: duplicates
    assert sorted(cache.tree.all_pages()) == sorted(a_pages[:3])
    assert all(cache.allocator.is_free(p) for p in b_pages)
    assert cache.num_free_pages == 16 - 3
    closes(cache)


def test_release_keeps_only_the_new_suffix_of_a_longer_sequence() -> None:
    cache = make(num_pages=16, page_size=1)
    cache.admit("a", [1, 2, 3], 3)
    cache.release("a", [1, 2, 3])
    b = cache.admit("b", [1, 2, 9, 9, 9], 6)  # matches (1,2), 4 own pages
    c = cache.admit("c", [1, 2, 9, 9, 8], 5)  # matches (1,2), 3 own pages
    assert b is not None and c is not None
    cache.release("c", [1, 2, 9, 9, 8])  # inserts (9,9,8)
    b_row = row_of(b.writes)
    cache.release("b", [1, 2, 9, 9, 9, 5])  # (9,9) present (c's), (9,5) new
    assert cache.tree.match([1, 2, 9, 9, 9, 5])[0] == row_of(c.writes)[:4] + b_row[4:6]
    assert cache.allocator.is_free(b_row[2]) and cache.allocator.is_free(b_row[3])
    closes(cache)


def test_release_without_computed_tokens_frees_everything_it_owns() -> None:
    cache = make(num_pages=8, page_size=4)
    prompt = list(range(9))
    cache.admit("a", prompt, 9)
    cache.release("a", prompt)  # 2 pages cached
    adm = cache.admit("b", [*prompt, 1, 2, 3], 16)
    assert adm is not None and adm.num_cached_tokens == 8
    cache.release("b", None)  # aborted
    assert cache.num_request_pages == 0 and cache.num_locked_pages == 0
    assert cache.num_evictable_pages == 2 and cache.num_free_pages == 6
    closes(cache)


def test_locked_node_split_by_another_request_unlocks_cleanly() -> None:
    cache = make(num_pages=32, page_size=1)
    long = [1, 2, 3, 4, 5, 6, 7, 8]
    cache.admit("w", long, 8)
    cache.release("w", long)
    a = cache.admit("a", [*long, 9], 9)  # locks the whole (1..8) node
    b = cache.admit("b", [1, 2, 3, 0], 4)  # splits it at 3 and locks the upper part
    assert a is not None and b is not None
    assert (a.num_cached_tokens, b.num_cached_tokens) == (8, 3)
    closes(cache)
    cache.release("a", [*long, 9])
    closes(cache)
    cache.release("b", [1, 2, 3, 0])
    assert cache.num_locked_pages == 0
    closes(cache)


def test_flush_requires_idle_and_frees_everything() -> None:
    cache = make(num_pages=8, page_size=1)
    cache.admit("a", [1, 2, 3], 3)
    with pytest.raises(AssertionError, match="live"):
        cache.flush()
    cache.release("a", [1, 2, 3])
    cache.flush()
    assert cache.num_free_pages == 8 and cache.stats().cached_tokens == 0
    adm = cache.admit("b", [1, 2, 3], 3)
    assert adm is not None and adm.num_cached_tokens == 0
    closes(cache)


def test_release_validates_before_changing_anything() -> None:
    cache = make(page_size=1)
    cache.admit("w", [1, 2, 3], 3)
    cache.release("w", [1, 2, 3])
    cache.admit("a", [1, 2, 3, 4], 4)
    with pytest.raises(AssertionError, match="row covers"):
        cache.release("a", [1, 2, 3, 4, 5])
    with pytest.raises(AssertionError, match="differ"):
        cache.release("a", [1, 9, 3, 4])
    assert cache.holds("a")
    closes(cache)
    cache.release("a", [1])  # shorter than the cached prefix is fine
    closes(cache)
    with pytest.raises(AssertionError, match="unknown"):
        cache.release("a", None)


def test_capacity_and_double_admit_assert() -> None:
    cache = make(max_pages_per_row=2, page_size=2)
    with pytest.raises(AssertionError, match="max_pages_per_row"):
        cache.admit("a", [1, 2, 3], 5)
    assert cache.admit("a", [1, 2, 3], 3) is not None
    with pytest.raises(AssertionError, match="live"):
        cache.admit("a", [1], 1)
    with pytest.raises(AssertionError, match="max_pages_per_row"):
        cache.extend("a", 5)
    closes(cache)


def test_stats_and_can_admit_pages() -> None:
    cache = make(num_pages=10, page_size=4, num_rows=3)
    assert msgspec.structs.asdict(cache.stats()) == {  # also the keys /get_server_info shows
        "total_pages": 10,
        "free_pages": 10,
        "evictable_pages": 0,
        "locked_pages": 0,
        "request_pages": 0,
        "session_pages": 0,
        "sessions": 0,
        "sessions_reclaimed": 0,
        "total_rows": 3,
        "free_rows": 3,
        "cached_tokens": 0,
        "trimmed_pages": 0,
    }
    cache.admit("a", list(range(8)), 12)
    cache.release("a", list(range(12)))
    assert cache.num_evictable_pages == 3 and cache.can_admit_pages(10)
    assert not cache.can_admit_pages(11)
    assert cache.evict(1) == 3 and cache.num_free_pages == 10


def test_check_integrity_catches_a_leaked_page() -> None:
    cache = make(num_pages=4)
    cache.admit("a", [1, 2], 2)
    leaked = cache.allocator.alloc(1)
    assert leaked is not None
    with pytest.raises(IntegrityError, match="do not add up"):
        cache.check_integrity()
