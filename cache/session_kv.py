"""SessionKV: the KV that streaming sessions keep between turns (part of KVCache).

A session that finished a turn keeps a lock on the tree node covering the full pages of its
tokens, and its partial last page, which belongs to the session alone (docs/architecture.md,
"Lifecycle laws", law 4)::

    tokens     t0 .. t15 | t16 .. t31 | t32 t33          page_size 16
    pages      [ tree's, locked ]      [ pages[0] ]      session-owned; [] when aligned

A turn whose row a sliding window trimmed (``KVCache.trim``) inserts nothing into the tree:
its KV is no longer whole from position 0. Its session keeps a window keep instead: the lock
on the row's matched prefix (the tree's, possibly none), the number of trimmed page slots
after it, and the row's remaining pages, all the session's own::

    positions  0 .. 15 | 16 .. 47 (2 pages) | 48 .. 63 | 64 .. 69     page_size 16, W 20
    keep       [tree's] [ num_trimmed == 2 ] [ pages[0] | pages[1] ]

It is kept only while it holds every key the next turn reads: that turn's first query, at
position len(tokens), reads keys from len(tokens) - W + 1 on, which must not lie in the
trimmed slots (``KVCache.release`` checks; otherwise the session keeps nothing and its next
turn re-prefills its history).

The next turn takes the keep over (`take`): the tree pages become its matched prefix, the
trimmed slots its row's first holes and the keep's pages its first own pages, if the turn
continues exactly these tokens and the keep adds to what the tree matches
(`SessionKeep.continuation`). Under memory pressure idle sessions give their KV back, least
recently kept first (`reclaim`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .node import IntegrityError, Node, path_pages
from .pages import PageAllocator
from .radix import RadixTree


class Continuation(NamedTuple):
    """How a turn's row starts on its session's keep: the tree prefix it locks, the holes
    after it, the session's pages it carries on, and the tokens all of them cover."""

    matched_pages: list[int]
    node: Node
    num_holes: int
    carried: list[int]
    num_cached_tokens: int


@dataclass(slots=True)
class SessionKeep:
    node: Node  # locked; its path's pages hold positions 0 .. (its page count) * page_size
    tokens: tuple[int, ...]  # whose KV it keeps: the node's pages, the trimmed slots, `pages`
    num_trimmed: int  # page slots after the node's pages whose KV a window let go (0: none)
    pages: list[int]  # session-owned: the remaining positions, up to len(tokens)
    last_used: int

    def continues(self, tokens: Sequence[int]) -> bool:
        """Whether a turn of ``tokens`` goes on exactly from this keep's tokens."""
        n = len(self.tokens)
        return n < len(tokens) and tuple(tokens[:n]) == self.tokens

    def continuation(
        self, tokens: Sequence[int], matched_pages: list[int], node: Node
    ) -> Continuation | None:
        """How a turn of ``tokens`` starts on this keep, given the tree's match
        (``matched_pages``, ``node``); None when it starts from that match alone (the turn
        does not go on from these tokens, or the keep adds nothing to the match)."""
        if not self.continues(tokens):
            return None
        kept_tree = path_pages(self.node)
        if self.num_trimmed:  # a window keep: its tree prefix, its holes, its pages
            if len(matched_pages) >= len(kept_tree) + self.num_trimmed:
                return None
            matched_pages, node = kept_tree, self.node
        elif not self.pages or len(matched_pages) != len(kept_tree):
            return None  # an aligned keep adds nothing; its partial page fits only its match
        return Continuation(matched_pages, node, self.num_trimmed, self.pages, len(self.tokens))


