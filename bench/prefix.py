"""Shared-prefix workload: groups of requests that share a long system prompt, each with its
own short question, run through shoal with the prefix cache on and then off, in one process.

    python bench/prefix.py                    # bundled SmolLM2: 4 groups x 8 requests
    python bench/prefix.py --groups 2 --per-group 4 --prefix-len 256
    python bench/prefix.py --warm    # each group's prefix prefilled once (untimed) first
    python bench/prefix.py --model <folder> --smoke   # 2 groups x 2 requests, 32-token prefix

Prints one line per run:
    prefix cache=<on|off> warm=<bool> requests=<n> prompt_tokens=<n> cached_tokens=<n>
           output_tokens=<n> seconds=<s> req_per_s=<x> tok_per_s=<x> machine=<desc>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench_format import fixed_mixed_prefill, machine


def workload(
    groups: int, per_group: int, prefix_len: int, question_len: int, vocab: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """The shuffled prompts, and the groups' shared prefixes."""
    rng = random.Random(seed)
    prompts = []
    prefixes = []
    for _ in range(groups):
        prefix = [rng.randrange(100, vocab) for _ in range(prefix_len)]
        prefixes.append(prefix)
        prompts += [
            prefix + [rng.randrange(100, vocab) for _ in range(question_len)]
            for _ in range(per_group)
        ]
    rng.shuffle(prompts)
    return prompts, prefixes


async def run(
    loaded: Any, prompts: list[list[int]], warm: list[list[int]], output_len: int, cache: bool
) -> dict[str, Any]:
    """All prompts at once; `warm` prompts (the groups' prefixes with --warm) run untimed
    first, as a long-lived system prompt would have been by a server already serving it."""
    from shoal import Engine

    async with Engine(
        loaded, prefix_cache=cache, max_mixed_prefill_tokens=fixed_mixed_prefill()
    ) as engine:
        await engine.generate(input_ids=[100, 101, 102], max_new_tokens=2).result()  # warm up
        for p in warm:
            await engine.generate(input_ids=p, max_new_tokens=1).result()
        began = time.perf_counter()
        streams = [
            engine.generate(
                input_ids=p, max_new_tokens=output_len, temperature=0.0, ignore_eos=True
            )
            for p in prompts
        ]
        done = await asyncio.gather(*(s.result() for s in streams))
        seconds = time.perf_counter() - began
    outputs = sum(d.usage.completion_tokens for d in done)
    return {
        "cache": "on" if cache else "off",
        "warm": bool(warm),
        "requests": len(done),
        "prompt_tokens": sum(d.usage.prompt_tokens for d in done),
        "cached_tokens": sum(d.usage.cached_tokens for d in done),
        "output_tokens": outputs,
        "seconds": round(seconds, 3),
        "req_per_s": round(len(done) / seconds, 3),
        "tok_per_s": round(outputs / seconds, 2),
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    parser.add_argument(
        "--warm", action="store_true", help="prefill each group's prefix once, untimed, first"
    )
    parser.add_argument("--smoke", action="store_true", help="2 x 2 requests, tiny lengths")
    args = parser.parse_args(argv)
    if args.smoke:
        args.groups, args.per_group, args.prefix_len, args.question_len = 2, 2, 32, 4
        args.output_len = 2

    from shoal.models.load import load_model

    loaded = load_model(args.model)
    prompts, prefixes = workload(
        args.groups,
        args.per_group,
        args.prefix_len,
        args.question_len,
        loaded.config.vocab_size,
        args.seed,
    )
    for cache in (True, False):
        warm = prefixes if args.warm else []
        line = asyncio.run(run(loaded, prompts, warm, args.output_len, cache))
        print("prefix " + " ".join(f"{k}={v}" for k, v in line.items()), flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
