"""KVStats: the cache's accounting at one moment, as `KVCache.stats()` reports it.

The page fields add up (docs/architecture.md, "Lifecycle laws", law 4)::

    free_pages + evictable_pages + locked_pages + request_pages + session_pages == total_pages

``request_pages`` counts the pages live requests own now; with a sliding window
(``KVCache.trim``) a long generation's stays bounded by the window, and ``trimmed_pages``
counts the pages trimming gave back.
"""

from __future__ import annotations

import msgspec


class KVStats(msgspec.Struct, frozen=True, kw_only=True):
    total_pages: int
    free_pages: int
    evictable_pages: int  # the tree's, unlocked: given back under pressure
    locked_pages: int  # the tree's, read by a live request or kept by a session
    request_pages: int  # owned by one live request
    session_pages: int  # the partial tail pages sessions keep between turns
    sessions: int  # sessions keeping KV
    sessions_reclaimed: int  # sessions that gave their KV back under pressure, since start
    total_rows: int
    free_rows: int
    cached_tokens: int  # tokens the tree holds (whole pages)
    trimmed_pages: int = 0  # request pages a sliding window gave back early, since start
