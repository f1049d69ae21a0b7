"""Speculative decoding's gain (issue 35): n-gram drafts verified in one step, on against off,
on a copy-heavy workload (give a code block back with one name changed) and one with nothing
to copy (a new story), at 1 and 16 streams, beside llama.cpp with and without its prompt-lookup
decoding on the same GGUF and prompts (one stream: llama-cpp-python serves one at a time).

Each round runs speculation off, then on (one engine at a time, started for its turn), then
the peer, so that a noisy machine's drift falls on each alike. Greedy, the model's chat
template; a rate is output tokens over wall time, prompt included, for every system alike:
one stream runs the workload's first `--prompts` prompts (3: all of copy's code blocks) one
after another, the round's rate their tokens over their summed times, each prompt's own rate
printed too (`per_prompt`); N streams: N requests at once, all their tokens over the round's
wall time. shoal's decode rate leaves the prompt out: the tokens after each request's first
over the time after the requests' median first token (one stream: what its reader sees once
the answer starts).

    python bench/speculative.py                      # bundled SmolLM2 in float32 and int8
    python bench/speculative.py --modes float32 --streams 1 --rounds 3
    python bench/speculative.py --llamacpp-python /path/to/venv/bin/python   # the peer
    python bench/speculative.py --smoke

Prints per mode, workload and stream count the median of the rounds:
    speculative system=<shoal|llamacpp> mode=<float32|int8|Q4_1> workload=<copy|prose>
                streams=<n> spec=<off|on> output_tok_s=<x> rounds=<..> decode_tok_s=<x>
                tokens=<n> machine=<desc> [per_prompt=<x,..>: one stream]
    speculative ratio mode=<m> workload=<w> streams=<n> on_over_off=<x>
                decode_on_over_off=<x> on_over_llamacpp_lookup=<x> acceptance=<x>
                accepted_per_step=<x>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

from bench_format import emit, machine
from speculative_prompts import WORKLOADS

HERE = Path(__file__).parent


async def timed(run: Any) -> tuple[float, int]:
    """A request read to its end: when its first token came, and its tokens."""
    first, tokens = 0.0, 0
    async for delta in run:
        if not tokens and delta.token_ids:
            first = time.perf_counter()
        tokens += len(delta.token_ids)
    return first, tokens


async def one_round(
    engine: Any, workload: str, streams: int, prompts: int, max_tokens: int
) -> tuple[float, float, int, list[float]]:
    """The round's rate (all tokens over its wall time), its decode rate (the tokens after each
    request's first over the time after the requests' median first token), its tokens, and
    each request's own rate. One stream: the workload's first `prompts` prompts one after
    another, their times summed; N streams: N requests at once, prompt i % (its prompts)."""
    waves = [[i] for i in range(prompts)] if streams == 1 else [list(range(streams))]
    messages = WORKLOADS[workload]
    wall = after_first = 0.0
    tokens = later = 0
    each: list[float] = []  # one stream: each request's rate
    for wave in waves:
        started = time.perf_counter()
        runs = [
            engine.generate(messages=messages(i), max_new_tokens=max_tokens, temperature=0.0)
            for i in wave
        ]
        done = await asyncio.gather(*(timed(r) for r in runs))
        ended = time.perf_counter()
        wave_tokens = sum(n for _, n in done)
        wall += ended - started
        after_first += ended - median(first for first, _ in done)
        tokens += wave_tokens
        later += wave_tokens - len(wave)
        if streams == 1:
            each.append(wave_tokens / (ended - started))
    return tokens / wall, later / max(after_first, 1e-9), tokens, each


def peer_round(
    python: str, gguf: Path, max_tokens: int, prompts: int
) -> dict[tuple[str, bool], float]:
    """llama.cpp's one-stream rates, lookup off and on, per workload (llamacpp_lookup.py): the
    workload's first `prompts` prompts one after another, their tokens over their times."""
    command = [python, str(HERE / "llamacpp_lookup.py"), "--gguf", str(gguf)]
    command += ["--max-tokens", str(max_tokens), "--threads", str(os.cpu_count() or 1)]
    command += ["--prompts", str(prompts)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    sums: dict[tuple[str, bool], list[float]] = {}
    for line in out.splitlines():
        item = json.loads(line)
        total = sums.setdefault((item["workload"], item["lookup"]), [0.0, 0.0])
        total[0] += item["tokens"]
        total[1] += item["seconds"]
    return {key: tokens / seconds for key, (tokens, seconds) in sums.items()}


async def run_mode(args: argparse.Namespace, mode: str, peer: dict[str, list[float]]) -> None:
    from shoal import Engine

    options: dict[str, Any] = {"seed": 0}
    if mode == "int8":
        options["quantization"] = "int8"
    else:
        options["dtype"] = mode
    spec: dict[str, Any] = {"speculative_algorithm": "ngram"}
    if args.num_draft_tokens is not None:
        spec["speculative_num_draft_tokens"] = args.num_draft_tokens
    if args.max_running is not None:
        spec["speculative_max_running"] = args.max_running
    # One engine at a time, started for its turn: two engines' launch threads in one process
    # are two OpenMP teams, and then every barrier of the CPU forward sleeps
    # (api/fresh_thread.py), which a server of one engine never meets.
    for streams in args.streams:
        rates: dict[tuple[str, str], list[float]] = {}
        decodes: dict[tuple[str, str], list[float]] = {}  # after the first tokens
        tokens: dict[tuple[str, str], int] = {}
        each: dict[tuple[str, str], list[list[float]]] = {}  # one stream: each prompt's rates
        # speculation's verifications, drafted and kept tokens, per workload
        counted: dict[str, list[int]] = {w: [0, 0, 0] for w in WORKLOADS}
        for _ in range(args.rounds):
            for name, extra in (("off", {}), ("on", spec)):
                async with Engine(args.model, **options, **extra) as engine:
                    await engine.generate(prompt="warm up", max_new_tokens=8).result()
                    for workload in WORKLOADS:
                        before = await engine.snapshot()
                        rate, decode, count, own = await one_round(
                            engine, workload, streams, args.prompts, args.max_tokens
                        )
                        rates.setdefault((workload, name), []).append(rate)
                        each.setdefault((workload, name), []).append(own)
                        decodes.setdefault((workload, name), []).append(decode)
                        tokens[(workload, name)] = count
                        after = await engine.snapshot()
                        moved = (
                            after.spec_steps - before.spec_steps,
                            after.spec_drafted - before.spec_drafted,
                            after.spec_accepted - before.spec_accepted,
                        )
                        total = counted[workload]
                        counted[workload] = [a + b for a, b in zip(total, moved, strict=True)]
            if args.gguf is not None and streams == 1 and args.llamacpp_python:
                for (workload, lookup), rate in peer_round(
                    args.llamacpp_python, args.gguf, args.max_tokens, args.prompts
                ).items():
                    peer.setdefault(f"{workload} {lookup}", []).append(rate)
        for workload, name in ((w, n) for w in WORKLOADS for n in ("off", "on")):
            values = rates[(workload, name)]
            line = {
                "system": "shoal", "mode": mode, "workload": workload, "streams": streams,
                "spec": name, "output_tok_s": round(median(values), 2),
                "rounds": " ".join(f"{v:.1f}" for v in values),
                "decode_tok_s": round(median(decodes[(workload, name)]), 2),
                "tokens": tokens[(workload, name)], "machine": machine(),
            }  # fmt: skip
            if streams == 1:  # each prompt's median rate over the rounds
                per_prompt = zip(*each[(workload, name)], strict=True)
                line["per_prompt"] = ",".join(f"{median(r):.1f}" for r in per_prompt)
            emit("speculative", line, args.out)
        for workload in WORKLOADS:
            on_rate = median(rates[(workload, "on")])
            ratio: dict[str, Any] = {
                "mode": mode, "workload": workload, "streams": streams,
                "on_over_off": round(on_rate / median(rates[(workload, "off")]), 3),
                "decode_on_over_off": round(
                    median(decodes[(workload, "on")]) / median(decodes[(workload, "off")]), 3
                ),
            }  # fmt: skip
            lookup = peer.get(f"{workload} True")
            if streams == 1 and lookup:
                ratio["on_over_llamacpp_lookup"] = round(on_rate / median(lookup), 3)
            steps, drafted, accepted = counted[workload]
            ratio["acceptance"] = round(accepted / drafted, 3) if drafted else 0
            ratio["accepted_per_step"] = round((accepted + steps) / steps, 2) if steps else 0
            emit("speculative ratio", ratio, args.out)


async def main(args: argparse.Namespace) -> None:
    for mode in args.modes:  # the peer runs beside each mode: its ratios are that mode's rounds
        peer: dict[str, list[float]] = {}
        await run_mode(args, mode, peer)
        for key, values in sorted(peer.items()):
            workload, lookup = key.split()
            line = {
                "system": "llamacpp", "mode": "Q4_1", "beside": mode, "workload": workload,
                "streams": 1, "spec": "lookup" if lookup == "True" else "off",
                "output_tok_s": round(median(values), 2),
                "rounds": " ".join(f"{v:.1f}" for v in values), "machine": machine(),
            }  # fmt: skip
            emit("speculative", line, args.out)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder or GGUF (default: bundled)")
    parser.add_argument("--modes", nargs="+", default=["float32", "int8"])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--prompts", type=int, default=3,
        help="one stream: a round runs the workload's first N prompts, one after another",
    )  # fmt: skip
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="speculative_num_draft_tokens of the engine with speculation (default: its own)",
    )
    parser.add_argument(
        "--max-running",
        type=int,
        default=None,
        help="speculative_max_running of the engine with speculation (default: its own)",
    )
    parser.add_argument(
        "--llamacpp-python",
        default=os.environ.get("SHOAL_BENCH_LLAMACPP_PYTHON"),
        help="the Python of llama.cpp's environment (default: $SHOAL_BENCH_LLAMACPP_PYTHON; "
        "unset: no peer)",
    )
    parser.add_argument("--out", type=Path, default=None, help="append the lines as JSON")
    parser.add_argument("--smoke", action="store_true", help="1 and 2 streams, 1 round, 8 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.streams, args.rounds, args.max_tokens, args.modes = [1, 2], 1, 8, ["float32"]
        args.prompts = 2
    args.gguf = None
    if args.llamacpp_python:
        from shoal.loading.loader import bundled_model_path

        given = Path(args.model) if args.model else bundled_model_path()
        args.gguf = given if given.suffix == ".gguf" else None
        if args.gguf is None:
            sys.exit("the llama.cpp peer needs a GGUF: give --model FILE.gguf")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
