"""Online serving: a load generator against OpenAI-compatible servers over HTTP streaming
`/v1/completions`, at a fixed concurrency or with Poisson arrivals at a rate.

    python bench/serving.py                           # shoal, llama.cpp and vLLM, c = 1 4 16
    python bench/serving.py --launch shoal --concurrency 1 4 16 64
    python bench/serving.py --launch shoal --quantization int8 --shoal-args "--chunk-size 256"
    python bench/serving.py --launch vllm --vllm-python /path/to/vllm-env/bin/python
    python bench/serving.py --base-url http://127.0.0.1:30000 --rate 2 8
    python bench/serving.py --launch shoal --model <folder> --smoke

`--launch` starts each system as a subprocess on the same model (shoal on the folder or GGUF,
llama-cpp-python's server on the GGUF file, vLLM's OpenAI server on the HF folder, from its
own environment: --vllm-python, bench/vllm_peer.py) with the same thread count, one at a
time (bench/launch.py); a system that is not installed is skipped with the reason. Prompts
are seeded random words (text, so any server takes them), the same for every system and run.
shoal and vLLM get `ignore_eos` (vLLM also `min_tokens`); llama.cpp, which has no such field,
gets the end-of-sequence ids banned with `logit_bias` and `min_tokens`. Output tokens: the
usage chunk where the server sends one (shoal, vLLM), else max_tokens for a request that
finished with "length", else the chunks received.

Metrics (SGLang's bench_serving definitions): TTFT, the time to the first non-empty chunk;
ITL, the gaps between consecutive non-empty chunks, pooled over requests; TPOT per request,
(latency - TTFT) / (output tokens - 1); E2E, the request's latency. One line per run:
    serving system=<s> mode=<concurrency|rate> load=<x> requests=<n> failed=<n>
            output_tokens=<n> seconds=<s> req_per_s=<x> out_tok_per_s=<x>
            ttft_ms_{mean,median,p99}=<x> itl_ms_{...} tpot_ms_{...} e2e_ms_{...} machine=<desc>
A launched shoal with --quantization / --shoal-args is named by them: system=shoal-int8,
system=shoal_--chunk-size_256 (launch.py's LaunchConfig.label). A system that cannot start:
    serving system=<s> skipped: <why>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from bench_format import machine
from launch import SYSTEMS, LaunchConfig, eos_ids_of, launch, missing
from tqdm import tqdm

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from it his an are were which be this "
    "has had not but they one their or have been its after first new two also who more other "
    "time year city river music team world state school house water light story night field "
    "people small great early north south under between during several number family system "
    "village court market island forest garden window morning paper station energy question"
)
WORDS = _WORD_TEXT.split()


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)


def workload(n: int, seed: int, prompt: Sequence[int], output: Sequence[int]) -> list[Request]:
    """Seeded random prompts (words; about 1.2 tokens each for SmolLM2) and output lengths."""
    rng = random.Random(seed)
    return [
        Request(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(*prompt))),
            rng.randint(*output),
        )
        for _ in range(n)
    ]


def request_body(system: str, model: str, req: Request, eos_ids: Sequence[int]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    if system in ("shoal", "vllm"):
        body["ignore_eos"] = True
        body["stream_options"] = {"include_usage": True}
        if system == "vllm":
            body["min_tokens"] = req.max_tokens
    elif system == "llamacpp":
        body["min_tokens"] = req.max_tokens
        if eos_ids:
            body["logit_bias"] = {str(t): -100.0 for t in eos_ids}
    return body


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


def _stats(name: str, values_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000 if len(values_s) else np.zeros(1)
    return {
        f"{name}_ms_mean": round(float(ms.mean()), 2),
        f"{name}_ms_median": round(float(np.median(ms)), 2),
        f"{name}_ms_p99": round(float(np.percentile(ms, 99)), 2),
    }


def summarize(
    system: str, mode: str, load: float, results: list[Result], seconds: float
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    line: dict[str, Any] = {
        "system": system,
        "mode": mode,
        "load": load,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "req_per_s": round(len(ok) / seconds, 3),
        "out_tok_per_s": round(tokens / seconds, 2),
    }
    line |= _stats("ttft", [r.ttft_s for r in ok])
    line |= _stats("itl", [gap for r in ok for gap in r.itl_s])
    line |= _stats("tpot", tpot)
    line |= _stats("e2e", [r.latency_s for r in ok])
    line["machine"] = machine()
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        print(f"serving {system} errors: {errors[:3]}", file=sys.stderr)
    return line


async def amain(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--launch", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    target.add_argument("--base-url", default=None, help="an already running server")
    parser.add_argument("--system", default="shoal", help="with --base-url: shoal|llamacpp|...")
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 (GGUF)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quantization", default=None, choices=["int8"], help="shoal's weights (default none)"
    )
    parser.add_argument(
        "--shoal-args",
        default="",
        help='more `python -m shoal serve` arguments, e.g. "--chunk-size 256"',
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of an environment with vLLM (default: $SHOAL_BENCH_VLLM_PYTHON, else "
        "this one if it imports vllm)",
    )
    loads = parser.add_mutually_exclusive_group()
    loads.add_argument("--concurrency", type=int, nargs="+", default=None)
    loads.add_argument("--rate", type=float, nargs="+", default=None, help="requests/s")
    parser.add_argument("--requests", type=int, default=0, help="per run (0: max(8, 2 x c))")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(64, 192), help="words")
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 96), help="tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="c = 1 2, 4 requests, short")
    args = parser.parse_args(argv)
    if args.smoke:
        args.concurrency, args.requests = [1, 2], 4
        args.prompt_len, args.output_len = (4, 12), (2, 6)
    mode = "rate" if args.rate else "concurrency"
    levels: list[float] = args.rate or args.concurrency or [1, 4, 16]

    def sized(level: float) -> list[Request]:
        n = args.requests or max(8, 2 * int(level))
        return workload(n, args.seed, args.prompt_len, args.output_len)

    async def runs(system: str, label: str, base_url: str) -> None:
        eos_ids = eos_ids_of(args.model) if system == "llamacpp" else []
        for level in levels:
            line = await run_load(
                base_url,
                system,
                sized(level),
                mode,
                level,
                args.seed,
                eos_ids,
                not args.no_progress,
            )
            line["system"] = label
            print("serving " + " ".join(f"{k}={v}" for k, v in line.items()), flush=True)
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(json.dumps(line) + "\n")

    if args.base_url is not None:
        await runs(args.system, args.system, args.base_url.rstrip("/"))
        return 0
    config = LaunchConfig(
        args.model,
        args.threads,
        args.quantization,
        tuple(shlex.split(args.shoal_args)),
        args.vllm_python,
    )
    for system in args.launch:
        reason = missing(system, config)
        if reason is not None:
            print(f"serving system={system} skipped: {reason}", flush=True)
            continue
        async with launch(system, config) as server:
            print(f"# {system} ready at {server.base_url} in {server.startup_s:.1f}s", flush=True)
            await runs(system, config.label(system), server.base_url)
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(amain(argv))


if __name__ == "__main__":
    sys.exit(main())
