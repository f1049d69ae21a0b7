"""PageSupply: where a live request's new pages come from (part of KVCache, kv.py).

In this order: the allocator's free list; then the tree's least recently used unlocked
leaves, evicted; and when even all of those are too few, idle sessions give their KV back,
least recently kept first (``SessionKV.reclaim``), never the session whose turn asks. A
request gets all the pages it asks for or none, and then nothing is evicted.
"""

from __future__ import annotations

from .pages import PageAllocator
from .radix import RadixTree
from .session_kv import SessionKV


class PageSupply:
    def __init__(self, allocator: PageAllocator, tree: RadixTree, sessions: SessionKV) -> None:
        self.allocator = allocator
        self.tree = tree
        self.sessions = sessions

    def can_take(self, num_pages: int) -> bool:
        """Whether ``num_pages`` new pages could be had, evicting if needed."""
        return self.allocator.num_free + self.tree.evictable_pages >= num_pages

    def take(self, num_pages: int, spare: str | None = None) -> list[int] | None:
        """Allocate ``num_pages`` pages, evicting unlocked tree pages (and reclaiming idle
        sessions' KV, but not ``spare``'s) if the free list is short. None, with nothing
        evicted, if even that is not enough."""
        if num_pages <= 0:
            return []
        if not self.can_take(num_pages):
            self.sessions.reclaim(lambda: self.can_take(num_pages), spare)
        if not self.can_take(num_pages):
            return None
        short = num_pages - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.tree.evict(short))
        pages = self.allocator.alloc(num_pages)
        assert pages is not None, "evictable pages could not all be evicted"
        return pages

    def evict(self, num_pages: int) -> int:
        """Evict at least ``num_pages`` unlocked tree pages if possible; return how many."""
        freed = self.tree.evict(num_pages)
        self.allocator.free(freed)
        return len(freed)
