"""A page-aligned radix tree over token ids whose edges own KV pages (the prefix cache).

Interface::

    tree = RadixTree(page_size)
    tree.match(tokens)          -> (pages, node)  # longest cached page-aligned prefix
    tree.insert(tokens, pages)  -> int            # leading TOKENS already present
    tree.lock(node) / tree.unlock(node)           # pin node and its ancestors
    tree.evict(num_pages)       -> list[int]      # LRU unlocked leaves, cascading
    tree.reset()                -> list[int]      # flush everything (nothing locked)
    tree.evictable_pages, tree.locked_pages, tree.total_pages   # O(1) counters
    tree.all_pages(), tree.check_integrity()      # O(tree size)

Shape (page_size 2; a node's key is its edge's tokens, its value the pages
holding their KV, one page per ``page_size`` tokens)::

    root ──(1,2)──> A key=(1,2,3,4)  value=[7, 3]  lock_ref=1 ──(5,6)──> B key=(5,6) value=[9]
         │                                          │                      lock_ref=1, num_locks=1
         │                                          └─(8,8)──> C key=(8,8) value=[4]  lock_ref=0
         └─(9,9)──> D key=(9,9) value=[2]  lock_ref=0

Invariants (checked by ``check_integrity``):

* Every non-root node's key is a non-empty multiple of ``page_size`` tokens and
  ``len(value) == len(key) // page_size``. Children are keyed by their first page of
  tokens (a tuple of ``page_size`` ids; with page_size 1, the first token).
* ``lock_ref(n) == num_locks(n) + sum(lock_ref(c) for c in children(n))``, where
  ``num_locks`` counts ``lock(n)`` calls not yet unlocked. Hence a parent's
  lock_ref is at least each child's, and an unlocked node has no locked descendant.
* ``locked_pages`` / ``evictable_pages`` are the pages of nodes with lock_ref > 0 /
  == 0; no page appears twice. The tree owns all of them.
* A split keeps the deeper node's identity (so a request holding that node still
  unlocks the right thing); the new upper node copies its lock_ref and gets no
  locks of its own.
* Every unlocked leaf has a live entry in the eviction heap, keyed by its last
  access on a logical clock (bumped once per match/insert), so ``evict`` never
  walks the tree. Stale entries are skipped and compacted away lazily.
"""

from __future__ import annotations

from collections.abc import Sequence

from .lru import LazyHeap
from .node import IntegrityError, Node, Tokens, node_problem, walk

__all__ = ["IntegrityError", "Node", "RadixTree"]


