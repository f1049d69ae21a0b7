"""What the session tests over HTTP compare with and wait for: a stateless greedy /generate on
the full history (`stateless`), and the engine with no session holding KV (`released`).
"""

from __future__ import annotations

import asyncio

from served import Served, post

from shoal.api.engine import Engine
from shoal.cache.stats import KVStats

GREEDY = {"temperature": 0, "ignore_eos": True}


async def stateless(s: Served, ids: list[int], max_new: int) -> list[int]:
    status, got = await post(
        s, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, **GREEDY}}
    )
    assert status == 200, got
    return list(got["output_ids"])


async def released(engine: Engine, timeout_s: float = 30.0) -> KVStats:
    """Once the engine is idle and no session holds KV (closing is asynchronous)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        await engine.wait_idle()
        stats = await engine.cache_stats()
        if stats.sessions == stats.session_pages == stats.locked_pages == 0:
            return stats
        assert loop.time() < deadline, f"sessions still hold pages: {stats}"
        await asyncio.sleep(0.01)
