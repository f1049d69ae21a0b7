"""LiveRequest: what one live request holds in the cache, and the ways its own pages change
hands while it lives (part of KVCache, kv.py). Its row's entries are always::

    matched_pages + [HOLE] * num_trimmed + own_pages
    └ the tree's ┘  └ given back by trim ┘  └ the request's ┘

(``KVCache`` keeps it so; the audit checks it, audit.py.) ``matched_pages`` are the tree's
pages of its cached prefix, locked through ``node``; ``own_pages`` are the request's alone.
Own pages become the tree's by ``publish`` (while it runs) or ``insert`` (at release), or
holes by ``trim``.

Sliding window (``KVCache.window`` W: no query at position p reads a key at or below p - W).
``trim(keep_from_token)`` turns the own pages wholly below ``keep_from_token`` into holes; the
caller (the planner) picks a boundary no launched batch and no later query reads below. Holes
are host-side (``rows.HOLE``; the device keeps the stale id, never read). The tree's pages
are not trimmed: they stay locked until release. kv.py's request after ``trim(16)``::

    positions    0..3    4..7    8..11   12..15  16..19  20..23
    row        [ p7    | HOLE  | HOLE  | HOLE  | p14   | p15   ]    num_trimmed == 3
                tree's   given back by trim       own_pages

A trimmed row's KV is no longer whole from position 0, so it publishes and inserts nothing
more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .node import Node
from .radix import RadixTree
from .rows import RowTable, RowWrite


@dataclass(slots=True)
class LiveRequest:
    rid: str
    row: int
    node: Node  # locked; covers exactly matched_pages
    cached_tokens: tuple[int, ...]  # the matched prefix, len == len(matched_pages) * page_size
    matched_pages: list[int]  # tree-owned
    own_pages: list[int]  # request-owned
    num_trimmed: int = 0  # row slots after matched_pages whose pages the window let go

    @property
    def num_slots(self) -> int:
        """Page slots the row covers: positions 0 .. num_slots * page_size - 1."""
        return len(self.matched_pages) + self.num_trimmed + len(self.own_pages)

    def fill_row(self, rows: RowTable) -> list[RowWrite]:
        """At admission: write the fresh row's entries; return the device writes."""
        if self.num_trimmed == 0:
            writes = [rows.append(self.row, self.matched_pages + self.own_pages)]
        else:
            writes = [rows.append(self.row, self.matched_pages)]
            rows.skip(self.row, self.num_trimmed)
            writes.append(rows.append(self.row, self.own_pages))
        return [w for w in writes if w.pages]

    def check_computed(self, computed_tokens: Sequence[int], page_size: int) -> None:
        """Assert that ``computed_tokens`` fit the row and begin with its cached prefix."""
        n = len(computed_tokens)
        assert n <= self.num_slots * page_size, (
            f"request {self.rid!r}: {n} computed tokens but the row covers "
            f"{self.num_slots * page_size} positions"
        )
        common = min(n, len(self.cached_tokens))
        assert tuple(computed_tokens[:common]) == self.cached_tokens[:common], (
            f"request {self.rid!r}: computed tokens differ from its cached prefix"
        )

    def publish(self, tree: RadixTree, computed_tokens: Sequence[int], page_size: int) -> int:
        """Hand the full pages of the computed prefix that the tree lacks to the tree: they
        become the row's matched prefix, locked in place of the old one. Returns how many own
        pages were handed over.

        If the tree already holds more of these tokens than were matched (another request
        cached them first), nothing changes: the row keeps its own copies (a launched batch
        may still read them) and release frees the duplicates. Nor once trimmed."""
        ps = page_size
        num_matched = len(self.matched_pages)
        if self.num_trimmed:
            return 0
        num_pages = min(len(computed_tokens) // ps, num_matched + len(self.own_pages))
        tokens = tuple(computed_tokens[: num_pages * ps])
        common = min(len(tokens), len(self.cached_tokens))
        assert tokens[:common] == self.cached_tokens[:common], (
            f"request {self.rid!r}: computed tokens differ from its cached prefix"
        )
        if num_pages <= num_matched:
            return 0
        present, _ = tree.match(tokens)
        if len(present) != num_matched:
            return 0
        handed = self.own_pages[: num_pages - num_matched]
        tree.insert(tokens, self.matched_pages + handed)
        pages, node = tree.match(tokens)
        assert pages == self.matched_pages + handed, "the tree took other pages than handed"
        tree.lock(node)
        tree.unlock(self.node)
        self.node, self.matched_pages, self.cached_tokens = node, pages, tokens
        self.own_pages = self.own_pages[len(handed) :]
        return len(handed)

    def insert(self, tree: RadixTree, computed_tokens: Sequence[int], page_size: int) -> slice:
        """At release (untrimmed): insert the page-aligned prefix of ``computed_tokens``.
        Returns the own pages the tree took over, as a slice of ``own_pages``; those before
        it duplicate pages the tree already had."""
        num_matched = len(self.matched_pages)
        num_pages = len(computed_tokens) // page_size
        if num_pages == 0:
            return slice(0, 0)
        row_pages = self.matched_pages + self.own_pages
        present = tree.insert(computed_tokens[: num_pages * page_size], row_pages[:num_pages])
        num_present = present // page_size
        assert num_present >= min(num_matched, num_pages), (
            f"request {self.rid!r}: its cached prefix left the tree while locked"
        )
        first = max(num_present - num_matched, 0)
        return slice(first, max(num_pages - num_matched, first))

    def trim(self, rows: RowTable, keep_from_token: int, page_size: int) -> list[int]:
        """Turn the own pages that lie wholly below position ``keep_from_token`` into holes;
        return them: the request owns them no more (the caller frees them)."""
        start = len(self.matched_pages) + self.num_trimmed  # the first own page's slot
        num_pages = min(keep_from_token // page_size - start, len(self.own_pages))
        if num_pages <= 0:
            return []
        punched = rows.punch(self.row, start, num_pages)
        assert punched == self.own_pages[:num_pages], (
            f"request {self.rid!r}: row and own pages differ"
        )
        del self.own_pages[:num_pages]
        self.num_trimmed += num_pages
        return punched
