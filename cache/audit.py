"""The cache's audit: recount who owns every page and row, and compare with the books
(docs/architecture.md, "Lifecycle laws", law 4)::

    check_integrity(cache)   # O(total pages + rows); raises IntegrityError

Every page has exactly one owner: the allocator's free list, the tree, one live request or one
session. An owner map over every page that is not free finds a page claimed twice or both free
and owned; the counters then find a page that nobody claims (leaked)::

    free + evictable + locked + request + session == total pages
    free rows + held rows == total rows

It reads the cache only through ``Audited``: its parts (each checks itself first), its live
requests and the count of pages they own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from .live import LiveRequest
from .node import IntegrityError, path_pages
from .pages import PageAllocator
from .radix import RadixTree
from .rows import HOLE, RowTable
from .session_kv import SessionKV
from .stats import KVStats


class Audited(Protocol):
    """What the audit reads of a ``KVCache``."""

    @property
    def page_size(self) -> int: ...

    @property
    def allocator(self) -> PageAllocator: ...

    @property
    def rows(self) -> RowTable: ...

    @property
    def tree(self) -> RadixTree: ...

    @property
    def sessions(self) -> SessionKV: ...

    @property
    def live_requests(self) -> Mapping[str, LiveRequest]: ...

    @property
    def num_request_pages(self) -> int: ...

    def stats(self) -> KVStats: ...


def check_integrity(cache: Audited) -> None:
    """Every page has exactly one owner; rows, tree locks and page counts close."""
    tree, allocator, rows = cache.tree, cache.allocator, cache.rows
    tree.check_integrity()
    allocator.check_integrity()
    rows.check_integrity()
    live_requests = cache.live_requests
    owner: dict[int, str] = dict.fromkeys(tree.all_pages(), "the tree")
    num_request_pages = 0
    num_locks = 0
    for rid, live in live_requests.items():
        problem = request_problem(live, rows, tree, cache.page_size)
        if problem is not None:
            raise IntegrityError(f"kv cache: request {rid!r}: {problem}")
        num_locks += live.node is not tree.root
        name = f"request {rid!r}"
        for page in live.own_pages:
            if page in owner:
                raise IntegrityError(f"kv cache: page {page} owned by {name} and {owner[page]}")
            owner[page] = name
        num_request_pages += len(live.own_pages)
    num_locks += cache.sessions.check_integrity(owner)
    for page in owner:
        if allocator.is_free(page):
            raise IntegrityError(f"kv cache: page {page} is free but owned by {owner[page]}")
    held = sorted(live.row for live in live_requests.values())
    if held != rows.held_rows():
        raise IntegrityError(f"kv cache: held rows {rows.held_rows()} != live {held}")
    root_locks = sum(child.lock_ref for child in tree.root.children.values())
    if root_locks != num_locks:
        raise IntegrityError(f"kv cache: tree holds {root_locks} locks, requests {num_locks}")
    if num_request_pages != cache.num_request_pages:
        raise IntegrityError(
            f"kv cache: request pages {cache.num_request_pages} != recount {num_request_pages}"
        )
    total = (
        allocator.num_free
        + tree.evictable_pages
        + tree.locked_pages
        + cache.num_request_pages
        + cache.sessions.num_pages
    )
    if total != allocator.num_total:
        raise IntegrityError(f"kv cache: pages do not add up: {cache.stats()}")


def request_problem(
    live: LiveRequest, rows: RowTable, tree: RadixTree, page_size: int
) -> str | None:
    """What is wrong with one live request's holdings, or None."""
    if not rows.is_held(live.row):
        return f"row {live.row} is not held"
    row_pages = rows.pages(live.row)
    if row_pages != live.matched_pages + [HOLE] * live.num_trimmed + live.own_pages:
        return (
            f"row pages {row_pages} != matched {live.matched_pages} + "
            f"{live.num_trimmed} holes + own {live.own_pages}"
        )
    if live.node.evicted:
        return "its locked node was evicted"
    if live.node is not tree.root and live.node.num_locks <= 0:
        return "its matched node holds no lock"
    path = path_pages(live.node)
    if path != live.matched_pages:
        return f"tree path pages {path} != matched pages {live.matched_pages}"
    if len(live.cached_tokens) != len(live.matched_pages) * page_size:
        return "cached tokens and matched pages disagree"
    return None
