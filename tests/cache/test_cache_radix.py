"""Unit tests for cache/radix.py: match/split, insert, lock/unlock, LRU eviction, reset."""

import pytest

from shoal.cache.lru import LazyHeap
from shoal.cache.node import IntegrityError, Node
from shoal.cache.radix import RadixTree


def seq(*parts: int, ps: int = 1) -> list[int]:
    """Tokens: each part becomes one page of ``ps`` copies of that id (page-distinct)."""
    return [p for p in parts for _ in range(ps)]


def test_empty_tree_matches_nothing() -> None:
    tree = RadixTree(4)
    pages, node = tree.match([1, 2, 3, 4, 5])
    assert pages == [] and node is tree.root
    assert tree.total_pages == tree.evictable_pages == tree.locked_pages == 0
    tree.check_integrity()


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_insert_then_match_whole_and_partial(ps: int) -> None:
    tree = RadixTree(ps)
    tokens = seq(1, 2, 3, ps=ps)
    assert tree.insert(tokens, [10, 11, 12]) == 0
    assert tree.total_pages == tree.evictable_pages == 3
    pages, node = tree.match(tokens)
    assert pages == [10, 11, 12] and node.value == [10, 11, 12]
    # A partial trailing page never matches.
    pages, _ = tree.match(tokens[: 3 * ps - 1])
    assert pages == [10, 11]
    # Re-inserting is a no-op that reports everything present.
    assert tree.insert(tokens, [20, 21, 22]) == 3 * ps
    assert sorted(tree.all_pages()) == [10, 11, 12]
    tree.check_integrity()


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_match_splits_so_node_covers_exactly_the_prefix(ps: int) -> None:
    tree = RadixTree(ps)
    tree.insert(seq(1, 2, 3, 4, ps=ps), [0, 1, 2, 3])
    pages, node = tree.match(seq(1, 2, 9, ps=ps))
    assert pages == [0, 1]
    assert node.key == tuple(seq(1, 2, ps=ps)) and node.value == [0, 1]
    assert node.parent is tree.root
    (child,) = node.children.values()
    assert child.value == [2, 3] and child.key == tuple(seq(3, 4, ps=ps))
    assert tree.total_pages == 4
    tree.check_integrity()


def test_mismatch_inside_a_page_does_not_match_that_page() -> None:
    tree = RadixTree(4)
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8], [0, 1])
    assert tree.match([1, 2, 3, 4, 5, 6, 7, 9])[0] == [0]
    assert tree.match([1, 2, 3, 9, 5, 6, 7, 8])[0] == []
    tree.check_integrity()


def test_insert_reports_already_present_tokens() -> None:
    tree = RadixTree(2)
    assert tree.insert([1, 1, 2, 2, 3, 3], [0, 1, 2]) == 0
    assert tree.insert([1, 1, 2, 2, 4, 4, 5, 5], [7, 8, 3, 4]) == 4
    # The tree kept its own pages for the shared prefix and took the new suffix.
    assert tree.match([1, 1, 2, 2, 4, 4, 5, 5])[0] == [0, 1, 3, 4]
    assert sorted(tree.all_pages()) == [0, 1, 2, 3, 4]
    # Ending inside an existing node: all present, node split at the boundary.
    assert tree.insert([1, 1], [9]) == 2
    assert tree.insert([], []) == 0
    tree.check_integrity()


def test_insert_asserts_alignment_and_page_count() -> None:
    tree = RadixTree(4)
    with pytest.raises(AssertionError):
        tree.insert([1, 2, 3], [0])
    with pytest.raises(AssertionError):
        tree.insert([1, 2, 3, 4], [0, 1])


def test_lock_moves_pages_between_counters_and_unlock_balances() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2, 3], [0, 1, 2])
    tree.insert([1, 2, 4], [5, 6, 7])  # splits: (1,2) -> {(3), (4)}
    _, node = tree.match([1, 2, 3])
    tree.lock(node)
    assert (tree.locked_pages, tree.evictable_pages) == (3, 1)
    tree.lock(node)
    assert node.lock_ref == 2 and node.parent is not None and node.parent.lock_ref == 2
    tree.unlock(node)
    tree.unlock(node)
    assert (tree.locked_pages, tree.evictable_pages) == (0, 4)
    with pytest.raises(AssertionError, match="no lock"):
        tree.unlock(node)
    tree.lock(tree.root)  # no-op
    tree.unlock(tree.root)
    tree.check_integrity()


