"""Speculative decoding's drafting policy replayed (issue 35): a model's greedy answers to
bench/speculative.py's prompts, taken once with speculation off, then fed through the
scheduler's `Speculation` as one stream meets them: a plain decode costs one step, a
verification of k drafts 1 + c k (c: --draft-cost, a draft position's share of a one-row step;
`speculation.DRAFT_COST` is the policy's own), a wait for a token on its way --wait-cost. A
greedy answer is the same with drafts or without, so this gives a policy's speedup over one
token a step without the machine's noise (the prompt's prefill, the same either way, left
out): what bench/speculative.py measures end to end, this explains.

    python bench/spec_replay.py                          # bundled SmolLM2, float32
    python bench/spec_replay.py --modes float32 int8 --save answers.json
    python bench/spec_replay.py --answers answers.json --draft-cost 0.15 0.25 --trace
    python bench/spec_replay.py --answers answers.json --num-draft-tokens 8 12 16

Prints per answer, draft cost and most drafts:
    spec_replay mode=<m> workload=<copy|prose> prompt=<i> draft_cost=<c> num_draft_tokens=<k>
                tokens=<n> steps=<cost> speedup=<x> oracle=<x> verifications=<n> drafted=<n>
                kept=<n>
`oracle`: the speedup were each verification to send exactly the drafts that will be kept (the
same n-gram drafts, known in advance), which no policy passes. --trace adds the verifications
in order (`sent/kept`, `.` a plain decode).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculative_prompts import WORKLOADS

from shoal.actors.scheduler.ngram_drafts import NgramDrafts
from shoal.actors.scheduler.request import Req
from shoal.actors.scheduler.speculation import SpecConfig, Speculation
from shoal.params import SamplingParams


@dataclass(frozen=True)
class Answer:
    mode: str
    workload: str
    index: int
    prompt: list[int]
    output: list[int]


@dataclass(frozen=True)
class Replayed:
    steps: float  # in one-row decode steps
    verifications: int
    drafted: int
    kept: int
    trace: str


def agreed(drafts: Sequence[int], answer: Sequence[int]) -> int:
    """How many drafts a greedy verification keeps: those equal to the answer's, up to one that
    is not."""
    kept = 0
    while kept < min(len(drafts), len(answer)) and drafts[kept] == answer[kept]:
        kept += 1
    return kept


def replay(
    prompt: list[int], output: list[int], draft_cost: float, wait_cost: float, config: SpecConfig
) -> Replayed:
    """One stream through `Speculation`: a plain decode overlaps the next plan (its token on
    its way while the row is planned again), a verification does not."""
    spec = Speculation(config)
    sampling = SamplingParams(max_new_tokens=len(output), temperature=0.0)
    req = Req(rid="r", order=0, sampling=sampling, seed=0, num_prompt=len(prompt), tokens=[*prompt])
    done, on_its_way, steps, marks = 0, False, 0.0, []
    while done + on_its_way < len(output):
        drafts = spec.draft(req, 1)
        if on_its_way:  # it lands: at once when waited for, else as the next step launches
            req.tokens.append(output[done])
            done, on_its_way, req.pending = done + 1, False, 0
            if drafts is None:
                steps += wait_cost
                continue
        assert drafts is not None
        if not drafts:
            steps += 1.0
            on_its_way, req.pending = True, 1
            marks.append(".")
            continue
        kept = agreed(drafts, output[done:])
        spec.verified(req, len(drafts), kept)
        emitted = output[done : done + kept + 1]
        req.tokens.extend(emitted)
        done += len(emitted)
        steps += 1.0 + draft_cost * len(drafts)
        marks.append(f"{len(drafts)}/{kept}")
    counters = spec.counters
    return Replayed(steps, counters.steps, counters.drafted, counters.accepted, " ".join(marks))


def oracle(prompt: list[int], output: list[int], draft_cost: float, config: SpecConfig) -> float:
    """The steps were each verification to send just the drafts that will be kept."""
    ngrams = NgramDrafts(config.min_n, config.max_n, config.num_draft_tokens)
    ngrams.extend(prompt)
    done, steps = 0, 0.0
    while done < len(output):
        drafts = ngrams.propose()
        kept = agreed(drafts, output[done:])
        emitted = output[done : done + kept + 1]
        ngrams.extend(emitted)
        done += len(emitted)
        steps += 1.0 + draft_cost * kept
    return steps


async def capture(model: str | None, mode: str, prompts: int, max_tokens: int) -> list[Answer]:
    """Greedy answers with speculation off, one engine for the mode."""
    from shoal import Engine
    from shoal.actors.tokenizer.encode import encode_prompt

    options: dict[str, Any] = {"seed": 0}
    if mode == "int8":
        options["quantization"] = "int8"
    else:
        options["dtype"] = mode
    answers = []
    async with Engine(model, **options) as engine:
        for workload, messages in WORKLOADS.items():
            for i in range(prompts):
                asked = messages(i)
                ids = encode_prompt(engine.tokenizer, None, None, asked)
                run = engine.generate(input_ids=ids, max_new_tokens=max_tokens, temperature=0.0)
                done = await run.result()
                answers.append(Answer(mode, workload, i, ids, list(done.token_ids)))
    return answers


def report(
    answers: list[Answer],
    costs: list[float],
    num_draft_tokens: list[int],
    wait_cost: float,
    trace: bool,
) -> None:
    for answer in answers:
        for cost, most in itertools.product(costs, num_draft_tokens):
            config = SpecConfig(num_draft_tokens=most)
            got = replay(answer.prompt, answer.output, cost, wait_cost, config)
            tokens = len(answer.output)
            best = oracle(answer.prompt, answer.output, cost, config)
            line = (
                f"spec_replay mode={answer.mode} workload={answer.workload} "
                f"prompt={answer.index} draft_cost={cost:g} num_draft_tokens={most} "
                f"tokens={tokens} "
                f"steps={got.steps:.2f} speedup={tokens / got.steps:.3f} "
                f"oracle={tokens / best:.3f} verifications={got.verifications} "
                f"drafted={got.drafted} kept={got.kept}"
            )
            print(line + (f" trace={got.trace.replace(' ', ',')}" if trace else ""), flush=True)


async def main(args: argparse.Namespace) -> None:
    if args.answers is not None:
        answers = [Answer(**a) for a in json.loads(args.answers.read_text())]
    else:
        answers = []
        for mode in args.modes:
            answers += await capture(args.model, mode, args.prompts, args.max_tokens)
        if args.save is not None:
            args.save.write_text(json.dumps([a.__dict__ for a in answers]))
    report(answers, args.draft_cost, args.num_draft_tokens, args.wait_cost, args.trace)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder or GGUF (default: bundled)")
    parser.add_argument("--modes", nargs="+", default=["float32"], help="float32, int8 ..")
    parser.add_argument("--prompts", type=int, default=3, help="prompts a workload")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--draft-cost", type=float, nargs="+", default=[0.15])
    parser.add_argument(
        "--num-draft-tokens", type=int, nargs="+", default=[SpecConfig().num_draft_tokens],
        help="the most drafts a verification sends (speculative_num_draft_tokens)",
    )  # fmt: skip
    parser.add_argument("--wait-cost", type=float, default=0.05, help="a wait, in decode steps")
    parser.add_argument("--answers", type=Path, default=None, help="replay these (from --save)")
    parser.add_argument("--save", type=Path, default=None, help="keep the answers as JSON")
    parser.add_argument("--trace", action="store_true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
