"""The page allocator: which KV pages are free.

Interface::

    alloc = PageAllocator(num_pages)
    alloc.alloc(n)        -> list[int] | None   # all-or-nothing; None if fewer than n free
    alloc.free(pages)                           # give pages back; asserts on double free
    alloc.is_free(page)   -> bool
    alloc.num_free, alloc.num_total
    alloc.check_integrity()                     # O(num_pages), for idle-time checks

Invariants:

* Page ids are ``0 .. num_pages - 1``; page 0 is an ordinary page (the executor
  handles padding itself).
* A page is either in the free list or owned by someone else (the radix tree or
  one request); the allocator knows only the first half of that sentence, so
  ``num_free + (pages handed out) == num_total``.
* Freeing a page that is already free, out of range, or listed twice in one call
  raises AssertionError and changes nothing.

The free list is a stack: freshly freed pages are reused first (their contents are
warm in no cache that matters, but LIFO keeps the working set of page ids small,
which makes tables and logs easier to read). A fresh allocator hands out pages in
ascending order.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["PageAllocator"]


class PageAllocator:
    """A free list of KV page ids with O(1) alloc/free per page."""

    __slots__ = ("_free_list", "_is_free", "_num_total")

    def __init__(self, num_pages: int) -> None:
        assert num_pages >= 0, f"num_pages must be >= 0, got {num_pages}"
        self._num_total = num_pages
        # Reversed so that pop() hands out 0, 1, 2, ... from a fresh allocator.
        self._free_list: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free: bytearray = bytearray(b"\x01" * num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free_list)

    @property
    def num_total(self) -> int:
        return self._num_total

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` pages, or none at all (returns None) if fewer than ``n`` are free."""
        assert n >= 0, f"alloc of a negative page count {n}"
        free_list = self._free_list
        if n > len(free_list):
            return None
        if n == 0:
            return []
        pages = free_list[-n:]
        del free_list[-n:]
        pages.reverse()
        is_free = self._is_free
        for page in pages:
            is_free[page] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Give ``pages`` back. Asserts (before changing anything) that each was held."""
        pages = list(pages)
        if not pages:
            return
        is_free = self._is_free
        num_total = self._num_total
        for page in pages:
            assert 0 <= page < num_total, f"free of out-of-range page {page} (pool {num_total})"
            assert not is_free[page], f"double free of page {page}"
        assert len(set(pages)) == len(pages), f"page listed twice in one free: {sorted(pages)}"
        for page in pages:
            is_free[page] = 1
        # Push in reverse so the first page given back is the next one handed out.
        self._free_list.extend(reversed(pages))

    def is_free(self, page: int) -> bool:
        assert 0 <= page < self._num_total, f"page {page} out of range (pool {self._num_total})"
        return bool(self._is_free[page])

    def check_integrity(self) -> None:
        """O(num_pages): the free list and the free flags agree, with no duplicates."""
        free_list = self._free_list
        assert len(set(free_list)) == len(free_list), "page appears twice in the free list"
        for page in free_list:
            assert 0 <= page < self._num_total, f"free list holds out-of-range page {page}"
            assert self._is_free[page], f"page {page} in the free list but flagged held"
        assert sum(self._is_free) == len(free_list), (
            f"{sum(self._is_free)} pages flagged free but free list has {len(free_list)}"
        )
