"""The row-constraint hook (kernels/constraints.py) holds for a constraint with state, as a
grammar's is: a toy one that allows one scripted token a step, and checks at every mask that
it was advanced through exactly the tokens it allowed before, in order. Run beside plain and
biased rows, with steps launched ahead of their results (max_inflight), through a retraction
(its row rebuilt, its tokens replayed) and over pipeline stages.

The last test shows, without an engine, that a launch views a row whose constraint waits only
once its earlier tokens have arrived (a row that does not wait is never held)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from engines import EngineFactory
from parity import NEW_TOKENS, mixed_prompts
from reference import Reference

from shoal.actors.executor.pending_step import PendingStep, RowState, sampling_rows
from shoal.actors.executor.streams import HostResult
from shoal.kernels import constraints
from shoal.kernels.constraints import RowConstraint, RowContext
from shoal.kernels.logit_bias import LogitBias
from shoal.kernels.sampling import SamplingRow
from shoal.params import SamplingParams
from shoal.results import Completion


class Scripted:
    """Allows only script[k] at step k; what a grammar matcher would do, reduced to a list."""

    def __init__(self, script: list[int], waits: bool = True) -> None:
        self.script = script
        self.seen: list[int] = []
        self.waits_for_tokens = waits
        self.out_of_step = False

    def mask_(self, logits: torch.Tensor) -> None:
        k = len(self.seen)
        if self.seen != self.script[:k] or k >= len(self.script):
            self.out_of_step = True
            raise RuntimeError(f"masked at step {k} having seen {self.seen}")
        logits[: self.script[k]] = float("-inf")
        logits[self.script[k] + 1 :] = float("-inf")

    def advance(self, token_id: int) -> str | None:
        self.seen.append(token_id)
        return None


class Scripts:
    """Requests whose seed names a script get a Scripted row; the others none."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, waits: bool = True) -> None:
        self.by_seed: dict[int, list[int]] = {}
        self.built: list[Scripted] = []
        self.waits = waits
        kinds = (*constraints.ROW_CONSTRAINTS, self.build)
        monkeypatch.setattr(constraints, "ROW_CONSTRAINTS", kinds)

    def build(self, params: SamplingParams, context: RowContext) -> RowConstraint | None:
        if params.seed not in self.by_seed:
            return None
        scripted = Scripted(self.by_seed[params.seed], self.waits)
        self.built.append(scripted)
        return scripted

    def add(self, seed: int, length: int) -> list[int]:
        rng = random.Random(seed)
        self.by_seed[seed] = [rng.randrange(3, 500) for _ in range(length)]
        return self.by_seed[seed]


async def run_mixed(
    engine: object, scripts: Scripts, prompts: list[list[int]]
) -> list[tuple[list[int] | None, Completion]]:
    """Every prompt three ways: scripted (sampled: only the script can pick), biased greedy,
    plain greedy; all in flight together."""
    generate = engine.generate  # type: ignore[attr-defined]
    runs = []
    for i, prompt in enumerate(prompts):
        script = scripts.add(1000 + i, NEW_TOKENS)
        scripted = generate(input_ids=prompt, max_new_tokens=NEW_TOKENS, seed=1000 + i)
        runs.append((script, scripted))
        biased = generate(
            input_ids=prompt, max_new_tokens=NEW_TOKENS, temperature=0.0, logit_bias={9: 3.0}
        )
        runs.append((None, biased))
        runs.append((None, generate(input_ids=prompt, max_new_tokens=NEW_TOKENS, temperature=0.0)))
    return [(script, await stream.result()) for script, stream in runs]


def check(
    results: list[tuple[list[int] | None, Completion]],
    prompts: list[list[int]],
    reference: Reference,
) -> None:
    for n, (script, done) in enumerate(results):
        prompt = prompts[n // 3]
        if script is not None:
            assert list(done.token_ids) == script, done
        else:
            bias = {9: 3.0} if n % 3 == 1 else None
            assert list(done.token_ids) == reference.greedy(prompt, NEW_TOKENS, False, bias)


async def test_a_constraint_with_state_is_told_every_token_in_order(
    make_engine: EngineFactory, tiny_reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = Scripts(monkeypatch)
    engine = await make_engine(page_size=4, chunk_size=16, max_inflight=3)
    prompts = mixed_prompts(engine.loaded.config.vocab_size)
    check(await run_mixed(engine, scripts, prompts), prompts, tiny_reference)
    assert len(scripts.built) == len(prompts)


async def test_a_retracted_row_replays_its_tokens_into_a_new_constraint(
    make_engine: EngineFactory, tiny_reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = Scripts(monkeypatch)
    engine = await make_engine(page_size=4, chunk_size=16, kv_cache_tokens=240)
    prompts = mixed_prompts(engine.loaded.config.vocab_size)[1:]
    check(await run_mixed(engine, scripts, prompts), prompts, tiny_reference)
    assert (await engine.snapshot()).num_retractions > 0
    assert len(scripts.built) > len(prompts)  # a retracted row's constraint was built again
    assert all(s.seen == s.script for s in scripts.built if len(s.seen) == NEW_TOKENS)


@pytest.mark.parametrize("stages", [2])
async def test_pipeline_stages_mask_on_the_last_stage(
    make_engine: EngineFactory,
    tiny_reference: Reference,
    monkeypatch: pytest.MonkeyPatch,
    stages: int,
) -> None:
    scripts = Scripts(monkeypatch)
    engine = await make_engine(page_size=4, chunk_size=16, pipeline_stages=stages)
    prompts = mixed_prompts(engine.loaded.config.vocab_size)[:4]
    check(await run_mixed(engine, scripts, prompts), prompts, tiny_reference)


class Watched(threading.Condition):
    """The executor's `arrived`, telling when a launch starts waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        self.waiting.set()
        return super().wait_for(predicate, timeout)


def test_a_launch_views_a_waiting_row_only_once_its_tokens_arrived() -> None:
    """A row whose constraint waits: its view waits for the token a launched step has not
    delivered yet, and sees it advanced; a row whose constraints do not wait is viewed at once."""
    arrived = Watched()
    scripted = Scripted([40, 41, 42])
    waiting = RowState(SamplingParams(), 0, (1,), [], 1, (scripted,))  # one token on its way
    bias = LogitBias({5: 1.0}, torch.device("cpu"))
    free = RowState(SamplingParams(), 0, (1,), [], 1, (bias,))
    [row] = sampling_rows([free], arrived)
    assert not arrived.waiting.is_set() and row.output_ids == [] and row.constraints == (bias,)

    views: list[SamplingRow] = []
    viewer = threading.Thread(target=lambda: views.extend(sampling_rows([waiting], arrived)))
    viewer.start()
    assert arrived.waiting.wait(timeout=30), "the launch did not wait for the row's token"
    token = (torch.tensor([40]),)
    PendingStep([waiting], HostResult(token, None), [], arrived).result()  # the token arrives
    viewer.join(timeout=30)
    assert not viewer.is_alive()
    assert views[0].output_ids == (40,) and scripted.seen == [40]
