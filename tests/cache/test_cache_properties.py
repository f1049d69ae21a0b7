"""Property test: random admit / extend / release / evict / flush sequences against KVCache.

Small pools force eviction and admission failures; token sequences share prefixes so
the prefix cache hits. After every step: check_integrity() and the accounting
identity. A model of the tree's contents (the page-aligned sequences released with
computed tokens since the last flush) predicts every admit's num_cached_tokens
exactly; after an eviction the model is replaced by the tree's actual paths, which
must be a subset of what was inserted.
"""

from dataclasses import dataclass

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from page_math import ceil_div

from shoal.cache.kv import Admission, KVCache
from shoal.cache.node import Node
from shoal.cache.rows import RowWrite

MAX_PAGES_PER_ROW = 8


@dataclass
class Req:
    row: int
    seq: list[int]  # prompt + continuation: what the model would compute, in order
    prompt_len: int
    num_cached_tokens: int
    row_pages: list[int]


def aligned_lcp(a: list[int], b: list[int], ps: int) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n // ps * ps


def tree_paths(root: Node) -> list[list[int]]:
    """Every root-to-leaf token sequence in the tree."""
    out: list[list[int]] = []
    stack: list[tuple[Node, list[int]]] = [(root, [])]
    while stack:
        node, prefix = stack.pop()
        path = prefix + list(node.key)
        if not node.children:
            out.append(path)
        stack.extend((child, path) for child in node.children.values())
    return [p for p in out if p]


