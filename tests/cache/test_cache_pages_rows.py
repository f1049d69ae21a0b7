"""Unit tests for cache/pages.py (PageAllocator) and cache/rows.py (RowTable)."""

import pytest

from shoal.cache.pages import PageAllocator
from shoal.cache.rows import RowTable, RowWrite

# ---- PageAllocator -------------------------------------------------------------


def test_fresh_allocator_hands_out_ascending_pages_including_zero() -> None:
    alloc = PageAllocator(5)
    assert (alloc.num_free, alloc.num_total) == (5, 5)
    assert alloc.alloc(3) == [0, 1, 2]
    assert alloc.num_free == 2
    assert not alloc.is_free(0) and alloc.is_free(3)
    alloc.check_integrity()


def test_alloc_is_all_or_nothing() -> None:
    alloc = PageAllocator(4)
    assert alloc.alloc(5) is None
    assert alloc.num_free == 4
    pages = alloc.alloc(4)
    assert pages is not None and sorted(pages) == [0, 1, 2, 3]
    assert alloc.alloc(1) is None
    assert alloc.alloc(0) == []
    alloc.check_integrity()


def test_free_returns_pages_and_reuses_them() -> None:
    alloc = PageAllocator(4)
    pages = alloc.alloc(4)
    assert pages is not None
    alloc.free([2, 0])
    assert alloc.num_free == 2 and alloc.is_free(0) and alloc.is_free(2)
    again = alloc.alloc(2)
    assert again is not None and sorted(again) == [0, 2]
    alloc.free(iter([0, 1, 2, 3]))  # any iterable
    assert alloc.num_free == 4
    alloc.check_integrity()


def test_double_free_and_out_of_range_assert_and_change_nothing() -> None:
    alloc = PageAllocator(4)
    assert alloc.alloc(2) == [0, 1]
    with pytest.raises(AssertionError, match="double free"):
        alloc.free([0, 2])  # 2 is free already
    assert not alloc.is_free(0)  # the 0 in that call was not freed
    with pytest.raises(AssertionError, match="out-of-range"):
        alloc.free([1, 4])
    with pytest.raises(AssertionError, match="out-of-range"):
        alloc.free([-1])
    with pytest.raises(AssertionError, match="twice"):
        alloc.free([1, 1])
    assert alloc.num_free == 2 and not alloc.is_free(1)
    alloc.check_integrity()


def test_empty_allocator() -> None:
    alloc = PageAllocator(0)
    assert alloc.alloc(0) == [] and alloc.alloc(1) is None
    alloc.free([])
    alloc.check_integrity()


# ---- RowTable ------------------------------------------------------------------


def test_acquire_gives_lowest_free_row() -> None:
    rows = RowTable(3, 4)
    assert [rows.acquire(), rows.acquire(), rows.acquire()] == [0, 1, 2]
    assert rows.acquire() is None
    assert (rows.num_free, rows.num_total) == (0, 3)
    rows.release(1)
    rows.release(0)
    assert rows.acquire() == 0
    assert rows.acquire() == 1
    assert rows.held_rows() == [0, 1, 2]
    rows.check_integrity()


def test_append_returns_row_writes_and_pages_is_a_copy() -> None:
    rows = RowTable(2, 4)
    row = rows.acquire()
    assert row == 0
    assert rows.append(row, [5, 6]) == RowWrite(row=0, start=0, pages=(5, 6))
    assert rows.append(row, [9]) == RowWrite(row=0, start=2, pages=(9,))
    assert rows.append(row, []) == RowWrite(0, 3, ())
    pages = rows.pages(row)
    assert pages == [5, 6, 9]
    pages.append(100)
    assert rows.pages(row) == [5, 6, 9]
    assert rows.num_pages(row) == 3


def test_append_asserts_capacity() -> None:
    rows = RowTable(1, 3)
    row = rows.acquire()
    assert row is not None
    rows.append(row, [1, 2])
    with pytest.raises(AssertionError, match="max_pages_per_row"):
        rows.append(row, [3, 4])
    assert rows.pages(row) == [1, 2]


def test_truncate_drops_tail_and_returns_it() -> None:
    rows = RowTable(1, 8)
    row = rows.acquire()
    assert row is not None
    rows.append(row, [1, 2, 3, 4])
    assert rows.truncate(row, 2) == [3, 4]
    assert rows.pages(row) == [1, 2]
    assert rows.truncate(row, 5) == []
    assert rows.append(row, [7]) == RowWrite(row, 2, (7,))


def test_release_clears_pages_and_asserts_held() -> None:
    rows = RowTable(2, 4)
    row = rows.acquire()
    assert row is not None
    rows.append(row, [1, 2])
    rows.release(row)
    with pytest.raises(AssertionError, match="not held"):
        rows.release(row)
    with pytest.raises(AssertionError, match="not held"):
        rows.pages(row)
    with pytest.raises(AssertionError, match="out of range"):
        rows.release(7)
    assert rows.acquire() == row
    assert rows.pages(row) == []
    rows.check_integrity()
