"""Speculative decoding's gain (issue 35): n-gram drafts verified in one step, on against off,
on a copy-heavy workload (give a code block back with one name changed) and one with nothing
to copy (a new story), at 1 and 16 streams, beside llama.cpp with and without its prompt-lookup
decoding on the same GGUF and prompts (one stream: llama-cpp-python serves one at a time).

Each round runs speculation off and on, the two taking turns going first (one engine at a
time, started for its turn), then the peer, so that a noisy machine's drift falls on each
alike. Greedy, the model's chat template; a rate is output tokens over wall time, prompt
included, for every system alike: one stream runs the workload's first `--prompts` prompts (3:
all of copy's code blocks) one after another, the round's rate their tokens over their summed
times, each prompt's own rate printed too (`per_prompt`); N streams: N requests at once, all
their tokens over the round's wall time. shoal's decode rate leaves the prompt out: the tokens
after each request's first over the time after the requests' median first token (one stream:
what its reader sees once the answer starts). N streams, more than `speculative_max_running`
(M, 8 by default): a round is also timed in two parts (bench/speculative_rounds.py), the head
while more than M requests run (the same code on and off: its ratio is the machine's noise)
and the tail once at most M do (where speculation may run).

    python bench/speculative.py                      # bundled SmolLM2 in float32 and int8
    python bench/speculative.py --modes float32 --streams 1 --rounds 3
    python bench/speculative.py --llamacpp-python /path/to/venv/bin/python   # the peer
    python bench/speculative.py --modes int8 --streams 16 --rounds 10 --control   # A/A: the noise
    python bench/speculative.py --smoke

Prints per mode, workload and stream count the median of the rounds:
    speculative system=<shoal|llamacpp> mode=<float32|int8|Q4_1> workload=<copy|prose>
                streams=<n> spec=<off|on> output_tok_s=<x> rounds=<..> decode_tok_s=<x>
                tokens=<n> machine=<desc> [per_prompt=<x,..>: one stream]
                [head_tok_s=<x> tail_tok_s=<x>: N > M streams]
    speculative ratio mode=<m> workload=<w> streams=<n> on_over_off=<x>
                decode_on_over_off=<x> [head_on_over_off=<x> tail_on_over_off=<x>]
                [on_over_llamacpp_lookup=<x>] verifications=<n> acceptance=<x>
                accepted_per_step=<x>
(`--control`: every line also says control=1, and "on" ran without speculation.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median
from typing import Any

from bench_format import emit, machine
from speculative_prompts import WORKLOADS
from speculative_rounds import Round, one_round

HERE = Path(__file__).parent


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
    from shoal.config import EngineOptions

    # one cap for both engines (unset, each start would measure its own: resolve_options.py)
    options: dict[str, Any] = {"seed": 0, "max_mixed_prefill_tokens": args.max_mixed_prefill}
    if mode == "int8":
        options["quantization"] = "int8"
    else:
        options["dtype"] = mode
    spec: dict[str, Any] = {"speculative_algorithm": "ngram"}
    if args.num_draft_tokens is not None:
        spec["speculative_num_draft_tokens"] = args.num_draft_tokens
    max_running = EngineOptions.speculative_max_running
    if args.max_running is not None:
        spec["speculative_max_running"] = max_running = args.max_running
    if args.control:  # an A/A run: the "on" turn's engine is the "off" one's
        spec = {}
    for streams in args.streams:
        rounds: dict[tuple[str, str], list[Round]] = {}
        # speculation's verifications, drafted and kept tokens, per workload
        counted: dict[str, list[int]] = {w: [0, 0, 0] for w in WORKLOADS}
        for turn in range(args.rounds):
            # Off and on take turns going first, so that the machine's drift falls on each
            # alike. One engine at a time, started for its turn: two engines' launch threads
            # in one process are two OpenMP teams, and then every barrier of the CPU forward
            # sleeps (api/fresh_thread.py), which a server of one engine never meets.
            order = (("off", {}), ("on", spec))
            for name, extra in order if turn % 2 == 0 else order[::-1]:
                async with Engine(args.model, **options, **extra) as engine:
                    await engine.generate(prompt="warm up", max_new_tokens=8).result()
                    for workload in WORKLOADS:
                        before = await engine.snapshot()
                        rounds.setdefault((workload, name), []).append(
                            await one_round(
                                engine, workload, streams, args.prompts, args.max_tokens,
                                max_running,
                            )
                        )  # fmt: skip
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
        report(args, mode, streams, rounds, counted, peer)


def middle(values: list[float | None]) -> float | None:
    """The median of the rounds that have the figure (None: none has it)."""
    known = [v for v in values if v is not None]
    return median(known) if known else None


def report(
    args: argparse.Namespace,
    mode: str,
    streams: int,
    rounds: dict[tuple[str, str], list[Round]],
    counted: dict[str, list[int]],
    peer: dict[str, list[float]],
) -> None:
    """A line per workload and setting (the median of its rounds), and the ratios."""
    for workload, name in ((w, n) for w in WORKLOADS for n in ("off", "on")):
        runs = rounds[(workload, name)]
        line: dict[str, Any] = {
            "system": "shoal", "mode": mode, "workload": workload, "streams": streams,
            "spec": name, "output_tok_s": round(median(r.rate for r in runs), 2),
            "rounds": " ".join(f"{r.rate:.1f}" for r in runs),
            "decode_tok_s": round(median(r.decode_rate for r in runs), 2),
            "tokens": runs[-1].tokens, "machine": machine(),
        }  # fmt: skip
        if args.control:
            line["control"] = 1
        if streams == 1:  # each prompt's median rate over the rounds
            per_prompt = zip(*(r.each for r in runs), strict=True)
            line["per_prompt"] = ",".join(f"{median(r):.1f}" for r in per_prompt)
        for part in ("head", "tail"):
            rate = middle([getattr(r, f"{part}_rate") for r in runs])
            if rate is not None:
                line[f"{part}_tok_s"] = round(rate, 2)
        emit("speculative", line, args.out)
    for workload in WORKLOADS:
        on, off = rounds[(workload, "on")], rounds[(workload, "off")]
        on_rate = median(r.rate for r in on)
        ratio: dict[str, Any] = {
            "mode": mode, "workload": workload, "streams": streams,
            "on_over_off": round(on_rate / median(r.rate for r in off), 3),
            "decode_on_over_off": round(
                median(r.decode_rate for r in on) / median(r.decode_rate for r in off), 3
            ),
        }  # fmt: skip
        if args.control:
            ratio["control"] = 1
        for part in ("head", "tail"):
            on_part = middle([getattr(r, f"{part}_rate") for r in on])
            off_part = middle([getattr(r, f"{part}_rate") for r in off])
            if on_part is not None and off_part is not None:
                ratio[f"{part}_on_over_off"] = round(on_part / off_part, 3)
        lookup = peer.get(f"{workload} True")
        if streams == 1 and lookup:
            ratio["on_over_llamacpp_lookup"] = round(on_rate / median(lookup), 3)
        steps, drafted, accepted = counted[workload]
        ratio["verifications"] = steps
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
        "--max-mixed-prefill",
        type=int,
        default=64,
        help="both engines' max_mixed_prefill_tokens (default 64, the CPU's before it was "
        "measured at start: the figures before stay comparable)",
    )
    parser.add_argument(
        "--llamacpp-python",
        default=os.environ.get("SHOAL_BENCH_LLAMACPP_PYTHON"),
        help="the Python of llama.cpp's environment (default: $SHOAL_BENCH_LLAMACPP_PYTHON; "
        "unset: no peer)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="an A/A run: the 'on' turn's engine without speculation too, so that its ratios "
        "are the machine's noise alone (lines say control=1)",
    )
    parser.add_argument("--out", type=Path, default=None, help="append the lines as JSON")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="1 and 2 streams, 1 round, 8 tokens, speculating while 1 request runs (2 streams: "
        "a head and a tail)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.streams, args.rounds, args.max_tokens, args.modes = [1, 2], 1, 8, ["float32"]
        args.prompts, args.max_running = 2, 1
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
