"""Pure data structures for the paged KV cache: no torch, no asyncio, no numpy.

Files::

    pages.py   PageAllocator   free list of KV page ids
    rows.py    RowTable        request-slot rows (host mirror of the device table), RowWrite
    radix.py   RadixTree       page-aligned prefix tree whose edges own pages
    node.py    Node            the tree's node, IntegrityError, walks
    lru.py     LazyHeap        eviction queue keyed by a logical clock
    kv.py      KVCache         the composition, one owner per page, Admission
    live.py    LiveRequest     what one live request holds (a part of KVCache)
    session_kv.py SessionKV    KV kept by sessions between turns (a part of KVCache)
    supply.py  PageSupply      where new pages come from: free, evicted, reclaimed
    audit.py   check_integrity the recount of every page's owner against the books
    stats.py   KVStats         the accounting KVCache.stats() reports
"""

from .kv import Admission, KVCache
from .node import IntegrityError, Node
from .pages import PageAllocator
from .radix import RadixTree
from .rows import RowTable, RowWrite
from .stats import KVStats

__all__ = [
    "Admission",
    "IntegrityError",
    "KVCache",
    "KVStats",
    "Node",
    "PageAllocator",
    "RadixTree",
    "RowTable",
    "RowWrite",
]
