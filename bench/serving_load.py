"""One run of bench/serving.py's load against an OpenAI-compatible server: every request
streamed over `/v1/completions` at a fixed concurrency, or with Poisson arrivals at a rate,
each timed chunk by chunk. Output tokens: the usage chunk where the server sends one (shoal,
vLLM), else max_tokens for a request that finished with "length", else the chunks received."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from serving_requests import Request, Result, request_body
from serving_stats import summarize
from tqdm import tqdm


async def send(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Result:
    result = Result()
    began = last = time.perf_counter()
    chunks = 0
    finish: str | None = None
    usage_tokens: int | None = None
    try:
        async with http.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return result
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                choices = event.get("choices") or ()
                finish = next(
                    (c["finish_reason"] for c in choices if c.get("finish_reason")), finish
                )
                if not any(c.get("text") for c in choices):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft_s = now - began
                else:
                    result.itl_s.append(now - last)
                last = now
                chunks += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = repr(exc)
        return result
    result.latency_s = time.perf_counter() - began
    if usage_tokens is not None:
        result.output_tokens = usage_tokens
    elif finish == "length":  # llama.cpp: no usage when streaming, and a chunk may hold 2 tokens
        result.output_tokens = int(body["max_tokens"])
    else:
        result.output_tokens = chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no output"
    return result


async def served_model(http: aiohttp.ClientSession, base_url: str) -> str:
    async with http.get(f"{base_url}/v1/models") as r:
        r.raise_for_status()
        return str((await r.json(content_type=None))["data"][0]["id"])  # a router: text/plain


async def run_load(
    base_url: str,
    system: str,
    work: list[Request],
    mode: str,
    load: float,
    seed: int,
    eos_ids: Sequence[int],
    progress: bool,
) -> dict[str, Any]:
    """One run: every request of `work` at concurrency `load`, or Poisson arrivals at `load`
    requests/s; return the metrics line."""
    url = f"{base_url}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        model = await served_model(http, base_url)
        warm = Request(work[0].prompt, 4)
        await send(http, url, request_body(system, model, warm, eos_ids))  # warm up
        bar = tqdm(total=len(work), desc=f"{system} {mode}={load:g}", disable=not progress)
        gate = asyncio.Semaphore(int(load) if mode == "concurrency" else len(work))

        async def one(req: Request) -> Result:
            async with gate:
                result = await send(http, url, request_body(system, model, req, eos_ids))
            bar.update(1)
            return result

        rng = random.Random(seed)
        began = time.perf_counter()
        tasks = []
        for req in work:
            tasks.append(asyncio.create_task(one(req)))
            if mode == "rate":
                await asyncio.sleep(rng.expovariate(load))
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - began
        bar.close()
    return summarize(system, mode, load, results, seconds)