class SessionKV:
    def __init__(self, tree: RadixTree, allocator: PageAllocator, page_size: int) -> None:
        self.tree = tree
        self.allocator = allocator
        self.page_size = page_size
        self._keeps: dict[str, SessionKeep] = {}
        self._clock = 0
        self.num_reclaimed = 0  # idle sessions that gave their KV back under pressure

    def __len__(self) -> int:
        return len(self._keeps)

    @property
    def num_pages(self) -> int:
        """Pages the sessions own (their tails and window keeps' pages; the rest is the
        tree's)."""
        return sum(len(k.pages) for k in self._keeps.values())

    def get(self, session: str) -> SessionKeep | None:
        return self._keeps.get(session)

    def tokens(self, session: str) -> tuple[int, ...] | None:
        keep = self._keeps.get(session)
        return keep.tokens if keep is not None else None

    def keep(
        self, session: str, tokens: Sequence[int], row_pages: list[int], num_matched: int
    ) -> int | None:
        """Lock the (just inserted) full pages of ``tokens`` for ``session``; return its
        tail page, which the caller must not free. The first ``num_matched`` row pages are
        the tree's: a partial page among them (a rollback shorter than the matched prefix)
        is not kept, and the session keeps only the full pages' tokens."""
        ps = self.page_size
        full = len(tokens) - len(tokens) % ps
        pages, node = self.tree.match(tokens[:full])
        assert len(pages) * ps == full, f"session {session!r}: its pages left the tree"
        tail = None
        if full < len(tokens):
            if full // ps >= num_matched:
                tail = row_pages[full // ps]
            else:
                tokens = tokens[:full]  # that page is the tree's, not the session's to own
        self._add(session, node, tokens, 0, [] if tail is None else [tail])
        return tail

    def keep_window(
        self,
        session: str,
        tokens: Sequence[int],
        node: Node,
        num_trimmed: int,
        own_pages: list[int],
        window: int,
    ) -> list[int]:
        """A trimmed row's release: keep its KV for ``session`` when the next turn's first
        query (at position len(tokens)) reads no key in a trimmed slot: a lock on ``node``
        (the row's matched prefix), ``num_trimmed`` slots with no page, then the leading
        ``own_pages`` that hold the rest of ``tokens``. Returns those pages, the session's
        now (the caller must not free them); none when nothing is kept."""
        ps = self.page_size
        n = len(tokens)
        num_tree = len(path_pages(node))
        if n - window + 1 < (num_tree + num_trimmed) * ps:
            return []  # e.g. a rollback to before the window: the next turn re-prefills
        pages = own_pages[: -(-n // ps) - num_tree - num_trimmed]
        num_slots = num_tree + num_trimmed + len(pages)
        assert num_slots * ps >= n > (num_slots - 1) * ps, (
            f"session {session!r}: {num_slots} page slots for {n} tokens"
        )
        self._add(session, node, tokens, num_trimmed, pages)
        return pages

    def _add(
        self, session: str, node: Node, tokens: Sequence[int], num_trimmed: int, pages: list[int]
    ) -> None:
        assert session not in self._keeps, f"session {session!r} already keeps KV"
        self.tree.lock(node)
        self._clock += 1
        self._keeps[session] = SessionKeep(node, tuple(tokens), num_trimmed, pages, self._clock)

    def take(self, session: str, continues: bool) -> None:
        """A turn of ``session`` was admitted and holds its KV now: drop the keep's lock,
        and free its pages unless the turn continues on them (its row took them over)."""
        keep = self._keeps.pop(session)
        self.tree.unlock(keep.node)
        if not continues:
            self.allocator.free(keep.pages)  # not reusable for the turn's tokens

    def close(self, session: str) -> None:
        """Give back whatever KV ``session`` keeps (nothing if it keeps none)."""
        if session in self._keeps:
            self.take(session, continues=False)

    def close_all(self) -> None:
        for session in list(self._keeps):
            self.close(session)

    def reclaim(self, enough: Callable[[], bool], spare: str | None) -> None:
        """Close idle sessions, least recently kept first, until ``enough()`` (their next
        turns re-prefill from the tree); never ``spare``."""
        for name in sorted(self._keeps, key=lambda n: self._keeps[n].last_used):
            if enough():
                return
            if name != spare:
                self.close(name)
                self.num_reclaimed += 1

    def check_integrity(self, owner: dict[int, str]) -> int:
        """Each keep's tree pages, trimmed slots and own pages still cover its tokens (a
        keep that trimmed nothing: its full pages are the tree's, its partial page its
        own), and its pages have no other owner (adds them to ``owner``). Returns the
        number of tree locks the keeps hold."""
        ps = self.page_size
        num_locks = 0
        for name, keep in self._keeps.items():
            n = len(keep.tokens)
            num_tree = len(path_pages(keep.node))
            whole = num_tree + keep.num_trimmed + len(keep.pages) == -(-n // ps)
            aligned = keep.num_trimmed > 0 or num_tree * ps == n - n % ps
            if keep.node.evicted or not whole or not aligned:
                raise IntegrityError(f"kv cache: session {name!r} lost its tree pages")
            num_locks += keep.node is not self.tree.root
            for page in keep.pages:
                if page in owner:
                    raise IntegrityError(
                        f"kv cache: page {page} owned by session {name!r} and {owner[page]}"
                    )
                owner[page] = f"session {name!r}"
        return num_locks
