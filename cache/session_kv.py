"""SessionKV: the KV that streaming sessions keep between turns (part of KVCache).

A session that finished a turn keeps a lock on the tree node covering the full pages of its
tokens, and its partial last page, which belongs to the session alone (docs/architecture.md,
"Lifecycle laws", law 4)::

    tokens     t0 .. t15 | t16 .. t31 | t32 t33          page_size 16
    pages      [ tree's, locked ]      [ tail page ]     session-owned; None when aligned

The next turn takes the keep over (`take`): the tree pages become its matched prefix, and
the tail page its first own page if the turn continues exactly these tokens. Under memory
pressure idle sessions give their KV back, least recently kept first (`reclaim`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .node import IntegrityError, Node, path_pages
from .pages import PageAllocator
from .radix import RadixTree


@dataclass(slots=True)
class SessionKeep:
    node: Node  # locked; covers exactly the full pages of `tokens`
    tokens: tuple[int, ...]  # whose KV it keeps: full pages in the tree, then the tail
    tail_page: int | None  # positions len(full) .. len(tokens), or None when aligned
    last_used: int


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
        """Pages the sessions own (their tails; their full pages are the tree's)."""
        return sum(k.tail_page is not None for k in self._keeps.values())

    def get(self, session: str) -> SessionKeep | None:
        return self._keeps.get(session)

    def tokens(self, session: str) -> tuple[int, ...] | None:
        keep = self._keeps.get(session)
        return keep.tokens if keep is not None else None

    def keep(self, session: str, tokens: Sequence[int], row_pages: list[int]) -> int | None:
        """Lock the (just inserted) full pages of ``tokens`` for ``session``; return its
        tail page, which the caller must not free."""
        assert session not in self._keeps, f"session {session!r} already keeps KV"
        ps = self.page_size
        full = len(tokens) - len(tokens) % ps
        pages, node = self.tree.match(tokens[:full])
        assert len(pages) * ps == full, f"session {session!r}: its pages left the tree"
        self.tree.lock(node)
        tail = row_pages[full // ps] if full < len(tokens) else None
        self._clock += 1
        self._keeps[session] = SessionKeep(node, tuple(tokens), tail, self._clock)
        return tail

    def take(self, session: str, tail_continues: bool) -> None:
        """A turn of ``session`` was admitted and holds its KV now: drop the keep's lock,
        and free its tail page unless the turn continues on it."""
        keep = self._keeps.pop(session)
        self.tree.unlock(keep.node)
        if keep.tail_page is not None and not tail_continues:
            self.allocator.free([keep.tail_page])  # not reusable for the turn's tokens

    def close(self, session: str) -> None:
        """Give back whatever KV ``session`` keeps (nothing if it keeps none)."""
        if session in self._keeps:
            self.take(session, tail_continues=False)

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
        """Each keep still covers its full pages, and its tail has no other owner (adds the
        tails to ``owner``). Returns the number of tree locks the keeps hold."""
        num_locks = 0
        for name, keep in self._keeps.items():
            full = len(keep.tokens) - len(keep.tokens) % self.page_size
            if keep.node.evicted or len(path_pages(keep.node)) * self.page_size != full:
                raise IntegrityError(f"kv cache: session {name!r} lost its tree pages")
            num_locks += keep.node is not self.tree.root
            if keep.tail_page is not None:
                if keep.tail_page in owner:
                    raise IntegrityError(
                        f"kv cache: page {keep.tail_page} owned by session {name!r} "
                        f"and {owner[keep.tail_page]}"
                    )
                owner[keep.tail_page] = f"session {name!r}"
        return num_locks
