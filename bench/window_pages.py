"""Page accounting under a sliding window: one long generation, the pages it holds sampled as
it runs. With every layer windowed (ModelConfig.kv_window), pages that fell out of the window
are freed, so what it holds stays near window / page_size however long it grows; without a
window it grows with the length.

    pages model_type=<t> window=<W or none> page_size=<P> tokens=<n> held_peak=<pages>
          held_at_end=<pages> pages_for_length=<ceil(n / P)> trimmed=<pages> machine=<desc>
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from bench_format import emit


async def window_pages(engine: Any, new_tokens: int, desc: str, out: Path | None) -> None:
    config = engine.loaded.config
    page = engine.resolved.cache.page_size
    prompt = [3 + i % 100 for i in range(8)]
    stream = engine.generate(
        input_ids=prompt, max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True
    )
    result = asyncio.ensure_future(stream.result())
    peak = last = 0
    while not result.done():
        held = (await engine.cache_stats()).request_pages
        peak, last = max(peak, held), held or last
        await asyncio.sleep(0.005)
    done = result.result()
    tokens = len(prompt) + len(done.token_ids)
    stats = await engine.cache_stats()
    line = {
        "model_type": config.model_type,
        "window": config.kv_window or "none",
        "page_size": page,
        "tokens": tokens,
        "held_peak": peak,
        "held_at_end": last,
        "pages_for_length": -(-tokens // page),
        "trimmed": stats.trimmed_pages,
        "machine": desc,
    }
    emit("pages", line, out)
