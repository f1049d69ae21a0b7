"""KVCache: pages, request rows and the radix prefix tree composed, with one owner per page.

Interface (what the engine's cache manager calls)::

    cache = KVCache(num_pages=..., page_size=..., num_rows=..., max_pages_per_row=...,
                    window=None)             # W: every layer attends to the last W keys only
    cache.admit(rid, tokens, reserve_tokens) -> Admission(row, num_cached_tokens, writes) | None
    cache.extend(rid, total_tokens)          -> list[RowWrite] | None
    cache.publish(rid, computed_tokens)      # still running: cache its computed full pages
    cache.trim(rid, keep_from_token)         -> list[int]  # window: free own pages below it
    cache.release(rid, computed_tokens)      # finished/aborted/retracted; caches computed KV
    cache.evict(num_pages)                   -> int   # pages evicted from the tree
    cache.flush()                            # only when no request is live
    cache.holds(rid), cache.row_pages(rid), cache.can_admit_pages(n)
    cache.check_integrity()                  # the audit (audit.py): raises IntegrityError
    cache.stats()                            -> KVStats (stats.py)

Page ownership of one live request's row (its ``LiveRequest``, live.py; page_size 4, prompt
of 11 tokens, reserve 14; the tree already held the first 8 tokens)::

    positions    0..3    4..7    8..11   12..15
    row        [ p7    | p3    | p12   | p13   ]     num_cached_tokens == 8
                └── tree's ───┘ └── request's ──┘
                matched at admit, own_pages: freed on release,
                locked via node   or handed to the tree if inserted

Every page has exactly one owner: the allocator's free list, the tree (evictable
when its node's lock_ref is 0, locked otherwise), one request, or one session
(session_kv.py). At all times (the audit recounts it, audit.py)::

    free + evictable + locked + request + session == total pages
    free rows + held rows == total rows

On ``release(rid, computed)`` the page-aligned prefix of ``computed`` is inserted;
the tree answers how many leading tokens it already had. Own pages inside that
prefix are duplicates (another request cached the same tokens first) and are
freed; own pages past it become the tree's; pages past the computed prefix
(including a partial last page) are freed. Then the admit-time lock is dropped.

Sliding window (``window`` W set: no query at position p reads a key at or below p - W).
``trim`` turns a running request's own pages that no query reads any more into holes
(live.py draws the row). A trimmed row's KV is no longer whole from position 0: ``publish``
and ``release`` give the tree nothing more, and a session keeps a window keep instead
(session_kv.py) when it holds every key its next turn reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from . import audit
from .live import LiveRequest
from .pages import PageAllocator
from .radix import RadixTree
from .rows import RowTable, RowWrite
from .session_kv import SessionKV
from .stats import KVStats
from .supply import PageSupply

__all__ = ["Admission", "KVCache"]


class Admission(NamedTuple):
    """A successful admit: the request's row, its cached prefix and the table writes."""

    row: int
    num_cached_tokens: int
    writes: list[RowWrite]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVCache:
    """The cache manager's data: pages, rows, the tree and sessions' KV, one owner per page."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        num_rows: int,
        max_pages_per_row: int,
        window: int | None = None,
    ) -> None:
        assert page_size >= 1, f"page_size must be >= 1, got {page_size}"
        assert window is None or window >= 1, f"window must be >= 1, got {window}"
        self.page_size = page_size
        self.window = window
        self.num_trimmed_pages = 0  # own pages given back early by trim, since start
        self.allocator = PageAllocator(num_pages)
        self.rows = RowTable(num_rows, max_pages_per_row)
        self.tree = RadixTree(page_size)
        self._live: dict[str, LiveRequest] = {}
        self._request_pages = 0
        self.sessions = SessionKV(self.tree, self.allocator, page_size)
        self.supply = PageSupply(self.allocator, self.tree, self.sessions)

    # ---- accounting -----------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def num_evictable_pages(self) -> int:
        return self.tree.evictable_pages

    @property
    def num_locked_pages(self) -> int:
        return self.tree.locked_pages

    @property
    def num_request_pages(self) -> int:
        return self._request_pages

    @property
    def num_session_pages(self) -> int:
        return self.sessions.num_pages

    @property
    def live_requests(self) -> Mapping[str, LiveRequest]:
        """What each live request holds (read by the audit)."""
        return self._live

    def holds(self, rid: str) -> bool:
        return rid in self._live

    def row_pages(self, rid: str) -> list[int]:
        """The pages of ``rid``'s row in position order (a KV transfer's addresses)."""
        return self.rows.pages(self._live[rid].row)

    def can_admit_pages(self, num_pages: int) -> bool:
        """Whether ``num_pages`` new pages could be had, evicting if needed."""
        return self.supply.can_take(num_pages)

    def stats(self) -> KVStats:
        return KVStats(
            total_pages=self.allocator.num_total,
            free_pages=self.allocator.num_free,
            evictable_pages=self.tree.evictable_pages,
            locked_pages=self.tree.locked_pages,
            request_pages=self._request_pages,
            session_pages=self.num_session_pages,
            sessions=len(self.sessions),
            sessions_reclaimed=self.sessions.num_reclaimed,
            total_rows=self.rows.num_total,
            free_rows=self.rows.num_free,
            cached_tokens=self.tree.total_pages * self.page_size,
            trimmed_pages=self.num_trimmed_pages,
        )

    def check_integrity(self) -> None:
        """O(total pages + rows): every page has exactly one owner; accounting closes
        (audit.py)."""
        audit.check_integrity(self)

    # ---- request lifecycle ----------------------------------------------------

    def admit(
        self, rid: str, tokens: Sequence[int], reserve_tokens: int, session: str | None = None
    ) -> Admission | None:
        """Give request ``rid`` a row covering ``reserve_tokens`` positions, reusing the
        longest cached prefix of ``tokens[:-1]`` — and, for a session's turn, the pages the
        session keeps (its partial last page, or a window keep) too. None (and nothing held)
        if no row or not enough pages even after eviction."""
        assert rid not in self._live, f"admit of live request {rid!r}"
        if self.rows.num_free == 0:
            return None
        ps = self.page_size
        matched_pages, node = self.tree.match(tokens[: max(len(tokens) - 1, 0)])
        carried: list[int] = []  # the session's pages that this turn goes on from
        num_holes, num_cached_tokens = 0, len(matched_pages) * ps
        kept = self.sessions.get(session) if session is not None else None
        on_keep = kept.continuation(tokens, matched_pages, node) if kept is not None else None
        if on_keep is not None:  # the turn goes on from the session's KV
            matched_pages, node, num_holes, carried, num_cached_tokens = on_keep
        num_row_pages = _ceil_div(max(reserve_tokens, num_cached_tokens), ps)
        assert num_row_pages <= self.rows.max_pages_per_row, (
            f"request {rid!r} needs {num_row_pages} pages, over max_pages_per_row="
            f"{self.rows.max_pages_per_row}"
        )
        self.tree.lock(node)  # before evicting: the matched prefix must survive
        num_new = num_row_pages - len(matched_pages) - num_holes - len(carried)
        new_pages = self.supply.take(num_new, spare=session)
        if new_pages is None:
            self.tree.unlock(node)
            return None
        if kept is not None and session is not None:  # the turn now holds the session's KV
            self.sessions.take(session, continues=on_keep is not None)
        own_pages = carried + new_pages
        row = self.rows.acquire()
        assert row is not None  # checked above; nothing in between releases rows
        cached = tuple(tokens[: len(matched_pages) * ps])
        self._live[rid] = LiveRequest(rid, row, node, cached, matched_pages, own_pages, num_holes)
        self._request_pages += len(own_pages)
        return Admission(row, num_cached_tokens, self._live[rid].fill_row(self.rows))

    def extend(self, rid: str, total_tokens: int) -> list[RowWrite] | None:
        """Make ``rid``'s row cover ``total_tokens`` positions. None (nothing changed) if
        the pages cannot be had even after eviction."""
        assert rid in self._live, f"extend of unknown request {rid!r}"
        live = self._live[rid]
        have = live.num_slots
        need = _ceil_div(total_tokens, self.page_size) - have
        if need <= 0:
            return []
        assert have + need <= self.rows.max_pages_per_row, (
            f"request {rid!r} needs {have + need} pages, over max_pages_per_row="
            f"{self.rows.max_pages_per_row}"
        )
        pages = self.supply.take(need)
        if pages is None:
            return None
        live.own_pages.extend(pages)
        self._request_pages += len(pages)
        return [self.rows.append(live.row, pages)]

    def publish(self, rid: str, computed_tokens: Sequence[int]) -> int:
        """While ``rid`` runs on, hand the full pages of its computed prefix that the tree
        lacks to the tree, so requests admitted from now on reuse them; ``rid`` locks them as
        its matched prefix (``LiveRequest.publish``). Returns how many leading tokens ``rid``
        now has from the tree."""
        assert rid in self._live, f"publish of unknown request {rid!r}"
        live = self._live[rid]
        self._request_pages -= live.publish(self.tree, computed_tokens, self.page_size)
        return len(live.matched_pages) * self.page_size

    def trim(self, rid: str, keep_from_token: int) -> list[int]:
        """Sliding window: free ``rid``'s own pages that lie wholly below position
        ``keep_from_token`` (no launched batch of ``rid`` and no later query reads a key
        there: the caller's promise). Tree pages are left alone (the admit-time lock keeps
        them). Returns the pages freed; their row entries become holes."""
        assert self.window is not None, "trim without a sliding window"
        assert rid in self._live, f"trim of unknown request {rid!r}"
        freed = self._live[rid].trim(self.rows, keep_from_token, self.page_size)
        self._request_pages -= len(freed)
        self.num_trimmed_pages += len(freed)
        self.allocator.free(freed)
        return freed

    def release(
        self, rid: str, computed_tokens: Sequence[int] | None, session: str | None = None
    ) -> None:
        """``rid`` is done. Cache the page-aligned prefix of ``computed_tokens`` (the
        tokens whose KV is valid in the row, from position 0) if given; free the rest.
        With ``session``, the session keeps that KV for its next turn: a lock on the full
        pages and the partial last page (a rollback passes the previous turn's tokens).
        A trimmed row caches nothing past its matched prefix; its session keeps a window
        keep if that holds every key the next turn reads, else nothing."""
        assert rid in self._live, f"release of unknown request {rid!r}"
        live = self._live[rid]
        own = live.own_pages
        if computed_tokens is not None:
            live.check_computed(computed_tokens, self.page_size)  # before changing anything
        del self._live[rid]
        if live.num_trimmed:
            kept: list[int] = []
            if session is not None and computed_tokens is not None and self.window is not None:
                kept = self.sessions.keep_window(
                    session, computed_tokens, live.node, live.num_trimmed, own, self.window
                )
            self.tree.unlock(live.node)
            self.allocator.free(own[len(kept) :])
        else:
            taken = slice(0, 0)  # own pages that become the tree's
            if computed_tokens is not None:
                taken = live.insert(self.tree, computed_tokens, self.page_size)
            tail = None
            if session is not None and computed_tokens is not None:
                row_pages = live.matched_pages + own
                num_matched = len(live.matched_pages)
                tail = self.sessions.keep(session, computed_tokens, row_pages, num_matched)
            self.tree.unlock(live.node)
            self.allocator.free([p for p in own[: taken.start] + own[taken.stop :] if p != tail])
        self._request_pages -= len(own)
        self.rows.release(live.row)

    def close_session(self, session: str) -> None:
        """Give back whatever KV ``session`` keeps (nothing if it keeps none)."""
        self.sessions.close(session)

    def session_tokens(self, session: str) -> tuple[int, ...] | None:
        return self.sessions.tokens(session)

    def evict(self, num_pages: int) -> int:
        """Evict at least ``num_pages`` unlocked tree pages if possible; return how many."""
        return self.supply.evict(num_pages)

    def flush(self) -> None:
        """Empty the prefix cache (sessions keep their tokens but lose their KV, so their
        next turn re-prefills). Only when idle: asserts no request holds anything."""
        assert not self._live, f"flush with live requests: {sorted(self._live)[:8]}"
        self.sessions.close_all()
        assert self.rows.num_free == self.rows.num_total, "flush with held rows"
        self.allocator.free(self.tree.reset())
        assert self.allocator.num_free == self.allocator.num_total, "flush leaked pages"
