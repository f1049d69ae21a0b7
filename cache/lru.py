"""A lazy min-heap of eviction candidates, keyed by a logical last-access stamp.

Interface::

    heap = LazyHeap(is_live)        # is_live(item, stamp) -> bool
    heap.push(item, stamp)          # O(log n); re-push after each stamp change
    heap.pop()        -> item | None  # the live entry with the least stamp (FIFO on ties)
    heap.live_items() -> list[item]   # O(n), for integrity checks
    heap.clear()

Entries are never removed or updated in place. When an item's stamp changes or it
stops being a candidate, its old entries simply go stale: ``is_live(item, stamp)``
answers whether an entry still counts, and ``pop`` skips the ones that do not.
Duplicate live entries are allowed (the caller makes the item dead once it is
popped). When stale entries outnumber live ones the heap is rebuilt from the live
ones, so the cost stays amortized O(log n) per push and the size stays
O(live items).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["LazyHeap"]

T = TypeVar("T")


class LazyHeap(Generic[T]):
    """Min-heap of ``(stamp, seq, item)`` with lazy deletion of stale entries."""

    __slots__ = ("_compact_at", "_entries", "_is_live", "_seq")

    def __init__(self, is_live: Callable[[T, int], bool]) -> None:
        self._is_live = is_live
        self._entries: list[tuple[int, int, T]] = []
        self._seq = itertools.count()  # tie-break: insertion order, never compares items
        self._compact_at = 64

    def __len__(self) -> int:
        """Number of entries, stale ones included."""
        return len(self._entries)

    def push(self, item: T, stamp: int) -> None:
        heapq.heappush(self._entries, (stamp, next(self._seq), item))
        if len(self._entries) >= self._compact_at:
            self._compact()

    def pop(self) -> T | None:
        """Remove and return the live item with the least stamp, or None if none is live."""
        entries = self._entries
        while entries:
            stamp, _, item = heapq.heappop(entries)
            if self._is_live(item, stamp):
                return item
        return None

    def live_items(self) -> list[T]:
        return [item for stamp, _, item in self._entries if self._is_live(item, stamp)]

    def clear(self) -> None:
        self._entries.clear()
        self._compact_at = 64

    def _compact(self) -> None:
        """Keep one live entry per item; the next compaction waits for as many pushes."""
        kept: dict[int, tuple[int, int, T]] = {}
        for entry in self._entries:
            stamp, _, item = entry
            if id(item) not in kept and self._is_live(item, stamp):
                kept[id(item)] = entry
        self._entries = list(kept.values())
        heapq.heapify(self._entries)
        self._compact_at = 2 * len(self._entries) + 64
