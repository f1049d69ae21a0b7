"""Streaming sessions against stateless requests: N concurrent sessions x K turns, each turn
adding a constant number of new tokens, through the Engine API, in one process.

For each turn index, the N sessions send their turn together (a session engine); then N
stateless requests carrying each session's full history as input_ids go to an engine with the
prefix cache on (the radix tree still holds the previous turn's request, so it helps them
too), then to one with it off. Greedy, ignore_eos: every stateless request must give the same
tokens as the session turn. TTFT is from the call to the first delta, averaged over the N.

    python bench/sessions.py                       # bundled SmolLM2: 4 sessions x 20 turns
    python bench/sessions.py --sessions 8 --turns 30 --new-tokens 64
    python bench/sessions.py --model <folder> --smoke

Prints one line per turn index, then a summary:
    sessions turn=<k> history_tokens=<n> session_ttft_ms=<x> stateless_ttft_ms=<x>
             stateless_cached_ttft_ms=<x> session_cached_tokens=<n>
             stateless_cached_cached_tokens=<n> machine=<desc>
    sessions summary sessions=<n> turns=<k> new_tokens=<n> output_tokens=<n> page_size=<n>
             session_last_over_turn2=<x> stateless_over_session_last=<x>
             stateless_cached_over_session_last=<x> mismatches=<n> seconds=<s> model=<name>
             machine=<desc>
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from statistics import mean
from typing import Any

from bench_format import fixed_mixed_prefill, machine


class Engines:
    """The session engine and the two stateless ones, started on one loaded model."""

    def __init__(self, loaded: Any, page_size: int, kv_cache_tokens: int) -> None:
        from shoal import Engine

        options = {
            "page_size": page_size,
            "kv_cache_tokens": kv_cache_tokens,
            "max_mixed_prefill_tokens": fixed_mixed_prefill(),
        }
        self.session = Engine(loaded, **options)
        self.cached = Engine(loaded, **options)
        self.uncached = Engine(loaded, prefix_cache=False, **options)
        self.all = (self.session, self.cached, self.uncached)

    async def __aenter__(self) -> Engines:
        for engine in self.all:
            await engine.start()
            await engine.generate(input_ids=[100, 101, 102], max_new_tokens=2).result()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for engine in self.all:
            await engine.close()


async def timed(stream: Any) -> tuple[float, list[int], int]:
    """TTFT in ms, the output token ids, and the cached tokens of one request."""
    began = time.perf_counter()
    ttft_ms = 0.0
    tokens: list[int] = []
    async for delta in stream:
        if delta.token_ids and not tokens:
            ttft_ms = (time.perf_counter() - began) * 1000
        tokens += delta.token_ids
    done = await stream.result()
    return ttft_ms, tokens, done.usage.cached_tokens


async def run(loaded: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    vocab = loaded.config.vocab_size
    n, k = args.sessions, args.turns
    per_session = k * (args.new_tokens + args.output_tokens) + args.page_size
    sampling = {"max_new_tokens": args.output_tokens, "temperature": 0.0, "ignore_eos": True}
    lines: list[dict[str, Any]] = []
    mismatches = 0
    async with Engines(loaded, args.page_size, max(4096, 2 * n * per_session)) as engines:
        sessions = [await engines.session.open_session(timeout_s=3600) for _ in range(n)]
        histories: list[list[int]] = [[] for _ in range(n)]
        for turn in range(1, k + 1):
            new = [[rng.randrange(100, vocab) for _ in range(args.new_tokens)] for _ in range(n)]
            session_runs = await asyncio.gather(
                *(
                    timed(s.turn(input_ids=x, **sampling))
                    for s, x in zip(sessions, new, strict=True)
                )
            )
            await engines.session.wait_idle()
            prompts = [h + x for h, x in zip(histories, new, strict=True)]
            stateless: dict[str, list[tuple[float, list[int], int]]] = {}
            for name, engine in (("cached", engines.cached), ("uncached", engines.uncached)):
                stateless[name] = await asyncio.gather(
                    *(timed(engine.generate(input_ids=p, **sampling)) for p in prompts)
                )
                await engine.wait_idle()
            for i, (_, tokens, _) in enumerate(session_runs):
                mismatches += sum(tokens != runs[i][1] for runs in stateless.values())
                histories[i] = prompts[i] + tokens
            lines.append(
                {
                    "turn": turn,
                    "history_tokens": len(prompts[0]) - args.new_tokens,
                    "session_ttft_ms": mean(r[0] for r in session_runs),
                    "stateless_ttft_ms": mean(r[0] for r in stateless["uncached"]),
                    "stateless_cached_ttft_ms": mean(r[0] for r in stateless["cached"]),
                    "session_cached_tokens": min(r[2] for r in session_runs),
                    "stateless_cached_cached_tokens": min(r[2] for r in stateless["cached"]),
                }
            )
        for session in sessions:
            await session.close()
        for engine in engines.all:
            await engine.check_integrity()
            stats = await engine.cache_stats()
            assert stats.sessions == stats.locked_pages == 0, stats
    lines.append({"mismatches": mismatches})
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=32, help="input tokens per turn")
    parser.add_argument("--output-tokens", type=int, default=8, help="output tokens per turn")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="2 sessions x 3 turns, 8 + 2 tokens")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sessions, args.turns, args.new_tokens, args.output_tokens = 2, 3, 8, 2
    if args.turns < 2:
        parser.error("--turns must be >= 2 (the summary compares with turn 2)")

    from shoal.models.load import load_model

    began = time.perf_counter()
    loaded = load_model(args.model)
    *turns, tail = asyncio.run(run(loaded, args))
    where = machine()
    for line in turns:
        fields = " ".join(f"{k}={_fmt(v)}" for k, v in line.items())
        print(f"sessions {fields} machine={where}", flush=True)
    last, second = turns[-1], turns[1]
    summary = {
        "sessions": args.sessions,
        "turns": args.turns,
        "new_tokens": args.new_tokens,
        "output_tokens": args.output_tokens,
        "page_size": args.page_size,
        "session_last_over_turn2": last["session_ttft_ms"] / second["session_ttft_ms"],
        "stateless_over_session_last": last["stateless_ttft_ms"] / last["session_ttft_ms"],
        "stateless_cached_over_session_last": (
            last["stateless_cached_ttft_ms"] / last["session_ttft_ms"]
        ),
        "mismatches": tail["mismatches"],
        "seconds": time.perf_counter() - began,
        "model": loaded.path.name,
    }
    fields = " ".join(f"{k}={_fmt(v)}" for k, v in summary.items())
    print(f"sessions summary {fields} machine={where}", flush=True)
    return 0


def _fmt(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
