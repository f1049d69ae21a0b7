"""Offline throughput: N seeded requests through shoal's Engine, and the same prompts through
transformers `generate` (batched with left padding, and one at a time), in one process.

    python bench/offline.py                # bundled SmolLM2, 64 requests, generate at 8 16 32
    python bench/offline.py --requests 16 --hf-solo 4
    python bench/offline.py --hf-batch 16 --hf-solo 0  # one batch size, no one-at-a-time
    python bench/offline.py --model <folder> --smoke   # 4 tiny requests, 1 solo

Prints one line per system:
    offline system=<name> requests=<n> output_tokens=<n> seconds=<s> tok_per_s=<x> machine=<desc>
then the ratios (shoal's tok/s over the fastest batched generate's, and over one at a time):
    offline summary shoal_over_hf_batch=<x> shoal_over_hf_solo=<x> machine=<desc>
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
from tqdm import tqdm


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


def report(system: str, n: int, tokens: int, seconds: float, out: Path | None) -> float:
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
    return tokens / seconds


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
        tokens = 0
        for next_done in tqdm(
            asyncio.as_completed([s.result() for s in streams]),
            total=len(streams),
            desc="shoal",
            disable=len(work) < 8,
        ):
            tokens += len((await next_done).token_ids)
        seconds = time.perf_counter() - began
    return tokens, seconds


def run_hf(model: Any, work: list[tuple[list[int], int]], batch_size: int) -> tuple[int, float]:
    tokens = 0
    began = time.perf_counter()
    starts = range(0, len(work), batch_size)
    for start in tqdm(starts, desc=f"generate x{batch_size}", disable=len(work) < 8):
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hf-batch",
        type=int,
        nargs="+",
        default=[8, 16, 32],
        help="batch sizes for batched generate, each measured (0 skips)",
    )
    parser.add_argument(
        "--hf-solo",
        type=int,
        default=8,
        help="requests run one at a time through generate (0 skips)",
    )
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    parser.add_argument("--smoke", action="store_true", help="4 requests of 4-8 + 2-4 tokens")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.prompt_len, args.output_len = 4, (4, 8), (2, 4)
        args.hf_batch, args.hf_solo = [2], 1
    batches = [b for b in args.hf_batch if b > 0]

    from shoal.kernels.loader import load_model

    loaded = load_model(args.model)
    work = workload(
        args.requests, loaded.config.vocab_size, args.seed, args.prompt_len, args.output_len
    )
    tokens, seconds = asyncio.run(
        run_shoal(loaded, work, {"max_running_requests": args.max_running})
    )
    shoal = report("shoal", len(work), tokens, seconds, args.out)
    ratios: dict[str, float] = {}
    if batches or args.hf_solo:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(loaded.path, torch_dtype=torch.float32).eval()
        batched = []
        for size in batches:
            tokens, seconds = run_hf(model, work, size)
            batched.append(report(f"hf-generate-batch{size}", len(work), tokens, seconds, args.out))
        if batched:
            ratios["shoal_over_hf_batch"] = shoal / max(batched)
        if args.hf_solo:
            solo = work[: args.hf_solo]
            tokens, seconds = run_hf(model, solo, 1)
            ratios["shoal_over_hf_solo"] = shoal / report(
                "hf-generate-solo", len(solo), tokens, seconds, args.out
            )
    fields = " ".join(f"{k}={v:.2f}" for k, v in ratios.items())
    print(f"offline summary {fields} machine={machine()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
