"""The request-slot table, host side: which KV pages each live request's row maps.

Interface::

    table = RowTable(num_rows, max_pages_per_row)
    table.acquire()              -> int | None      # lowest free row
    table.release(row)                              # asserts held; forgets its pages
    table.append(row, pages)     -> RowWrite        # asserts capacity
    table.truncate(row, n)       -> list[int]       # drops pages past n, returns them
    table.skip(row, n)                              # appends n HOLE entries (no device write)
    table.punch(row, start, n)                      # entries start .. start+n-1 become HOLE
    table.pages(row)             -> list[int]       # a copy
    table.held_rows()            -> list[int]
    table.num_free, table.num_total

A row is the host mirror of one line of the device's request-to-page table::

    row r:  [ p0 | p1 | p2 | ... ]     token position t lives in page pages[t // page_size]
              ^ RowWrite(row=r, start=0, pages=(p0, p1))   then
                        RowWrite(row=r, start=2, pages=(p2,))

Every change to a row's content that the device must see comes back as a
``RowWrite``, meaning ``table[row, start:start + len(pages)] = pages`` on the device.
Truncation needs no device write: entries past the row's length are never read.

A ``HOLE`` entry marks a position range whose page was given back while the row lives on
(sliding-window trimming, ``KVCache.trim``): no query of the row reads those positions again.
Holes are host-only: the device line keeps whatever id it held there (a stale page id, or a
previous occupant's), which is never read either, so no ``RowWrite`` is made for them::

    row r:  [ p0 | HOLE | HOLE | p5 | p6 ]     positions 4..11 are outside every reader's window

Invariants: free rows + held rows == num_total; a free row holds no pages; a row
holds at most ``max_pages_per_row`` pages. The table does not own pages; it only
records them (ownership lives in ``KVCache``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["HOLE", "RowTable", "RowWrite"]

HOLE = -1  # a row entry whose page was given back (host side only; never a page id)


class RowWrite(NamedTuple):
    """Device table update: ``table[row, start:start + len(pages)] = pages``."""

    row: int
    start: int
    pages: tuple[int, ...]


class RowTable:
    """Fixed pool of request rows, each an append-only (truncatable) list of page ids."""

    __slots__ = ("_free_heap", "_held", "_max_pages_per_row", "_num_held", "_pages")

    def __init__(self, num_rows: int, max_pages_per_row: int) -> None:
        assert num_rows >= 0, f"num_rows must be >= 0, got {num_rows}"
        assert max_pages_per_row >= 0, f"max_pages_per_row must be >= 0, got {max_pages_per_row}"
        self._max_pages_per_row = max_pages_per_row
        self._free_heap: list[int] = list(range(num_rows))  # sorted, so already a heap
        self._held: list[bool] = [False] * num_rows
        self._pages: list[list[int]] = [[] for _ in range(num_rows)]
        self._num_held = 0

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    @property
    def num_total(self) -> int:
        return len(self._held)

    @property
    def max_pages_per_row(self) -> int:
        return self._max_pages_per_row

    def acquire(self) -> int | None:
        """Hold the lowest free row, or return None if every row is held."""
        if not self._free_heap:
            return None
        row = heapq.heappop(self._free_heap)
        assert not self._held[row] and not self._pages[row], f"free row {row} was not clean"
        self._held[row] = True
        self._num_held += 1
        return row

    def release(self, row: int) -> None:
        """Give ``row`` back; its page list is forgotten (the pages are not freed here)."""
        self._check_held(row)
        self._held[row] = False
        self._pages[row].clear()
        self._num_held -= 1
        heapq.heappush(self._free_heap, row)

    def pages(self, row: int) -> list[int]:
        """A copy of the row's page list."""
        self._check_held(row)
        return list(self._pages[row])

    def num_pages(self, row: int) -> int:
        self._check_held(row)
        return len(self._pages[row])

    def append(self, row: int, pages: Sequence[int]) -> RowWrite:
        """Append ``pages`` to the row and return the matching device write."""
        self._check_held(row)
        row_pages = self._pages[row]
        start = len(row_pages)
        assert start + len(pages) <= self._max_pages_per_row, (
            f"row {row} would hold {start + len(pages)} pages, "
            f"over max_pages_per_row={self._max_pages_per_row}"
        )
        assert HOLE not in pages, f"row {row}: a hole is not a page (use skip)"
        row_pages.extend(pages)
        return RowWrite(row, start, tuple(pages))

    def truncate(self, row: int, num_pages: int) -> list[int]:
        """Drop the row's pages past the first ``num_pages`` and return them."""
        self._check_held(row)
        assert num_pages >= 0, f"truncate to a negative length {num_pages}"
        row_pages = self._pages[row]
        dropped = row_pages[num_pages:]
        del row_pages[num_pages:]
        return dropped

    def skip(self, row: int, num_entries: int) -> None:
        """Append ``num_entries`` holes to the row: positions that hold no page."""
        self._check_held(row)
        row_pages = self._pages[row]
        assert num_entries >= 0, f"skip of a negative count {num_entries}"
        assert len(row_pages) + num_entries <= self._max_pages_per_row, (
            f"row {row} would hold {len(row_pages) + num_entries} entries, "
            f"over max_pages_per_row={self._max_pages_per_row}"
        )
        row_pages.extend([HOLE] * num_entries)

    def punch(self, row: int, start: int, num_entries: int) -> list[int]:
        """Turn entries ``start .. start + num_entries - 1`` into holes; return the pages
        they held (none of which may already be a hole)."""
        self._check_held(row)
        row_pages = self._pages[row]
        assert start >= 0 and start + num_entries <= len(row_pages), (
            f"punch of entries {start}..{start + num_entries - 1} in a row of {len(row_pages)}"
        )
        punched = row_pages[start : start + num_entries]
        assert HOLE not in punched, f"row {row}: entries {start}.. already hold a hole"
        row_pages[start : start + num_entries] = [HOLE] * num_entries
        return punched

    def held_rows(self) -> list[int]:
        return [row for row, held in enumerate(self._held) if held]

    def is_held(self, row: int) -> bool:
        return 0 <= row < len(self._held) and self._held[row]

    def check_integrity(self) -> None:
        """O(num_rows): free and held rows partition the table; free rows are empty."""
        free = set(self._free_heap)
        assert len(free) == len(self._free_heap), "a row appears twice in the free heap"
        for row, held in enumerate(self._held):
            assert held != (row in free), f"row {row} is both held and free, or neither"
            assert held or not self._pages[row], f"free row {row} still lists pages"
            assert len(self._pages[row]) <= self._max_pages_per_row, f"row {row} over capacity"
        assert self._num_held + len(free) == len(self._held), "held + free rows != total rows"

    def _check_held(self, row: int) -> None:
        assert 0 <= row < len(self._held), f"row {row} out of range ({len(self._held)} rows)"
        assert self._held[row], f"row {row} is not held"
