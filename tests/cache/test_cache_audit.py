"""Unit tests for cache/audit.py: the recount reads a cache only through `Audited`, and
finds each kind of broken book it is there to find."""

from collections.abc import Mapping

import pytest

from shoal.cache.audit import check_integrity
from shoal.cache.kv import KVCache
from shoal.cache.live import LiveRequest
from shoal.cache.node import IntegrityError
from shoal.cache.pages import PageAllocator
from shoal.cache.radix import RadixTree
from shoal.cache.rows import RowTable
from shoal.cache.session_kv import SessionKV
from shoal.cache.stats import KVStats


class OnlyTheInterface:
    """A cache seen through `Audited` alone: anything else the audit touched would raise
    AttributeError. `extra_request_pages` skews the books."""

    def __init__(self, cache: KVCache, extra_request_pages: int = 0) -> None:
        self._cache = cache
        self._extra = extra_request_pages

    @property
    def page_size(self) -> int:
        return self._cache.page_size

    @property
    def allocator(self) -> PageAllocator:
        return self._cache.allocator

    @property
    def rows(self) -> RowTable:
        return self._cache.rows

    @property
    def tree(self) -> RadixTree:
        return self._cache.tree

    @property
    def sessions(self) -> SessionKV:
        return self._cache.sessions

    @property
    def live_requests(self) -> Mapping[str, LiveRequest]:
        return self._cache.live_requests

    @property
    def num_request_pages(self) -> int:
        return self._cache.num_request_pages + self._extra

    def stats(self) -> KVStats:
        return self._cache.stats()


def busy_cache() -> KVCache:
    """A request live, a prefix in the tree, a session keeping a partial page."""
    cache = KVCache(num_pages=32, page_size=4, num_rows=4, max_pages_per_row=8)
    assert cache.admit("s", list(range(10)), 10, session="chat") is not None
    cache.release("s", list(range(10)), session="chat")
    assert cache.admit("a", list(range(20)), 24) is not None
    return cache


def test_the_audit_reads_only_the_interface_and_checks_its_books() -> None:
    cache = busy_cache()
    check_integrity(OnlyTheInterface(cache))
    with pytest.raises(IntegrityError, match="request pages"):
        check_integrity(OnlyTheInterface(cache, extra_request_pages=1))


def test_the_audit_finds_a_freed_page_a_request_still_owns() -> None:
    cache = busy_cache()
    page = cache.live_requests["a"].own_pages[0]
    cache.allocator.free([page])
    with pytest.raises(IntegrityError, match=f"page {page} is free but owned by request 'a'"):
        check_integrity(OnlyTheInterface(cache))


def test_the_audit_finds_a_row_that_disagrees_with_its_holdings() -> None:
    cache = busy_cache()
    live = cache.live_requests["a"]
    cache.rows.punch(live.row, len(live.matched_pages), 1)  # a hole the request never made
    with pytest.raises(IntegrityError, match="request 'a': row pages"):
        check_integrity(OnlyTheInterface(cache))


def test_the_audit_finds_a_page_with_two_owners() -> None:
    cache = busy_cache()
    keep = cache.sessions.get("chat")
    assert keep is not None and keep.pages
    tree_page = cache.live_requests["a"].matched_pages[0]
    keep.pages[0] = tree_page  # the session's tail page, now one the tree owns
    with pytest.raises(
        IntegrityError, match=f"page {tree_page} owned by session 'chat' and the tree"
    ):
        check_integrity(OnlyTheInterface(cache))