class KVCacheMachine(RuleBasedStateMachine):
    """Drives one KVCache of page size PAGE_SIZE (one subclass per page size, below)."""

    PAGE_SIZE = 1
    cache: KVCache

    @initialize(data=st.data(), num_pages=st.integers(4, 24), num_rows=st.integers(1, 4))
    def setup(self, data: st.DataObject, num_pages: int, num_rows: int) -> None:
        self.ps = ps = self.PAGE_SIZE
        self.cache = KVCache(
            num_pages=num_pages,
            page_size=ps,
            num_rows=num_rows,
            max_pages_per_row=MAX_PAGES_PER_ROW,
        )
        self.max_tokens = MAX_PAGES_PER_ROW * ps
        self.bases = [[(b + j * (b + 1)) % 3 for j in range(4 * ps)] for b in range(3)]
        self.live: dict[str, Req] = {}
        self.known: list[list[int]] = []  # page-aligned sequences the tree holds
        self.next_rid = 0
        self.evicted_seen = 0
        # Start with some live requests, so that short examples still have work to do.
        for _ in range(data.draw(st.integers(0, num_rows), label="initial requests")):
            self.admit_one(data)

    # ---- helpers ------------------------------------------------------------------

    def expected_cached(self, tokens: list[int]) -> int:
        query = tokens[: max(len(tokens) - 1, 0)]
        return max((aligned_lcp(query, s, self.ps) for s in self.known), default=0)

    def sync_after_eviction(self) -> None:
        """If anything was evicted, the tree now holds a subset of the model: adopt it."""
        evicted = self.cache.tree.num_evicted_pages
        if evicted == self.evicted_seen:
            return
        self.evicted_seen = evicted
        event("evicted")
        paths = tree_paths(self.cache.tree.root)
        for path in paths:
            assert any(s[: len(path)] == path for s in self.known), f"tree invented {path}"
        self.known = paths

    @staticmethod
    def contiguous(writes: list[RowWrite], row: int, start: int) -> list[int]:
        pages: list[int] = []
        for w in writes:
            assert w.row == row and w.start == start + len(pages) and w.pages
            pages.extend(w.pages)
        return pages

    def admit_one(self, data: st.DataObject) -> None:
        """A prompt from a shared base or, 2 times in 3, a cached sequence plus a little."""
        reuse = data.draw(st.integers(0, 2), label="reuse") > 0
        if reuse and self.known:
            seq = data.draw(st.sampled_from(self.known), label="known")
            more = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=2), label="more")
            prompt = (seq + more)[: self.max_tokens]
        else:
            base = self.bases[data.draw(st.integers(0, 2), label="base")]
            cut = data.draw(st.integers(0, len(base)), label="base prefix")
            tail = data.draw(st.lists(st.integers(0, 2), max_size=2 * self.ps), label="tail")
            prompt = base[:cut] + tail
        extra = data.draw(st.integers(0, 2 * self.ps), label="extra reserve")
        self.do_admit(prompt, extra, data)

    def do_admit(self, prompt: list[int], extra: int, data: st.DataObject) -> Admission | None:
        ps, cache = self.ps, self.cache
        reserve = min(len(prompt) + extra, self.max_tokens)
        # What the model "generates" after the prompt: one of three fixed streams, so
        # that requests with equal prompts often compute equal (duplicate) pages.
        kind = data.draw(st.integers(0, 2), label="continuation")
        continuation = [(kind * (i + 1) + i // 3) % 3 for i in range(self.max_tokens)]
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        expected = self.expected_cached(prompt)
        before = cache.stats()
        could = before.free_rows > 0 and cache.can_admit_pages(ceil_div(reserve, ps))
        adm = cache.admit(rid, prompt, reserve)
        if adm is None:
            assert not could, "admit refused though a row and the pages were there"
            assert cache.stats() == before, "a failed admit changed the accounting"
            assert not cache.holds(rid)
            event("admit refused")
            return None
        event(f"admit ps={ps} " + ("hit" if adm.num_cached_tokens else "miss"))
        assert adm.num_cached_tokens == expected, (adm.num_cached_tokens, expected)
        assert adm.num_cached_tokens % ps == 0 and adm.num_cached_tokens <= max(len(prompt) - 1, 0)
        pages = self.contiguous(adm.writes, adm.row, 0)
        assert len(pages) == ceil_div(max(reserve, adm.num_cached_tokens), ps)
        assert cache.rows.pages(adm.row) == pages
        self.live[rid] = Req(
            adm.row, prompt + continuation, len(prompt), adm.num_cached_tokens, pages
        )
        self.sync_after_eviction()
        return adm

    # ---- the rule -------------------------------------------------------------------
    # One rule that picks an operation, rather than one rule per operation: hypothesis
    # switches rules off per example (swarm testing), and an example without admit or
    # release tests nothing here. Operations are weighted by repetition.

    OPS = ("admit", "release", "extend", "admit", "release", "abort", "evict", "flush", "publish")

    @rule(data=st.data(), op=st.sampled_from(OPS))
    def step(self, data: st.DataObject, op: str) -> None:
        if op == "admit":
            self.admit_one(data)
        elif op == "evict":
            self.evict(data.draw(st.integers(0, 8), label="evict pages"))
        elif op == "flush":
            self.drain_and_flush(data)
        elif self.live:
            rid = data.draw(st.sampled_from(sorted(self.live)), label="rid")
            if op == "extend":
                self.extend(rid, data)
            elif op == "release":
                self.release(rid, data)
            elif op == "publish":
                self.publish(rid, data)
            else:
                self.abort(rid)

    # ---- operations -----------------------------------------------------------------

    def extend(self, rid: str, data: st.DataObject) -> None:
        ps, cache = self.ps, self.cache
        req = self.live[rid]
        grow_pages = data.draw(st.integers(0, 3), label="grow pages")
        short = data.draw(st.integers(0, ps - 1), label="partial last page")
        total = min((len(req.row_pages) + grow_pages) * ps - short, self.max_tokens)
        need = max(ceil_div(total, ps) - len(req.row_pages), 0)
        before = cache.stats()
        could = cache.can_admit_pages(need)
        writes = cache.extend(rid, total)
        if writes is None:
            assert not could, "extend refused though the pages were there"
            assert cache.stats() == before, "a failed extend changed the accounting"
            event("extend refused")
            return
        if need == 0:
            assert writes == []
            return
        req.row_pages.extend(self.contiguous(writes, req.row, len(req.row_pages)))
        assert len(req.row_pages) == ceil_div(total, ps)
        self.sync_after_eviction()

    def release(self, rid: str, data: st.DataObject) -> None:
        """Finish: cache the computed prefix (any length the row covers)."""
        ps, cache = self.ps, self.cache
        req = self.live.pop(rid)
        n = data.draw(st.integers(0, len(req.row_pages) * ps), label="computed tokens")
        cache.release(rid, req.seq[:n])
        if n >= ps:
            self.known.append(req.seq[: n // ps * ps])
            event("released with cache")
        in_tree = set(cache.tree.all_pages())
        for page in req.row_pages:  # each page went to the tree or back to the free list
            assert (page in in_tree) != cache.allocator.is_free(page), page
        if data.draw(st.booleans(), label="readmit the same tokens"):
            # Nothing was evicted since the release: the whole prefix must hit.
            adm = self.do_admit(req.seq[:n], 0, data)
            if adm is not None:
                assert adm.num_cached_tokens == max(n - 1, 0) // ps * ps

    def publish(self, rid: str, data: st.DataObject) -> None:
        """Mid-flight: hand the computed full pages to the tree, unless another request
        already cached more of these tokens than this one matched."""
        ps, cache = self.ps, self.cache
        req = self.live[rid]
        n = data.draw(st.integers(0, len(req.row_pages) * ps), label="computed tokens")
        aligned = n // ps * ps
        present = max((aligned_lcp(req.seq[:aligned], s, ps) for s in self.known), default=0)
        takes = aligned > req.num_cached_tokens and present <= req.num_cached_tokens
        got = cache.publish(rid, req.seq[:n])
        assert got == (aligned if takes else req.num_cached_tokens), (got, aligned, takes)
        assert cache.rows.pages(req.row) == req.row_pages  # the row is never rewritten
        if takes:
            event("published")
            self.known.append(req.seq[:aligned])
            req.num_cached_tokens = aligned
            in_tree = set(cache.tree.all_pages())
            assert all(page in in_tree for page in req.row_pages[: aligned // ps])

    def abort(self, rid: str) -> None:
        req = self.live.pop(rid)
        self.cache.release(rid, None)
        for page in req.row_pages[req.num_cached_tokens // self.ps :]:
            assert self.cache.allocator.is_free(page), page

    def evict(self, num_pages: int) -> None:
        evictable = self.cache.num_evictable_pages
        freed = self.cache.evict(num_pages)
        assert freed >= min(num_pages, evictable)  # whole nodes, until enough or none left
        assert self.cache.num_evictable_pages == evictable - freed
        self.sync_after_eviction()

    def drain_and_flush(self, data: st.DataObject) -> None:
        for rid in sorted(self.live):
            req = self.live.pop(rid)
            cached = data.draw(st.booleans(), label="cache on drain")
            self.cache.release(rid, req.seq[: req.prompt_len] if cached else None)
        self.cache.flush()
        assert self.cache.num_free_pages == self.cache.stats().total_pages
        self.known = []
        self.evicted_seen = self.cache.tree.num_evicted_pages

    # ---- invariants -----------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        s = self.cache.stats()
        assert s.free_pages + s.evictable_pages + s.locked_pages + s.request_pages == s.total_pages
        assert s.free_rows + len(self.live) == s.total_rows
        assert all(self.cache.holds(rid) for rid in self.live)


SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    derandomize=True,  # the same examples every run
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class PageSize1(KVCacheMachine):
    PAGE_SIZE = 1


class PageSize2(KVCacheMachine):
    PAGE_SIZE = 2


class PageSize4(KVCacheMachine):
    PAGE_SIZE = 4


class PageSize16(KVCacheMachine):
    PAGE_SIZE = 16


TestPageSize1 = PageSize1.TestCase
TestPageSize2 = PageSize2.TestCase
TestPageSize4 = PageSize4.TestCase
TestPageSize16 = PageSize16.TestCase
for _case in (TestPageSize1, TestPageSize2, TestPageSize4, TestPageSize16):
    _case.settings = SETTINGS
del _case
