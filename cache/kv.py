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
    cache.holds(rid), cache.row_pages(rid), cache.can_admit_pages(n), cache.check_integrity()
    cache.stats()                            -> KVStats (stats.py)

Page ownership of one live request's row (page_size 4, prompt of 11 tokens,
reserve 14; the tree already held the first 8 tokens)::

    positions    0..3    4..7    8..11   12..15
    row        [ p7    | p3    | p12   | p13   ]     num_cached_tokens == 8
                └── tree's ───┘ └── request's ──┘
                matched at admit, own_pages: freed on release,
                locked via node   or handed to the tree if inserted

Every page has exactly one owner: the allocator's free list, the tree (evictable
when its node's lock_ref is 0, locked otherwise), or one request. At all times::

    free + evictable + locked + request == total pages
    free rows + held rows == total rows

On ``release(rid, computed)`` the page-aligned prefix of ``computed`` is inserted;
the tree answers how many leading tokens it already had. Own pages inside that
prefix are duplicates (another request cached the same tokens first) and are
freed; own pages past it become the tree's; pages past the computed prefix
(including a partial last page) are freed. Then the admit-time lock is dropped.

Sliding window (``window`` W set: no query at position p reads a key at or below p - W).
``trim(rid, keep_from_token)`` frees the request's own pages that lie wholly below
``keep_from_token`` while it runs; the caller (the planner) picks a boundary no launched
batch and no later query reads below. Their row entries become holes (``rows.HOLE``,
host-side; the device keeps the stale id, never read). The tree's pages are not trimmed:
they stay locked until release. Same request after ``trim(rid, 16)``::

    positions    0..3    4..7    8..11   12..15  16..19  20..23
    row        [ p7    | HOLE  | HOLE  | HOLE  | p14   | p15   ]    num_trimmed == 3
                tree's   given back by trim       own_pages

A trimmed row's KV is no longer whole from position 0, so its release inserts nothing past
the matched prefix into the tree and frees all its own pages, and ``publish`` hands nothing
over; a session keeps a window keep instead (session_kv.py), when it holds every key its
next turn reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .node import IntegrityError, Node, path_pages
from .pages import PageAllocator
from .radix import RadixTree
from .rows import HOLE, RowTable, RowWrite
from .session_kv import SessionKV
from .stats import KVStats

__all__ = ["Admission", "KVCache"]


class Admission(NamedTuple):
    """A successful admit: the request's row, its cached prefix and the table writes."""

    row: int
    num_cached_tokens: int
    writes: list[RowWrite]