class RadixTree:
    """Prefix cache: page-aligned token prefixes mapped to the KV pages that hold them."""

    def __init__(self, page_size: int) -> None:
        assert page_size >= 1, f"page_size must be >= 1, got {page_size}"
        self.page_size = page_size
        self._clock = 0
        self.root = Node((), [], None, 0)
        self._evictable_pages = 0
        self._locked_pages = 0
        self._num_nodes = 0  # excluding the root
        self.num_evicted_pages = 0  # cumulative, for metrics and tests
        # Eviction candidates keyed by last_access. An entry is live while its node is
        # an unevicted, unlocked leaf whose last_access still equals the entry's stamp.
        self._heap: LazyHeap[Node] = LazyHeap(self._is_candidate)

    # ---- counters -------------------------------------------------------------

    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    @property
    def locked_pages(self) -> int:
        return self._locked_pages

    @property
    def total_pages(self) -> int:
        return self._evictable_pages + self._locked_pages

    # ---- lookup and insertion -------------------------------------------------

    def match(self, tokens: Sequence[int]) -> tuple[list[int], Node]:
        """Longest cached page-aligned prefix of ``tokens``: its pages and deepest node.

        If the match ends inside a node, that node is split so the returned node
        covers exactly the matched prefix. Touches the LRU clock along the path.
        """
        toks = tuple(tokens)
        ps = self.page_size
        now = self._tick()
        node = self.root
        pages: list[int] = []
        pos = 0
        while len(toks) - pos >= ps:
            child = node.children.get(toks[pos : pos + ps])
            if child is None:
                break
            common = self._common_len(child.key, toks, pos)
            split = common < len(child.key)
            if split:
                child = self._split(child, common)
            child.last_access = now
            pages.extend(child.value)
            node = child
            pos += common
            if split:  # the match ended inside the old node
                break
        self._touch_leaf(node)
        return pages, node

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Cache ``tokens`` with KV in ``pages``; return how many leading tokens were present.

        For those leading tokens the tree keeps its own pages (the caller decides
        what to do with its copies); the pages of the new suffix become tree-owned.
        """
        toks = tuple(tokens)
        ps = self.page_size
        assert len(toks) % ps == 0, f"insert of {len(toks)} tokens, not a multiple of {ps}"
        assert len(pages) == len(toks) // ps, (
            f"insert of {len(toks)} tokens needs {len(toks) // ps} pages, got {len(pages)}"
        )
        now = self._tick()
        node = self.root
        pos = 0
        while pos < len(toks):
            child = node.children.get(toks[pos : pos + ps])
            if child is None:
                leaf = Node(toks[pos:], list(pages[pos // ps :]), node, now)
                node.children[leaf.key[:ps]] = leaf
                self._num_nodes += 1
                self._evictable_pages += len(leaf.value)
                self._push(leaf)
                return pos
            common = self._common_len(child.key, toks, pos)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            node = child
            pos += common
        self._touch_leaf(node)
        return pos

    # ---- locking --------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Pin ``node`` and its ancestors against eviction (the root is never counted)."""
        if node is self.root:
            return
        assert not node.evicted, "lock of an evicted node"
        node.num_locks += 1
        n: Node | None = node
        while n is not None and n is not self.root:
            if n.lock_ref == 0:
                self._evictable_pages -= len(n.value)
                self._locked_pages += len(n.value)
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: Node) -> None:
        """Undo one ``lock(node)``."""
        if node is self.root:
            return
        assert not node.evicted, "unlock of an evicted node"
        assert node.num_locks > 0, f"unlock of a node that holds no lock: {node!r}"
        node.num_locks -= 1
        n: Node | None = node
        while n is not None and n is not self.root:
            assert n.lock_ref > 0, f"lock_ref would go negative: {n!r}"
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._locked_pages -= len(n.value)
                self._evictable_pages += len(n.value)
                if not n.children:
                    self._push(n)
            n = n.parent

    # ---- eviction and reset ---------------------------------------------------

    def evict(self, num_pages: int) -> list[int]:
        """Evict LRU unlocked leaves (cascading to parents) until ``num_pages`` are freed.

        Returns the freed page ids (possibly more than asked, or fewer if nothing
        evictable remains); the caller gives them back to the allocator.
        """
        freed: list[int] = []
        while len(freed) < num_pages:
            node = self._heap.pop()
            if node is None:
                break
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[: self.page_size]]
            node.evicted = True
            node.parent = None
            freed.extend(node.value)
            self._evictable_pages -= len(node.value)
            self._num_nodes -= 1
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        self.num_evicted_pages += len(freed)
        return freed

    def reset(self) -> list[int]:
        """Remove everything and return all pages. Asserts that nothing is locked."""
        assert self._locked_pages == 0, f"reset with {self._locked_pages} locked pages"
        pages = self.all_pages()
        for node in walk(self.root):
            node.evicted = True
            node.parent = None
        self.root.children = {}
        self._heap.clear()
        self._evictable_pages = 0
        self._num_nodes = 0
        return pages

    def all_pages(self) -> list[int]:
        return [page for node in walk(self.root) for page in node.value]

    # ---- integrity ------------------------------------------------------------

    def check_integrity(self) -> None:
        """Walk the whole tree and raise IntegrityError if any invariant fails."""
        root = self.root
        if root.key or root.value or root.parent is not None or root.lock_ref or root.num_locks:
            raise IntegrityError(f"radix tree: root is not empty and unlocked: {root!r}")
        live = {id(node) for node in self._heap.live_items()}
        seen: set[int] = set()
        evictable = locked = num_nodes = 0
        for node in walk(root):
            num_nodes += 1
            problem = node_problem(node, self.page_size, self._clock)
            if (
                problem is None
                and node.lock_ref == 0
                and not node.children
                and id(node) not in live
            ):
                problem = "unlocked leaf missing from the eviction heap"
            if problem is not None:
                raise IntegrityError(f"radix tree: {problem}: {node!r}")
            for page in node.value:
                if page in seen:
                    raise IntegrityError(f"radix tree: page {page} appears twice")
                seen.add(page)
            if node.lock_ref > 0:
                locked += len(node.value)
            else:
                evictable += len(node.value)
        counters = (self._evictable_pages, self._locked_pages, self._num_nodes)
        if counters != (evictable, locked, num_nodes):
            raise IntegrityError(
                f"radix tree: counters (evictable, locked, nodes) {counters} "
                f"!= recount {(evictable, locked, num_nodes)}"
            )

    # ---- internals ------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _common_len(self, key: Tokens, toks: Tokens, pos: int) -> int:
        """Page-aligned length of the common prefix of ``key`` and ``toks[pos:]``.

        The first page is known to match (it is the child's dict key). Binary search
        over pages with slice comparisons keeps the per-token work in C.
        """
        ps = self.page_size
        hi = min(len(key), (len(toks) - pos) // ps * ps) // ps  # in pages
        if key[: hi * ps] == toks[pos : pos + hi * ps]:
            return hi * ps
        lo = 1  # key[:lo*ps] matches; key[:hi*ps] does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if key[lo * ps : mid * ps] == toks[pos + lo * ps : pos + mid * ps]:
                lo = mid
            else:
                hi = mid
        return lo * ps

    def _split(self, node: Node, at: int) -> Node:
        """Split ``node`` after ``at`` tokens; return the new upper node.

        ``node`` keeps its identity as the lower part, so holders of ``node`` stay valid.
        """
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key) and at % ps == 0
        upper = Node(node.key[:at], node.value[: at // ps], parent, node.last_access)
        upper.lock_ref = node.lock_ref  # every lock below node passes through upper
        parent.children[upper.key[:ps]] = upper
        node.key = node.key[at:]
        node.value = node.value[at // ps :]
        node.parent = upper
        upper.children[node.key[:ps]] = node
        self._num_nodes += 1
        return upper

    def _touch_leaf(self, node: Node) -> None:
        """Re-queue ``node`` for eviction after its last_access changed, if a candidate."""
        if node is not self.root and not node.children and node.lock_ref == 0:
            self._push(node)

    def _is_candidate(self, node: Node, stamp: int) -> bool:
        return (
            not node.evicted
            and not node.children
            and node.lock_ref == 0
            and node.last_access == stamp
            and node is not self.root
        )

    def _push(self, node: Node) -> None:
        self._heap.push(node, node.last_access)
