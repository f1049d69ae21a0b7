"""Per-message supervision (actors/supervise.py): an exception injected into each actor's
handling of each message kind fails that message's work, and the engine keeps serving.

Two kinds leave shared state unknown and stop the engine on purpose: a plan the scheduler
could not apply and a plan the cache manager could not make (which rows and pages are held
is then unknown). For those the test checks a clean stop instead: every open stream ends
with an error, nothing hangs, and /health says why without the exception's text.

Every kind each actor's mailbox accepts is listed from the message unions themselves, so a
new message kind is tested (or this test fails) without anyone remembering to add it. The
kinds only disaggregation sends (the scheduler's TransferEnded, the transfer actor's) are
tested the same way over a prefill and a decode engine, in tests/disagg/test_disagg.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engines import EngineFactory, message_kinds
from served import ServeFactory

from shoal.actors.executor.draft_asks import DraftAsks
from shoal.actors.executor_messages import ExecutorMsg
from shoal.actors.messages import CacheMsg, SchedulerMsg, TokenizerMsg
from shoal.api.engine import Engine
from shoal.kernels import constraints
from shoal.kernels.constraints import RowContext
from shoal.kernels.grammar_row import GrammarRow
from shoal.params import SamplingParams
from shoal.results import EngineDeadError, InternalError, RequestError

STEP_TIMEOUT_S = 20.0  # a workload step that takes longer has hung
FATAL = {("scheduler", "Plan"), ("cache manager", "PlanRequest")}
DISAGGREGATION = {("scheduler", "TransferEnded")}  # tests/disagg/test_disagg.py: TRANSFER_FAULTS


CASES = [
    (actor, kind)
    for actor, union in (
        ("tokenizer", TokenizerMsg),
        ("scheduler", SchedulerMsg),
        ("cache manager", CacheMsg),
        ("executor", ExecutorMsg),
    )
    for kind in message_kinds(union)
    if (actor, kind) not in DISAGGREGATION
]
PROMPT = [5, 17, 42, 99, 7, 3]


async def _step(name: str, work: Callable[[], Awaitable[Any]], outcomes: dict[str, str]) -> None:
    """Run one workload step; record how it ended. Failing is allowed, hanging is not."""
    try:
        result = await asyncio.wait_for(work(), STEP_TIMEOUT_S)
    except TimeoutError:
        pytest.fail(f"workload step {name!r} hung")
    except (InternalError, EngineDeadError, RequestError, RuntimeError) as exc:
        outcomes[name] = f"raised {type(exc).__name__}: {exc}"
        return
    finish = getattr(result, "finish_reason", None)
    success = getattr(result, "success", None)
    outcomes[name] = f"finish {finish}" if finish else f"success {success}"


def _greedy(engine: Engine, max_new_tokens: int = 6, **sampling: Any) -> Awaitable[Any]:
    return engine.generate(
        input_ids=PROMPT,
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        temperature=0.0,
        **sampling,
    ).result()


async def _first_token_then(engine: Engine, then: Callable[[], Awaitable[Any]]) -> Any:
    """A long request runs; once it has produced a token, `then()` runs beside it."""
    stream = engine.generate(input_ids=PROMPT, max_new_tokens=48, ignore_eos=True)
    async with stream:
        async for _ in stream:
            break
        result = await then()
        stream.abort()
        await asyncio.wait_for(stream.result(), STEP_TIMEOUT_S)
    return result


async def _session(engine: Engine) -> Any:
    session = await engine.open_session()
    done = await session.turn(input_ids=PROMPT, max_new_tokens=3).result()
    await session.close()
    return done


async def _pause_and_continue(engine: Engine) -> Any:
    engine.pause_generation()
    engine.continue_generation()
    return await _greedy(engine, 2)


async def _stepping(engine: Engine) -> Any:
    engine.testing.hold()
    stream = engine.generate(input_ids=PROMPT, max_new_tokens=2, ignore_eos=True)
    try:
        for _ in range(4):
            if await engine.testing.advance() is not None:
                await engine.testing.deliver()
    finally:
        engine.testing.release()
    return await stream.result()


async def _workload(engine: Engine, folder: Path) -> dict[str, str]:
    """Sends every message kind of every actor at least once."""
    outcomes: dict[str, str] = {}

    async def paused_update() -> Any:
        engine.pause_generation()
        try:
            return await engine.update_weights_from_disk(folder)  # parks the running request
        finally:
            engine.continue_generation()

    steps: dict[str, Callable[[], Awaitable[Any]]] = {
        "generate": lambda: _greedy(engine),
        "biased generate": lambda: _greedy(engine, logit_bias={7: 5.0, 99: -100.0}),
        "grammar generate": lambda: _greedy(engine, regex="[a-z]{2,6}"),
        "abort": lambda: _first_token_then(engine, lambda: asyncio.sleep(0)),
        "session": lambda: _session(engine),
        "pause and continue": lambda: _pause_and_continue(engine),
        "snapshot": engine.snapshot,
        "cache stats": engine.cache_stats,
        "flush": engine.flush_cache,
        "flush while busy": lambda: _first_token_then(
            engine, lambda: engine.flush_cache(timeout_s=0.01)
        ),
        "update": lambda: engine.update_weights_from_disk(folder),
        "update while paused": lambda: _first_token_then(engine, paused_update),
        "stepping": lambda: _stepping(engine),
        "release memory": engine.release_memory_occupation,
        "resume memory": engine.resume_memory_occupation,
    }
    for name, work in steps.items():
        await _step(name, work, outcomes)
    return outcomes


@pytest.mark.parametrize(("actor", "kind"), CASES, ids=[f"{a}-{k}" for a, k in CASES])
async def test_a_fault_in_one_message_fails_only_that_message(
    make_engine: EngineFactory, tiny_folder: Path, actor: str, kind: str
) -> None:
    engine = await make_engine()
    before = await _greedy(engine)
    engine.testing.faults.arm(actor, kind)
    outcomes = await _workload(engine, tiny_folder)
    assert engine.testing.faults.fired == [(actor, kind)], f"never sent {kind} to the {actor}"
    if (actor, kind) in FATAL:
        assert engine.dead_reason is not None
        assert actor in engine.dead_reason and "Injected" not in engine.dead_reason
        assert any("EngineDeadError" in o for o in outcomes.values()), outcomes
        return
    assert engine.dead_reason is None, engine.dead_reason
    after = await _greedy(engine)
    assert after.token_ids == before.token_ids
    await engine.check_integrity()
    for outcome in outcomes.values():  # what callers saw names no exception
        assert "InjectedFault" not in outcome and "Traceback" not in outcome


@pytest.mark.parametrize(
    ("actor", "kind", "expected"),
    [
        ("tokenizer", "Generate", "raised InternalError"),
        ("scheduler", "Admit", "finish error"),
        ("executor", "Launch", "finish error"),
        ("scheduler", "StepDone", "finish error"),
        ("tokenizer", "Outputs", "raised InternalError"),
    ],
)
async def test_a_request_whose_message_failed_ends_with_an_error(
    make_engine: EngineFactory, tiny_folder: Path, actor: str, kind: str, expected: str
) -> None:
    engine = await make_engine()
    engine.testing.faults.arm(actor, kind)
    outcomes: dict[str, str] = {}
    await _step("generate", lambda: _greedy(engine), outcomes)
    assert outcomes["generate"].startswith(expected), outcomes
    assert "Injected" not in outcomes["generate"]


@pytest.mark.parametrize(
    ("actor", "kind"), [("tokenizer", "UpdateWeights"), ("executor", "LoadWeights")]
)
async def test_an_update_whose_message_failed_reports_failure(
    make_engine: EngineFactory, tiny_folder: Path, actor: str, kind: str
) -> None:
    engine = await make_engine()
    engine.testing.faults.arm(actor, kind)
    result = await engine.update_weights_from_disk(tiny_folder)
    assert not result.success and actor in result.message
    assert (await engine.update_weights_from_disk(tiny_folder)).success  # the lock is free


async def test_a_fatal_failure_ends_every_stream_and_health_says_why(
    serve: ServeFactory,
) -> None:
    s = await serve()
    streams = [
        s.engine.generate(input_ids=PROMPT, max_new_tokens=64, ignore_eos=True) for _ in range(3)
    ]
    await asyncio.sleep(0)
    s.engine.testing.faults.arm("cache manager", "PlanRequest")
    for stream in streams:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(stream.result(), STEP_TIMEOUT_S)
    async with s.http.get(s.url + "/health") as resp:
        assert resp.status == 503
        message = (await resp.json())["error"]["message"]
    assert "cache manager" in message and "Injected" not in message
    async with s.http.post(s.url + "/generate", json={"input_ids": PROMPT}) as resp:
        assert resp.status == 503


async def test_a_resume_that_waited_for_a_failed_write_done_still_goes_through(
    make_engine: EngineFactory, tiny_folder: Path
) -> None:
    """continue_generation during a paused update waits for the writer's end (UpdateLock.
    may_resume); when handling that end fails, its recovery ends the writer the same way, so
    the parked request runs again rather than staying paused for ever."""
    engine = await make_engine()
    stream = engine.generate(input_ids=PROMPT, max_new_tokens=24, ignore_eos=True)
    async for _ in stream:
        break
    engine.pause_generation()
    engine.testing.faults.arm("tokenizer", "WriteDone")
    update = asyncio.create_task(engine.update_weights_from_disk(tiny_folder))
    await asyncio.sleep(0)  # UpdateWeights is in the mailbox: the writer starts, paused
    engine.continue_generation()
    result = await asyncio.wait_for(update, STEP_TIMEOUT_S)
    assert not result.success and "tokenizer" in result.message
    done = await asyncio.wait_for(stream.result(), STEP_TIMEOUT_S)
    assert done.finish_reason == "length" and len(done.token_ids) == 24
    assert engine.testing.faults.fired == [("tokenizer", "WriteDone")]
    await engine.check_integrity()


class _Failing:
    """A row constraint that fails (a grammar engine's error, say): in its mask, on the launch
    thread, or as it is told a token, on the completion thread."""

    waits_for_tokens = False

    def __init__(self, where: str) -> None:
        self.where = where

    def mask_(self, logits: torch.Tensor) -> None:
        if self.where == "mask":
            raise RuntimeError("the constraint broke")

    def advance(self, token_id: int) -> str | None:
        if self.where == "advance":
            raise RuntimeError("the constraint broke")
        return None


@pytest.mark.parametrize("where", ["mask", "advance"])
async def test_a_row_constraint_that_fails_fails_its_step_and_the_engine_serves_on(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A per-row feature's failure inside the step (kernels/constraints.py) is the executor's
    Launch failing, as any failed step: every request then in flight ends with an error (their
    KV is not trusted), nothing leaks (make_engine checks every row and page is free), and once
    the steps launched ahead of the failure are through, the next requests are served."""

    def failing(params: SamplingParams, context: RowContext) -> _Failing | None:
        return _Failing(where) if params.seed == 13 else None

    monkeypatch.setattr(constraints, "ROW_CONSTRAINTS", (*constraints.ROW_CONSTRAINTS, failing))
    engine = await make_engine()
    before = await _greedy(engine)
    outcomes: dict[str, str] = {}
    await _step("failing", lambda: _greedy(engine, seed=13), outcomes)
    assert outcomes["failing"].startswith("finish error"), outcomes
    assert "the constraint broke" not in outcomes["failing"]  # the log has it, not the caller
    await engine.wait_idle()  # the step launched ahead of the failure fails too
    assert engine.dead_reason is None
    assert (await _greedy(engine)).token_ids == before.token_ids
    biased = await _greedy(engine, logit_bias={7: 100.0})
    assert set(biased.token_ids) == {7}
    await engine.check_integrity()


class _BreakingMatcher:
    """A grammar's matcher that fails after two tokens (as xgrammar's does past its recursion
    limit), its other calls passed to the real one."""

    def __init__(self, matcher: Any) -> None:
        self.matcher, self.taken = matcher, 0

    def fill_next_token_bitmask(self, bitmask: torch.Tensor) -> Any:
        if self.taken >= 2:
            raise RuntimeError("max recursion depth exceeded")
        return self.matcher.fill_next_token_bitmask(bitmask)

    def accept_token(self, token_id: int) -> bool:
        self.taken += 1
        return bool(self.matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


async def test_a_grammar_whose_matcher_fails_ends_its_row_alone(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A matcher that raises (in its mask, on the launch thread) ends its own request with an
    error; the row beside it, in the same steps, gives its tokens as alone."""
    build = GrammarRow.build.__func__  # type: ignore[attr-defined]

    def breaking(cls: type[GrammarRow], params: SamplingParams, context: RowContext) -> Any:
        row = build(cls, params, context)
        if row is not None and params.seed == 13:
            row.matcher = _BreakingMatcher(row.matcher)
        return row

    monkeypatch.setattr(GrammarRow, "build", classmethod(breaking))
    monkeypatch.setattr(
        constraints, "ROW_CONSTRAINTS", (constraints.LogitBias.build, GrammarRow.build)
    )
    engine = await make_engine()
    alone = await _greedy(engine)
    broken = engine.generate(input_ids=PROMPT, regex="[a-z]{6,9}", seed=13)
    beside = asyncio.ensure_future(_greedy(engine))
    done = await broken.result()
    assert done.finish_reason == "error" and "matcher failed" in done.message, done
    assert (await beside).token_ids == alone.token_ids
    again = await engine.generate(input_ids=PROMPT, regex="[a-z]{6,9}").result()
    assert again.finish_reason == "stop" and 6 <= len(again.text) <= 9
    await engine.check_integrity()


async def test_a_grammar_that_cannot_go_on_ends_its_row_alone(make_engine: EngineFactory) -> None:
    """A grammar whose end min_new_tokens bans has nothing left to allow: that request alone
    ends with a clear error (the per-row error of kernels/constraints.py), its neighbours in
    the same steps finish as they would alone, and the engine serves on."""
    engine = await make_engine()
    alone = await _greedy(engine)
    stuck = engine.generate(input_ids=PROMPT, ebnf='root ::= "ab"', min_new_tokens=6)
    beside = asyncio.ensure_future(_greedy(engine))
    done = await stuck.result()
    assert done.finish_reason == "error" and "cannot continue under its grammar" in done.message
    assert engine.tokenizer.decode(list(done.token_ids)) == "ab"
    assert (await beside).token_ids == alone.token_ids
    assert engine.dead_reason is None
    again = await engine.generate(input_ids=PROMPT, ebnf='root ::= "ab"').result()
    assert (again.finish_reason, again.text) == ("stop", "ab")
    await engine.check_integrity()


@pytest.mark.usefixtures("eager_drafts")  # drafts at every match (conftest.py)
async def test_a_verification_that_fails_fails_its_step_and_the_engine_serves_on(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative decoding's verification (actors/executor/draft_asks.py) failing inside a
    step is that Launch failing: the requests in it end with an error, their rows and pages
    come back, and the next speculating requests are served with the right tokens."""
    engine = await make_engine(speculative_algorithm="ngram")

    def copying() -> Awaitable[Any]:
        return engine.generate(
            input_ids=PROMPT * 4, max_new_tokens=16, ignore_eos=True, temperature=0.0
        ).result()

    before = await copying()
    verify = DraftAsks.verify
    calls = 0

    def once_broken(self: DraftAsks, *args: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("the verification broke")
        return verify(self, *args)

    monkeypatch.setattr(DraftAsks, "verify", once_broken)
    outcomes: dict[str, str] = {}
    await _step("failing", copying, outcomes)
    assert outcomes["failing"].startswith("finish error"), outcomes
    assert "the verification broke" not in outcomes["failing"]
    await engine.wait_idle()
    assert engine.dead_reason is None
    assert (await copying()).token_ids == before.token_ids
    assert calls > 1 and (await engine.snapshot()).spec_steps > 0
    await engine.check_integrity()