@dataclass(slots=True)
class _Live:
    """What one live request holds. Its row's entries ==
    matched_pages + [HOLE] * num_trimmed + own_pages."""

    row: int
    node: Node  # locked at admit; covers exactly matched_pages
    cached_tokens: tuple[int, ...]  # the matched prefix, len == len(matched_pages) * page_size
    matched_pages: list[int]  # tree-owned
    own_pages: list[int]  # request-owned
    num_trimmed: int = 0  # row slots after matched_pages whose pages the window let go

    @property
    def num_slots(self) -> int:
        """Page slots the row covers: positions 0 .. num_slots * page_size - 1."""
        return len(self.matched_pages) + self.num_trimmed + len(self.own_pages)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVCache:
    """The cache manager's data: allocator + row table + radix tree, with ownership rules."""

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
        self._live: dict[str, _Live] = {}
        self._request_pages = 0
        self.sessions = SessionKV(self.tree, self.allocator, page_size)

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

    def holds(self, rid: str) -> bool:
        return rid in self._live

    def row_pages(self, rid: str) -> list[int]:
        """The pages of ``rid``'s row in position order (a KV transfer's addresses)."""
        return self.rows.pages(self._live[rid].row)

    def can_admit_pages(self, num_pages: int) -> bool:
        """Whether ``num_pages`` new pages could be had, evicting if needed."""
        return self.allocator.num_free + self.tree.evictable_pages >= num_pages

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
        num_cached_tokens = len(matched_pages) * ps
        kept = self.sessions.get(session) if session is not None else None
        carried: list[int] = []  # the session's pages that continue this turn
        num_holes = 0
        continues = False
        if kept is not None and kept.continues(tokens):
            kept_tree = path_pages(kept.node)
            if kept.num_trimmed and len(matched_pages) < len(kept_tree) + kept.num_trimmed:
                # A window keep: its tree prefix, its holes, its pages (session_kv.py).
                matched_pages, node, num_holes = kept_tree, kept.node, kept.num_trimmed
                continues = True
            elif not kept.num_trimmed and kept.pages and len(matched_pages) == len(kept_tree):
                continues = True  # the session's partial page continues this turn
            if continues:
                carried = kept.pages
                num_cached_tokens = len(kept.tokens)
        num_row_pages = _ceil_div(max(reserve_tokens, num_cached_tokens), ps)
        assert num_row_pages <= self.rows.max_pages_per_row, (
            f"request {rid!r} needs {num_row_pages} pages, over max_pages_per_row="
            f"{self.rows.max_pages_per_row}"
        )
        self.tree.lock(node)  # before evicting: the matched prefix must survive
        num_new = num_row_pages - len(matched_pages) - num_holes - len(carried)
        new_pages = self._take_pages(num_new, session)
        if new_pages is None:
            self.tree.unlock(node)
            return None
        if kept is not None and session is not None:  # the turn now holds the session's KV
            self.sessions.take(session, continues)
        own_pages = carried + new_pages
        row = self.rows.acquire()
        assert row is not None  # checked above; nothing in between releases rows
        cached = tuple(tokens[: len(matched_pages) * ps])
        self._live[rid] = _Live(row, node, cached, matched_pages, own_pages, num_holes)
        self._request_pages += len(own_pages)
        if num_holes == 0:
            writes = [self.rows.append(row, matched_pages + own_pages)]
        else:
            writes = [self.rows.append(row, matched_pages)]
            self.rows.skip(row, num_holes)
            writes.append(self.rows.append(row, own_pages))
        return Admission(row, num_cached_tokens, [w for w in writes if w.pages])

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
        pages = self._take_pages(need)
        if pages is None:
            return None
        live.own_pages.extend(pages)
        self._request_pages += len(pages)
        return [self.rows.append(live.row, pages)]

    def publish(self, rid: str, computed_tokens: Sequence[int]) -> int:
        """While ``rid`` runs on, hand the full pages of its computed prefix to the tree, so
        requests admitted from now on reuse them; ``rid`` locks them as its matched prefix.
        Returns how many leading tokens ``rid`` now has from the tree.

        Only pages the tree lacks are handed over. If the tree already holds more of these
        tokens than ``rid`` matched (another request cached them first), nothing changes:
        ``rid``'s row keeps its own copies (a launched batch may still read them) and
        ``release`` frees the duplicates later. Nor does it once ``rid`` was trimmed: its KV
        is no longer whole from position 0.
        """
        assert rid in self._live, f"publish of unknown request {rid!r}"
        live = self._live[rid]
        ps = self.page_size
        num_matched = len(live.matched_pages)
        if live.num_trimmed:
            return num_matched * ps
        num_pages = min(len(computed_tokens) // ps, num_matched + len(live.own_pages))
        tokens = tuple(computed_tokens[: num_pages * ps])
        common = min(len(tokens), len(live.cached_tokens))
        assert tokens[:common] == live.cached_tokens[:common], (
            f"request {rid!r}: computed tokens differ from its cached prefix"
        )
        if num_pages <= num_matched:
            return num_matched * ps
        present, _ = self.tree.match(tokens)
        if len(present) != num_matched:
            return num_matched * ps
        handed = live.own_pages[: num_pages - num_matched]
        self.tree.insert(tokens, live.matched_pages + handed)
        pages, node = self.tree.match(tokens)
        assert pages == live.matched_pages + handed, "the tree took other pages than handed"
        self.tree.lock(node)
        self.tree.unlock(live.node)
        live.node, live.matched_pages, live.cached_tokens = node, pages, tokens
        live.own_pages = live.own_pages[len(handed) :]
        self._request_pages -= len(handed)
        return num_pages * ps

    def trim(self, rid: str, keep_from_token: int) -> list[int]:
        """Sliding window: free ``rid``'s own pages that lie wholly below position
        ``keep_from_token`` (no launched batch of ``rid`` and no later query reads a key
        there: the caller's promise). Tree pages are left alone (the admit-time lock keeps
        them). Returns the pages freed; their row entries become holes."""
        assert self.window is not None, "trim without a sliding window"
        assert rid in self._live, f"trim of unknown request {rid!r}"
        live = self._live[rid]
        start = len(live.matched_pages) + live.num_trimmed  # the first own page's slot
        num_pages = min(keep_from_token // self.page_size - start, len(live.own_pages))
        if num_pages <= 0:
            return []
        freed = self.rows.punch(live.row, start, num_pages)
        assert freed == live.own_pages[:num_pages], f"request {rid!r}: row and own pages differ"
        del live.own_pages[:num_pages]
        live.num_trimmed += num_pages
        self._request_pages -= num_pages
        self.num_trimmed_pages += num_pages
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
        ps = self.page_size
        num_matched = len(live.matched_pages)
        own = live.own_pages
        if computed_tokens is not None:  # validate before changing anything
            n = len(computed_tokens)
            assert n <= live.num_slots * ps, (
                f"request {rid!r}: {n} computed tokens but the row covers "
                f"{live.num_slots * ps} positions"
            )
            common = min(n, len(live.cached_tokens))
            assert tuple(computed_tokens[:common]) == live.cached_tokens[:common], (
                f"request {rid!r}: computed tokens differ from its cached prefix"
            )
        del self._live[rid]
        if live.num_trimmed:
            kept = self._keep_window(live, computed_tokens, session)
            self.tree.unlock(live.node)
            self.allocator.free(own[len(kept) :])
            self._request_pages -= len(own)
            self.rows.release(live.row)
            return
        keep_lo = keep_hi = 0  # own[keep_lo:keep_hi] become the tree's
        if computed_tokens is not None:
            num_pages = len(computed_tokens) // ps
            if num_pages > 0:
                row_pages = live.matched_pages + own
                present = self.tree.insert(computed_tokens[: num_pages * ps], row_pages[:num_pages])
                num_present = present // ps
                assert num_present >= min(num_matched, num_pages), (
                    f"request {rid!r}: its cached prefix left the tree while locked"
                )
                keep_lo = max(num_present - num_matched, 0)
                keep_hi = max(num_pages - num_matched, keep_lo)
        tail = None
        if session is not None and computed_tokens is not None:
            row_pages = live.matched_pages + own
            tail = self.sessions.keep(session, computed_tokens, row_pages, num_matched)
        self.tree.unlock(live.node)
        self.allocator.free([p for p in own[:keep_lo] + own[keep_hi:] if p != tail])
        self._request_pages -= len(own)
        self.rows.release(live.row)

    def _keep_window(
        self, live: _Live, computed_tokens: Sequence[int] | None, session: str | None
    ) -> list[int]:
        """A trimmed row's release: hand ``session`` a window keep of ``computed_tokens``
        when the next turn's first query (at position len(computed_tokens)) reads no key
        in a trimmed slot. Returns the leading own pages the keep took (the rest is freed)."""
        if session is None or computed_tokens is None or self.window is None:
            return []
        ps = self.page_size
        n = len(computed_tokens)
        first_own = (len(live.matched_pages) + live.num_trimmed) * ps  # first position kept
        if n - self.window + 1 < first_own:
            return []  # e.g. a rollback to before the window: the next turn re-prefills
        kept = live.own_pages[: _ceil_div(n, ps) - len(live.matched_pages) - live.num_trimmed]
        self.sessions.keep_window(session, computed_tokens, live.node, live.num_trimmed, kept)
        return kept

    def close_session(self, session: str) -> None:
        """Give back whatever KV ``session`` keeps (nothing if it keeps none)."""
        self.sessions.close(session)

    def session_tokens(self, session: str) -> tuple[int, ...] | None:
        return self.sessions.tokens(session)

    def evict(self, num_pages: int) -> int:
        """Evict at least ``num_pages`` unlocked tree pages if possible; return how many."""
        freed = self.tree.evict(num_pages)
        self.allocator.free(freed)
        return len(freed)

    def flush(self) -> None:
        """Empty the prefix cache (sessions keep their tokens but lose their KV, so their
        next turn re-prefills). Only when idle: asserts no request holds anything."""
        assert not self._live, f"flush with live requests: {sorted(self._live)[:8]}"
        self.sessions.close_all()
        assert self.rows.num_free == self.rows.num_total, "flush with held rows"
        self.allocator.free(self.tree.reset())
        assert self.allocator.num_free == self.allocator.num_total, "flush leaked pages"

    def _take_pages(self, num_pages: int, spare: str | None = None) -> list[int] | None:
        """Allocate ``num_pages`` request-owned pages, evicting unlocked tree pages (and
        reclaiming idle sessions' KV, but not ``spare``'s) if the free list is short. None,
        with nothing evicted, if even that is not enough."""
        if num_pages <= 0:
            return []
        if not self.can_admit_pages(num_pages):
            self.sessions.reclaim(lambda: self.can_admit_pages(num_pages), spare)
        if not self.can_admit_pages(num_pages):
            return None
        short = num_pages - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.tree.evict(short))
        pages = self.allocator.alloc(num_pages)
        assert pages is not None, "evictable pages could not all be evicted"
        return pages

    # ---- integrity ------------------------------------------------------------

    def check_integrity(self) -> None:
        """O(total pages + rows): every page has exactly one owner; accounting closes."""
        self.tree.check_integrity()
        self.allocator.check_integrity()
        self.rows.check_integrity()
        owner: dict[int, str] = dict.fromkeys(self.tree.all_pages(), "the tree")
        num_request_pages = 0
        num_locks = 0
        for rid, live in self._live.items():
            problem = self._request_problem(live)
            if problem is not None:
                raise IntegrityError(f"kv cache: request {rid!r}: {problem}")
            num_locks += live.node is not self.tree.root
            name = f"request {rid!r}"
            for page in live.own_pages:
                if page in owner:
                    raise IntegrityError(f"kv cache: page {page} owned by {name} and {owner[page]}")
                owner[page] = name
            num_request_pages += len(live.own_pages)
        num_locks += self.sessions.check_integrity(owner)
        for page in owner:
            if self.allocator.is_free(page):
                raise IntegrityError(f"kv cache: page {page} is free but owned by {owner[page]}")
        held = sorted(live.row for live in self._live.values())
        if held != self.rows.held_rows():
            raise IntegrityError(f"kv cache: held rows {self.rows.held_rows()} != live {held}")
        root_locks = sum(child.lock_ref for child in self.tree.root.children.values())
        if root_locks != num_locks:
            raise IntegrityError(f"kv cache: tree holds {root_locks} locks, requests {num_locks}")
        if num_request_pages != self._request_pages:
            raise IntegrityError(
                f"kv cache: request pages {self._request_pages} != recount {num_request_pages}"
            )
        total = (
            self.allocator.num_free
            + self.tree.evictable_pages
            + self.tree.locked_pages
            + self._request_pages
            + self.num_session_pages
        )
        if total != self.allocator.num_total:
            raise IntegrityError(f"kv cache: pages do not add up: {self.stats()}")

    def _request_problem(self, live: _Live) -> str | None:
        """What is wrong with one live request's holdings, or None."""
        if not self.rows.is_held(live.row):
            return f"row {live.row} is not held"
        row_pages = self.rows.pages(live.row)
        if row_pages != live.matched_pages + [HOLE] * live.num_trimmed + live.own_pages:
            return (
                f"row pages {row_pages} != matched {live.matched_pages} + "
                f"{live.num_trimmed} holes + own {live.own_pages}"
            )
        if live.node.evicted:
            return "its locked node was evicted"
        if live.node is not self.tree.root and live.node.num_locks <= 0:
            return "its matched node holds no lock"
        path = path_pages(live.node)
        if path != live.matched_pages:
            return f"tree path pages {path} != matched pages {live.matched_pages}"
        if len(live.cached_tokens) != len(live.matched_pages) * self.page_size:
            return "cached tokens and matched pages disagree"
        return None
