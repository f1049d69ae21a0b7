"""Offline throughput: N seeded requests through shoal's Engine, and the same prompts through
transformers `generate` (batched with left padding, and one at a time), in one process.

    python bench/offline.py                       # bundled SmolLM2, 64 requests
    python bench/offline.py --requests 16 --hf-solo 4

Prints one line per system:
    offline system=<name> requests=<n> output_tokens=<n> seconds=<s> tok_per_s=<x> machine=<desc>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch


def machine() -> str:
    threads = torch.get_num_threads()
    return f"{platform.machine()}-{os.cpu_count()}cpu-torch{torch.__version__}-threads{threads}"


def workload(
    n: int, vocab: int, seed: int, prompt: tuple[int, int], output: tuple[int, int]
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output))
        for _ in range(n)
    ]


def report(system: str, n: int, tokens: int, seconds: float, out: Path | None) -> None:
    line = {
        "system": system,
        "requests": n,
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 2),
        "machine": machine(),
    }
    print("offline " + " ".join(f"{k}={v}" for k, v in line.items()), flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


async def run_shoal(
    loaded: Any, work: list[tuple[list[int], int]], options: dict[str, Any]
) -> tuple[int, float]:
    from shoal import Engine

    async with Engine(loaded, **options) as engine:
        await engine.generate(input_ids=work[0][0], max_new_tokens=2).result()  # warm up
        began = time.perf_counter()
        streams = [
            engine.generate(input_ids=p, max_new_tokens=m, temperature=0.0, ignore_eos=True)
            for p, m in work
        ]
        done = await asyncio.gather(*(s.result() for s in streams))
        seconds = time.perf_counter() - began
    return sum(len(d.token_ids) for d in done), seconds


def run_hf(model: Any, work: list[tuple[list[int], int]], batch_size: int) -> tuple[int, float]:
    tokens = 0
    began = time.perf_counter()
    for start in range(0, len(work), batch_size):
        chunk = work[start : start + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        max_new = max(m for _, m in chunk)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
        tokens += sum(m for _, m in chunk)  # tokens each request asked for (the rest is waste)
    return tokens, time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch", type=int, default=16, help="0 skips batched generate")
    parser.add_argument(
        "--hf-solo",
        type=int,
        default=8,
        help="requests run one at a time through generate (0 skips)",
    )
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    args = parser.parse_args()

    from shoal.kernels.loader import load_model

    loaded = load_model(args.model)
    work = workload(
        args.requests, loaded.config.vocab_size, args.seed, args.prompt_len, args.output_len
    )
    tokens, seconds = asyncio.run(
        run_shoal(loaded, work, {"max_running_requests": args.max_running})
    )
    report("shoal", len(work), tokens, seconds, args.out)
    if args.hf_batch or args.hf_solo:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(loaded.path, torch_dtype=torch.float32).eval()
        if args.hf_batch:
            tokens, seconds = run_hf(model, work, args.hf_batch)
            report(f"hf-generate-batch{args.hf_batch}", len(work), tokens, seconds, args.out)
        if args.hf_solo:
            solo = work[: args.hf_solo]
            tokens, seconds = run_hf(model, solo, 1)
            report("hf-generate-solo", len(solo), tokens, seconds, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