def test_split_of_locked_node_copies_lock_ref_and_unlock_stays_consistent() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5])
    _, deep = tree.match([1, 2, 3, 4, 5, 6])
    tree.lock(deep)
    # Another request's insert splits the locked node ...
    assert tree.insert([1, 2, 3, 9], [6, 7, 8, 9]) == 3
    upper = deep.parent
    assert upper is not None and upper is not tree.root
    assert upper.lock_ref == 1 and upper.num_locks == 0 and deep.value == [3, 4, 5]
    # ... and a match splits it again.
    pages, mid = tree.match([1, 2, 3, 4])
    assert pages == [0, 1, 2, 3] and mid.lock_ref == 1
    tree.lock(mid)
    assert tree.locked_pages == 6 and tree.evictable_pages == 1
    tree.check_integrity()
    tree.unlock(deep)  # the original holder unlocks through both splits
    assert deep.lock_ref == 0 and mid.lock_ref == 1 and upper.lock_ref == 1
    assert tree.locked_pages == 4
    tree.unlock(mid)
    assert tree.locked_pages == 0 and tree.evictable_pages == 7
    tree.check_integrity()


def test_evict_lru_order_and_touch_refreshes() -> None:
    tree = RadixTree(1)
    tree.insert([1, 1], [0, 1])  # A
    tree.insert([2, 2], [2, 3])  # B
    tree.insert([3, 3], [4, 5])  # C
    tree.match([1, 1, 7])  # touch A: now B is the oldest
    assert tree.evict(1) == [2, 3]  # whole node, more than asked
    assert tree.evict(2) == [4, 5]
    assert tree.evict(2) == [0, 1]
    assert tree.evict(1) == [] and tree.total_pages == 0
    assert tree.num_evicted_pages == 6
    tree.check_integrity()


def test_evict_cascades_to_parent_that_becomes_a_leaf() -> None:
    tree = RadixTree(2)
    tree.insert(seq(1, 2, 3, ps=2), [0, 1, 2])
    tree.insert(seq(1, 2, 4, ps=2), [7, 8, 3])  # parent (1,2) with leaves (3) and (4)
    tree.insert(seq(5, ps=2), [4])  # an unrelated, newer leaf
    tree.match(seq(5, ps=2))
    freed = tree.evict(4)
    assert sorted(freed) == [0, 1, 2, 3]  # both old leaves, then their parent
    assert tree.all_pages() == [4]
    tree.check_integrity()


def test_eviction_never_touches_locked_nodes_or_their_ancestors() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2, 3], [0, 1, 2])
    tree.insert([1, 2, 4], [9, 9, 3])
    tree.insert([5], [4])
    _, node = tree.match([1, 2, 3])
    tree.lock(node)
    freed = tree.evict(100)
    assert sorted(freed) == [3, 4]
    assert sorted(tree.all_pages()) == [0, 1, 2] and tree.locked_pages == 3
    tree.check_integrity()
    tree.unlock(node)
    assert sorted(tree.evict(100)) == [0, 1, 2]
    tree.check_integrity()


def test_reset_returns_all_pages_and_asserts_nothing_locked() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2], [0, 1])
    tree.insert([3], [2])
    _, node = tree.match([1, 2])
    tree.lock(node)
    with pytest.raises(AssertionError, match="locked"):
        tree.reset()
    tree.unlock(node)
    assert sorted(tree.reset()) == [0, 1, 2]
    assert tree.total_pages == 0 and tree.match([1, 2])[0] == []
    assert tree.evict(10) == []
    tree.check_integrity()
    assert tree.insert([1, 2], [5, 6]) == 0
    tree.check_integrity()


def test_check_integrity_reports_corruption() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2], [0, 1])
    _, node = tree.match([1, 2])
    node.lock_ref += 1
    with pytest.raises(IntegrityError, match="lock_ref"):
        tree.check_integrity()
    node.lock_ref -= 1
    tree.insert([3], [1])
    with pytest.raises(AssertionError, match="page 1 appears twice"):
        tree.check_integrity()


def test_heap_stays_bounded_under_repeated_touches() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2, 3], [0, 1, 2])
    for _ in range(1000):
        tree.match([1, 2, 3])
    assert len(tree._heap) < 200
    tree.check_integrity()
    assert tree.evict(1) == [0, 1, 2]


def test_lazy_heap_skips_stale_entries_and_breaks_ties_fifo() -> None:
    stamps: dict[str, int] = {"a": 1, "b": 1, "c": 2}
    heap: LazyHeap[str] = LazyHeap(lambda item, stamp: stamps.get(item) == stamp)
    for item, stamp in stamps.items():
        heap.push(item, stamp)
    stamps["a"] = 3  # a was touched: its old entry is stale
    heap.push("a", 3)
    assert sorted(heap.live_items()) == ["a", "b", "c"] and len(heap) == 4
    assert [heap.pop(), heap.pop(), heap.pop()] == ["b", "c", "a"]
    assert heap.pop() is None


def test_node_repr_is_readable() -> None:
    assert "lock_ref=0" in repr(Node((1,), [3], None, 0))
