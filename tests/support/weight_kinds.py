"""Checks an engine on another kind of weights (int8, bfloat16: test_int8.py, test_bf16.py)
must pass against the float32 engine: greedy tokens until a near-tie, a weight update that
rebuilds them, sessions equal to stateless requests."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from engines import EngineFactory

from shoal import Engine
from shoal.models.load import load_model

GREEDY: dict[str, Any] = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
# Such weights move a logit of the tiny model (random weights, flat distributions: its top
# logits are ~5.0, 4.4, 4.2) by a few hundredths to a tenth: only a float32 choice about this
# close to its runner-up may flip.
NEAR_TIE = 0.25


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(3, 40))] for _ in range(count)]


async def greedy_outputs(engine: Engine, batch: list[list[int]]) -> list[list[int]]:
    streams = [engine.generate(input_ids=p, **GREEDY) for p in batch]
    return [list((await s.result()).token_ids) for s in streams]


async def flips_against(mine: Engine, float32: Engine, batch: list[list[int]]) -> int:
    """How many prompts `mine` leaves float32's greedy tokens on; each first flip must be to
    float32's runner-up at a near-tie (the rest then follows another text, unchecked)."""
    ask = {**GREEDY, "top_logprobs": 2}
    flips = 0
    for prompt in batch:
        got_ids = (await mine.generate(input_ids=prompt, **GREEDY).result()).token_ids
        ref = await float32.generate(input_ids=prompt, **ask).result()
        assert ref.logprobs is not None
        for got, want, scored in zip(got_ids, ref.token_ids, ref.logprobs, strict=True):
            if got != want:
                (first, first_lp), (second, second_lp) = scored.top
                assert (first, second) == (want, got), (prompt, scored)
                assert first_lp - second_lp < NEAR_TIE, (prompt, scored)
                flips += 1
                break
    return flips


async def check_a_weight_update_rebuilds(
    make_engine: EngineFactory, other_folder: Path, tiny_folder: Path, **options: Any
) -> None:
    """An update to the other checkpoint gives an engine started on it its tokens; and back."""
    batch = prompts(6, 1)
    engine = await make_engine(page_size=4, **options)
    before = await greedy_outputs(engine, batch)
    result = await engine.update_weights_from_disk(other_folder)
    assert result.success, result.message
    fresh = await make_engine(load_model(other_folder, progress=False), **options)
    after = await greedy_outputs(engine, batch)
    assert after == await greedy_outputs(fresh, batch)
    assert after != before
    assert (await engine.update_weights_from_disk(tiny_folder)).success  # and back
    assert await greedy_outputs(engine, batch) == before


async def check_sessions_equal_stateless(make_engine: EngineFactory, **options: Any) -> None:
    engine = await make_engine(page_size=4, **options)
    rng = random.Random(5)
    history: list[int] = []
    async with await engine.open_session() as session:
        for turn in range(6):
            new = [rng.randrange(3, 500) for _ in range(rng.randint(1, 9))]
            done = await session.turn(input_ids=new, **GREEDY).result()
            stateless = await engine.generate(input_ids=history + new, **GREEDY).result()
            assert list(done.token_ids) == list(stateless.token_ids), f"turn {turn}"
            if history:
                assert done.usage.cached_tokens >= len(history) - 1
            history += new + list(done.token_ids)
