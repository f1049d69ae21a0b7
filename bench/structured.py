"""Structured output's cost: N concurrent streams with a JSON schema each, or a regex each,
against the same N streams unconstrained, on one engine in one process (issue 34's target:
16 streams with a schema at >= 0.9x the unconstrained throughput).

Rounds interleave the kinds (plain, json_schema, json_bounded, regex) so a noisy machine's
drift falls on each alike. Each request is a chat prompt, seeded sampling at temperature 0.7
(plain rows: ignore_eos, so they run their max_tokens; a grammar row ends where its grammar
does, so the figure is output tokens per second of wall time, not requests). json_schema is a
pydantic model's schema (a list of records: strings, an integer, an enum); json_bounded the
same with maxLength on its strings, which xgrammar's masks cost about a hundred times more
(0.5 ms a token against 5 µs here). The schema's cold compile and a cache hit are timed
first.

    python bench/structured.py                        # bundled SmolLM2, 1 and 16 streams
    python bench/structured.py --streams 1 16 --rounds 3 --max-tokens 96
    python bench/structured.py --model <folder> --smoke

Prints, per kind and stream count, the median of the rounds, then the ratios:
    structured kind=<plain|json_schema|json_bounded|regex> streams=<n> output_tok_s=<x>
               tokens=<n> stop_share=<x> machine=<desc>
    structured ratio streams=<n> json_schema_over_plain=<x> json_bounded_over_plain=<x>
               regex_over_plain=<x>
    structured compile first_grammar_ms=<x> json_schema_ms=<x> cached_ms=<x> regex_ms=<x>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from statistics import median
from typing import Any

from bench_format import emit, machine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "job": {"enum": ["teacher", "doctor", "farmer", "engineer", "artist"]},
    },
    "required": ["name", "age", "job"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "people": {"type": "array", "minItems": 4, "maxItems": 8, "items": PERSON},
    },
    "required": ["city", "people"],
    "additionalProperties": False,
}
BOUNDED = json.loads(json.dumps(SCHEMA))
BOUNDED["properties"]["city"]["maxLength"] = 20
BOUNDED["properties"]["people"]["items"]["properties"]["name"]["maxLength"] = 16
KINDS = ("plain", "json_schema", "json_bounded", "regex")
REGEX = r"(\d{3}-\d{4}, [A-Z][a-z]{2,10}\n){6,12}"
QUESTION = "List the people of a small town, with their names, ages and jobs."


def grammar_of(kind: str) -> dict[str, Any]:
    if kind == "json_schema":
        return {"json_schema": json.dumps(SCHEMA)}
    if kind == "json_bounded":
        return {"json_schema": json.dumps(BOUNDED)}
    if kind == "regex":
        return {"regex": REGEX}
    return {"ignore_eos": True}


async def one_round(engine: Any, kind: str, streams: int, max_tokens: int, seed: int) -> Any:
    messages = [{"role": "user", "content": QUESTION}]
    started = time.perf_counter()
    runs = [
        engine.generate(
            messages=messages, max_new_tokens=max_tokens, temperature=0.7, seed=seed + i,
            **grammar_of(kind),
        )
        for i in range(streams)
    ]  # fmt: skip
    done = await asyncio.gather(*(r.result() for r in runs))
    seconds = time.perf_counter() - started
    tokens = sum(len(d.token_ids) for d in done)
    stops = sum(d.finish_reason == "stop" for d in done)
    return tokens / seconds, tokens, stops / streams


async def compile_times(engine: Any) -> dict[str, float]:
    """The engine's first grammar (xgrammar imported, the vocabulary's tables built), then the
    schema's cold compile and a cached one, and the regex's, through the engine (a request of
    one token each: its door-to-done time less a plain one's)."""

    async def timed(**fields: Any) -> float:
        started = time.perf_counter()
        await engine.generate(prompt="x", max_new_tokens=1, **fields).result()
        return (time.perf_counter() - started) * 1000

    base = min([await timed() for _ in range(3)])
    first = await timed(json_schema='{"type": "object"}')
    cold = await timed(json_schema=json.dumps({**SCHEMA, "title": "cold"}))
    cached = await timed(json_schema=json.dumps({**SCHEMA, "title": "cold"}))
    regex = await timed(regex=REGEX + "x")
    return {
        "first_grammar_ms": round(first - base, 1),
        "json_schema_ms": round(cold - base, 1),
        "cached_ms": round(cached - base, 1),
        "regex_ms": round(regex - base, 1),
    }


async def main(args: argparse.Namespace) -> None:
    from shoal import Engine

    options: dict[str, Any] = {"seed": 0}
    async with Engine(args.model, **options) as engine:
        await engine.generate(prompt="warm up", max_new_tokens=4).result()
        emit("structured compile", {**await compile_times(engine), "machine": machine()}, args.out)
        for streams in args.streams:
            rates: dict[str, list[float]] = {}
            last: dict[str, tuple[int, float]] = {}
            await one_round(engine, "json_schema", streams, 8, 0)  # warm: grammar rows' path
            for r in range(args.rounds):
                for kind in KINDS:
                    rate, tokens, stop_share = await one_round(
                        engine, kind, streams, args.max_tokens, 1000 * r
                    )
                    rates.setdefault(kind, []).append(rate)
                    last[kind] = (tokens, stop_share)
            for kind, values in rates.items():
                line = {
                    "kind": kind, "streams": streams, "output_tok_s": round(median(values), 2),
                    "rounds": " ".join(f"{v:.1f}" for v in values), "tokens": last[kind][0],
                    "stop_share": round(last[kind][1], 2), "machine": machine(),
                }  # fmt: skip
                emit("structured", line, args.out)
            plain = median(rates["plain"])
            ratio: dict[str, Any] = {"streams": streams}
            for kind in KINDS[1:]:
                ratio[f"{kind}_over_plain"] = round(median(rates[kind]) / plain, 3)
            emit("structured ratio", ratio, args.out)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder or GGUF (default: bundled)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None, help="append the lines as JSON")
    parser.add_argument("--smoke", action="store_true", help="1 and 2 streams, 1 round, 8 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.streams, args.rounds, args.max_tokens = [1, 2], 1, 8
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
