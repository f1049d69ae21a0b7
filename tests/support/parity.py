"""Greedy parity against transformers: a mixed batch of prompts, run through an engine at once,
and what transformers' `generate(do_sample=False)` gives for each (support/reference.py).

    prompts = mixed_prompts(tiny_model.config.vocab_size)
    done = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in done] == expect(tiny_reference, prompts)
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from reference import Reference

NEW_TOKENS = 12


def mixed_prompts(vocab: int, seed: int = 7) -> list[list[int]]:
    """8 prompts of mixed lengths, 3 sharing a long prefix, one repeated exactly."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(70)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 17, 41, 96)]
    prompts += [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 30)]
    prompts.append(list(prompts[4]))
    return prompts


def copying_prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    """4 prompts that repeat a phrase: the tiny model's greedy answer then often repeats
    too, so speculative decoding's drafts from the prompt and the output get kept."""
    rng = random.Random(seed)
    prompts = []
    for n, times in ((5, 6), (9, 4), (3, 10), (17, 3)):
        phrase = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(phrase * times + phrase[: n // 2])
    return prompts


async def run_all(engine: Any, prompts: list[list[int]], **sampling: Any) -> list[Any]:
    """Every prompt at once, NEW_TOKENS each at temperature 0; their final outputs."""
    streams = [
        engine.generate(input_ids=p, max_new_tokens=NEW_TOKENS, temperature=0.0, **sampling)
        for p in prompts
    ]
    return await asyncio.gather(*(s.result() for s in streams))


def expect(reference: Reference, prompts: list[list[int]]) -> list[list[int]]:
    return [reference.greedy(p, NEW_TOKENS) for p in prompts]
