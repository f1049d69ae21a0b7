"""What the engine tests send and read back: a random prompt, greedy sampling that runs to its
length, and the cache's books once the engine is idle.

    engine.generate(input_ids=prompt(40, seed=1), **greedy(12))
"""

from __future__ import annotations

import random
from typing import Any

from shoal import Engine
from shoal.cache.stats import KVStats


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def greedy(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


async def idle_stats(engine: Engine) -> KVStats:
    """The cache's books once the engine is idle."""
    await engine.wait_idle()
    return await engine.cache_stats()
