"""A prompt's prefill alone: the time to the first token of one request of N prompt tokens,
nothing else running, each prompt new (random ids: no prefix hit), one engine for all.

    python bench/prefill.py                    # the bundled SmolLM2 in its default dtype
    python bench/prefill.py --tokens 64 189 512 1024 --repeats 5 --modes bfloat16 float32 int8
    PYTHONPATH=/path/to/other/revision/parent python bench/prefill.py   # "before", same script

Prints per mode and length the median of --repeats requests:
    prefill mode=<auto|float32|bfloat16|int8> tokens=<n> ttft_ms=<x> tok_s=<n / ttft>
            runs=<each request's ms> setup=<the engine's kernels> machine=<desc>
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path
from statistics import median
from typing import Any

from bench_format import emit, machine
from offline_shoal import engine_setup


def engine_options(mode: str) -> dict[str, Any]:
    if mode == "int8":
        return {"quantization": "int8"}
    return {} if mode == "auto" else {"dtype": mode}


async def run_mode(args: argparse.Namespace, mode: str) -> None:
    from shoal import Engine

    rng = random.Random(args.seed)
    async with Engine(args.model, seed=0, **engine_options(mode)) as engine:
        await engine.generate(prompt="warm up", max_new_tokens=2).result()
        vocab = engine.loaded.config.vocab_size
        setup = engine_setup(engine)
        for tokens in args.tokens:
            runs = []
            for _ in range(args.repeats):
                ids = [rng.randrange(16, vocab) for _ in range(tokens)]
                started = time.perf_counter()
                await engine.generate(input_ids=ids, max_new_tokens=1, temperature=0.0).result()
                runs.append((time.perf_counter() - started) * 1e3)
            ms = median(runs)
            line = {
                "mode": mode, "tokens": tokens, "ttft_ms": round(ms, 2),
                "tok_s": round(tokens / ms * 1e3, 1),
                "runs": ",".join(f"{r:.2f}" for r in runs), "setup": setup, "machine": machine(),
            }  # fmt: skip
            emit("prefill", line, args.out)


async def main(args: argparse.Namespace) -> None:
    for mode in args.modes:
        await run_mode(args, mode)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a model folder or GGUF (default: bundled)")
    parser.add_argument("--modes", nargs="+", default=["auto"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 189, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
