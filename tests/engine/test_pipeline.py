"""Pipeline stages (actors/executor/stages.py): greedy tokens equal transformers with the layers
split over 1, 2 or 3 stages, and no lifecycle operation lands while a microbatch is still in a later
stage: SGLang's window (its PR #27446: a cache flush ran while microbatches were in later
stages, their results then hit an emptied radix tree and killed the scheduler), and the same
window for weight updates, aborts, abort-all, client disconnects and a failing stage.

Every window is opened with the stage monitor's seam, never with sleeps: `hold(k)` parks
stage k before its next microbatch and `wait_until` confirms one sits there. Where a test
checks that something did NOT happen inside the window it waits for it a bounded time
(`stays_pending`): the wrong outcome would come in milliseconds. Every held stage is released
before the test ends (the engine's close waits for launched steps).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest
from engines import EngineFactory
from parity import NEW_TOKENS, mixed_prompts, run_all
from reference import Reference
from served import ServeFactory
from tiny_families import make_family_folder
from tiny_model import make_tiny_model_folder
from workload import greedy, prompt

from shoal import Engine
from shoal.actors.executor.stages import StagePipeline
from shoal.kernels import int8_rows
from shoal.kernels.int8_rows import ManyRows
from shoal.kernels.linear import NEVER
from shoal.models.load import LoadedModel, load_model
from shoal.results import EngineDeadError

WAIT_S = 10.0

Counts = tuple[int, ...]
T = TypeVar("T")


# ---- a 4-layer tiny model (and a second checkpoint of it) --------------------------------


@pytest.fixture(scope="module")
def deep_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_folder(tmp_path_factory.mktemp("tiny-llama-4"), num_layers=4)


@pytest.fixture(scope="module")
def deep_model(deep_folder: Path) -> LoadedModel:
    return load_model(deep_folder, progress=False)


@pytest.fixture(scope="module")
def deep_reference(deep_folder: Path, deep_model: LoadedModel) -> Reference:
    return Reference(deep_folder, deep_model.config.eos_token_ids)


@pytest.fixture(scope="module")
def second_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, different weights (seed 1)."""
    return make_tiny_model_folder(tmp_path_factory.mktemp("tiny-llama-4b"), num_layers=4, seed=1)


@pytest.fixture(scope="module")
def second_reference(second_folder: Path) -> Reference:
    return Reference(second_folder, (2,))


Staged = Callable[..., Awaitable[Engine]]


@pytest.fixture
def staged(make_engine: EngineFactory, deep_model: LoadedModel) -> Staged:
    """An engine on the 4-layer model with `stages` pipeline stages."""

    async def start(stages: int, **options: Any) -> Engine:
        options.setdefault("page_size", 4)
        return await make_engine(deep_model, pipeline_stages=stages, **options)

    return start


async def until(engine: Engine, stage: int, count: int = 1) -> None:
    """Block (off the loop) until `count` microbatches are in `stage` (held there)."""

    def ready(counts: Counts) -> bool:
        return counts[stage] == count

    reached = await asyncio.to_thread(engine.testing.stages.wait_until, ready, WAIT_S)
    assert reached, f"never {count} in stage {stage}: {engine.testing.stages.counts()}"


async def stays_pending(task: asyncio.Future[Any], within_s: float = 0.3) -> None:
    """`task` does not finish inside the window (a wrong one would finish in milliseconds)."""
    done, _ = await asyncio.wait({task}, timeout=within_s)
    assert not done, f"finished inside the window: {task.result()!r}"


# ---- greedy parity ------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("stages", [1, 2, 3])
async def test_greedy_equals_transformers_over_stages(
    staged: Staged, deep_reference: Reference, stages: int, page_size: int
) -> None:
    engine = await staged(stages, page_size=page_size, chunk_size=7, kv_cache_tokens=4096)
    assert len(engine.testing.stages.counts()) == stages
    prompts = mixed_prompts(engine.loaded.config.vocab_size)
    expected = [deep_reference.greedy(p, NEW_TOKENS) for p in prompts]
    done = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in done] == expected
    assert all(d.finish_reason in ("stop", "length") for d in done)
    # A second wave hits the prefix cache and still gives the same tokens.
    again = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in again] == expected
    long_ones = [d for d, p in zip(again, prompts, strict=True) if len(p) > page_size + 1]
    assert all(d.usage.cached_tokens > 0 for d in long_ones)


@pytest.mark.parametrize(
    ("stages", "layers", "devices"),
    [(2, "1,3", None), (2, "3,1", "cpu,cpu"), (3, "2,1,1", None), (3, "1,1,2", "cpu,cpu,cpu")],
)
async def test_uneven_stage_layers_give_the_same_tokens(
    staged: Staged,
    deep_reference: Reference,
    stages: int,
    layers: str,
    devices: str | None,
) -> None:
    options: dict[str, Any] = {"stage_layers": layers, "chunk_size": 7}
    if devices is not None:
        options["device"] = "cpu"
        options["stage_devices"] = devices
    engine = await staged(stages, **options)
    prompts = mixed_prompts(engine.loaded.config.vocab_size, seed=3)
    done = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in done] == [
        deep_reference.greedy(p, NEW_TOKENS) for p in prompts
    ]


@pytest.mark.parametrize("stages", [2, 3])
async def test_small_pool_retracts_and_still_matches(
    staged: Staged, deep_reference: Reference, stages: int
) -> None:
    engine = await staged(stages, chunk_size=16, kv_cache_tokens=240)
    prompts = mixed_prompts(engine.loaded.config.vocab_size)[1:]
    done = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in done] == [
        deep_reference.greedy(p, NEW_TOKENS) for p in prompts
    ]
    assert (await engine.snapshot()).num_retractions > 0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("stages", [2, 3])
async def test_five_session_turns_equal_stateless_requests(
    staged: Staged, deep_reference: Reference, stages: int, page_size: int
) -> None:
    engine = await staged(stages, page_size=page_size, chunk_size=7)
    history: list[int] = []
    async with await engine.open_session() as session:
        for turn in range(5):
            new = prompt(3 + 4 * turn, 40 + turn)
            done = await session.turn(input_ids=new, **greedy(5)).result()
            assert list(done.token_ids) == deep_reference.greedy(history + new, 5, True), turn
            if history:
                assert done.usage.cached_tokens >= len(history) - page_size
            history += new + list(done.token_ids)


async def test_seeded_sampling_with_penalties_and_logprobs_is_the_same_over_stages(
    staged: Staged,
) -> None:
    """The seed's step and the penalties' history travel with a microbatch to the last stage:
    seeded sampling gives the same tokens (and logprobs) with 1 and 3 stages."""
    sampling = {
        "max_new_tokens": 16,
        "temperature": 0.9,
        "top_k": 50,
        "repetition_penalty": 1.3,
        "seed": 11,
        "ignore_eos": True,
        "top_logprobs": 2,
    }
    prompts = [prompt(5 + 7 * i, 60 + i) for i in range(4)]
    outputs = []
    for stages in (1, 3):
        engine = await staged(stages, chunk_size=7)
        streams = [engine.generate(input_ids=p, **sampling) for p in prompts]
        outputs.append(await asyncio.gather(*(s.result() for s in streams)))
    one, three = outputs
    assert [d.token_ids for d in one] == [d.token_ids for d in three]
    for a, b in zip(one, three, strict=True):
        assert a.logprobs is not None and b.logprobs is not None
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


@pytest.mark.parametrize("depth", [0, 4])
async def test_pipeline_depth_does_not_change_tokens(
    staged: Staged, deep_reference: Reference, depth: int
) -> None:
    engine = await staged(2, pipeline_depth=depth, chunk_size=16, max_running_requests=3)
    prompts = mixed_prompts(engine.loaded.config.vocab_size, seed=5)
    done = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in done] == [
        deep_reference.greedy(p, NEW_TOKENS) for p in prompts
    ]


@pytest.mark.parametrize("options", [{"attention": "torch"}, {"quantization": "int8"}])
async def test_other_kernels_and_int8_give_the_one_stage_tokens(
    staged: Staged,
    second_folder: Path,
    options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Against a one-stage engine with the same options; int8 also after an update (every
    stage's part is requantized). int8 takes its steps of many rows in another kernel
    (int8_rows.py: bfloat16 from 64 rows on an AVX512-BF16 CPU), and two stages split a step's
    rows into microbatches, so a prompt's tokens would meet different kernels in the two
    engines: its blocks take every step here."""
    monkeypatch.setattr(int8_rows, "many_rows", lambda: ManyRows(NEVER, False))
    prompts = [prompt(4 + 9 * i, 80 + i) for i in range(6)]
    one = await staged(1, **options)
    two = await staged(2, **options)

    async def same_tokens() -> None:
        got = [list(d.token_ids) for d in await run_all(two, prompts)]
        assert got == [list(d.token_ids) for d in await run_all(one, prompts)]

    await same_tokens()
    if "quantization" in options:
        for engine in (one, two):
            result = await engine.update_weights_from_disk(second_folder)
            assert result.success, result.message
        await same_tokens()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pipeline_stages": 2, "stage_layers": "1,2"}, "add up"),
        ({"pipeline_stages": 2, "stage_layers": "0,4"}, "positive"),
        ({"pipeline_stages": 5}, "exceeds the model's 4 layers"),
        ({"pipeline_stages": 2, "stage_layers": "1,1,2"}, "one entry per stage"),
        ({"pipeline_stages": 3, "stage_devices": "cpu,cpu"}, "one entry per stage"),
        ({"pipeline_stages": 0}, "pipeline_stages must be >= 1"),
        ({"pipeline_stages": 2, "pipeline_depth": -1}, "pipeline_depth must be >= 0"),
    ],
)
async def test_stage_options_that_do_not_fit_are_refused(
    make_engine: EngineFactory, deep_model: LoadedModel, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await make_engine(deep_model, **options)


# ---- per-stage counts ---------------------------------------------------------------------


async def test_counts_show_a_held_microbatch_and_return_to_zero(
    staged: Staged, deep_reference: Reference
) -> None:
    engine = await staged(3)
    assert engine.testing.stages.counts() == (0, 0, 0)
    ids = prompt(9, 1)
    engine.testing.stages.hold(1)
    try:
        stream = engine.generate(input_ids=ids, **greedy(4))
        await until(engine, 1)
        assert engine.testing.stages.counts() == (0, 1, 0)
        snap = await engine.snapshot()
        assert [stream.rid] in [list(rids) for rids in snap.launched_batches.values()]
        assert not stream.ended
    finally:
        engine.testing.stages.release(1)
    assert list((await stream.result()).token_ids) == deep_reference.greedy(ids, 4, True)
    await engine.wait_idle()
    assert engine.testing.stages.counts() == (0, 0, 0)


async def test_server_info_and_metrics_show_the_stage_counts(
    serve: ServeFactory, deep_model: LoadedModel
) -> None:
    served = await serve(model=deep_model, pipeline_stages=3, page_size=4)
    engine = served.engine
    body = {"input_ids": prompt(9, 3), "sampling_params": greedy(4)}
    engine.testing.stages.hold(1)
    try:
        request = asyncio.create_task(served.http.post(served.url + "/generate", json=body))
        await until(engine, 1)
        async with served.http.get(served.url + "/get_server_info") as resp:
            info = await resp.json()
        assert info["stage_microbatches"] == [0, 1, 0] and info["in_flight_batches"] == 1
        async with served.http.get(served.url + "/metrics") as resp:
            text = await resp.text()
        assert 'shoal_stage_microbatches{stage="1"} 1.0' in text
        assert 'shoal_stage_microbatches{stage="2"} 0.0' in text
    finally:
        engine.testing.stages.release(1)
    async with await request as resp:
        assert (await resp.json())["meta_info"]["finish_reason"]["type"] == "length"


async def test_stage_zero_can_be_held_and_counted(staged: Staged) -> None:
    engine = await staged(2)
    engine.testing.stages.hold(0)
    try:
        stream = engine.generate(input_ids=prompt(9, 2), **greedy(3))
        reached = await asyncio.to_thread(
            engine.testing.stages.wait_until, lambda c: c[0] == 1, 1.0
        )
    finally:
        engine.testing.stages.release(0)
    await stream.result()
    assert reached, f"no microbatch was ever counted in stage 0: {engine.testing.stages.counts()}"


# ---- SGLang's window: lifecycle operations while a microbatch is in a later stage ---------


async def test_flush_waits_for_a_microbatch_in_the_last_stage(
    staged: Staged, deep_reference: Reference
) -> None:
    engine = await staged(3)
    warm = prompt(21, 7)
    await engine.generate(input_ids=warm, **greedy(3)).result()  # something to flush
    assert (await engine.cache_stats()).cached_tokens > 0
    engine.testing.stages.hold(2)
    try:
        stream = engine.generate(input_ids=prompt(17, 8), **greedy(50))
        await until(engine, 2)
        engine.abort(stream.rid)
        done = await stream.result()  # the client sees it end at once...
        assert done.finish_reason == "abort"
        snap = await engine.snapshot()  # ...and nothing waiting or running
        assert not snap.waiting and not snap.prefill and not snap.running
        assert snap.launched_batches and not snap.idle  # but its microbatch is in stage 2
        flush = asyncio.create_task(engine.flush_cache(timeout_s=30))
        await stays_pending(flush)
        assert engine.testing.stages.counts() == (0, 0, 1)
        assert (await engine.cache_stats()).cached_tokens > 0  # the tree is untouched
    finally:
        engine.testing.stages.release(2)
    result = await flush
    assert result.success, result.message
    await engine.check_integrity()
    stats = await engine.cache_stats()
    assert stats.cached_tokens == 0 and stats.free_pages == stats.total_pages
    assert engine.dead_reason is None
    after = await engine.generate(input_ids=warm, **greedy(6)).result()
    assert list(after.token_ids) == deep_reference.greedy(warm, 6, True)
    assert after.usage.cached_tokens == 0


async def test_flush_that_times_out_in_the_window_refuses_and_loses_nothing(
    staged: Staged, deep_reference: Reference
) -> None:
    engine = await staged(2)
    ids = prompt(15, 9)
    engine.testing.stages.hold(1)
    try:
        stream = engine.generate(input_ids=ids, **greedy(5))
        await until(engine, 1)
        result = await engine.flush_cache(timeout_s=0.05)
        assert not result.success and "did not become idle" in result.message
    finally:
        engine.testing.stages.release(1)
    assert list((await stream.result()).token_ids) == deep_reference.greedy(ids, 5, True)
    assert (await engine.flush_cache(timeout_s=5)).success


async def test_weight_update_waits_for_a_microbatch_in_the_last_stage(
    staged: Staged,
    second_folder: Path,
    deep_reference: Reference,
    second_reference: Reference,
) -> None:
    engine = await staged(3)
    ids = prompt(13, 10)
    assert deep_reference.greedy(ids, 6, True) != second_reference.greedy(ids, 6, True)
    engine.testing.stages.hold(2)
    try:
        stream = engine.generate(input_ids=ids, **greedy(6))
        await until(engine, 2)
        update = asyncio.create_task(engine.update_weights_from_disk(second_folder))
        await stays_pending(update)
        late = engine.generate(input_ids=ids, **greedy(6))  # waits for the update
        assert engine.testing.stages.counts() == (0, 0, 1) and not late.ended
        assert engine.weight_version == "0"
    finally:
        engine.testing.stages.release(2)
    done = await stream.result()  # the request in flight keeps the old weights, every stage
    assert list(done.token_ids) == deep_reference.greedy(ids, 6, True)
    assert done.weight_version == "0"
    result = await update
    assert result.success, result.message
    after = await late.result()
    assert list(after.token_ids) == second_reference.greedy(ids, 6, True)
    assert after.weight_version == "1" and after.usage.cached_tokens == 0
    other = prompt(30, 11)
    fresh = await engine.generate(input_ids=other, **greedy(8)).result()
    assert list(fresh.token_ids) == second_reference.greedy(other, 8, True)


async def test_update_during_pause_with_a_microbatch_in_a_later_stage(
    staged: Staged,
    second_folder: Path,
    deep_reference: Reference,
    second_reference: Reference,
) -> None:
    """Paused with a decode microbatch still in stage 1: the update parks the request only
    once that microbatch is back, and the request continues on the new weights."""
    engine = await staged(2)
    ids = prompt(13, 13)
    stream = engine.generate(input_ids=ids, **greedy(30))
    seen = 0
    async for delta in stream:
        seen += len(delta.token_ids)
        if seen >= 3:
            break
    engine.testing.stages.hold(1)
    try:
        await until(engine, 1)
        engine.pause_generation()
        update = asyncio.create_task(engine.update_weights_from_disk(second_folder))
        await stays_pending(update)
    finally:
        engine.testing.stages.release(1)
    result = await update
    assert result.success, result.message
    engine.continue_generation()
    done = await stream.result()
    assert done.finish_reason == "length" and len(done.token_ids) == 30
    tokens = list(done.token_ids)
    k = next(i for i in range(30) if tokens[: i + 1] != deep_reference.greedy(ids, i + 1, True))
    assert k >= 4  # everything up to the held microbatch came from the old weights
    assert tokens[k:] == second_reference.greedy(ids + tokens[:k], 30 - k, True)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("stage", [1, 2])
async def test_abort_with_its_microbatch_in_a_stage(
    staged: Staged, deep_reference: Reference, stage: int, phase: str
) -> None:
    engine = await staged(3, chunk_size=8)
    await engine.wait_idle()
    start = await engine.cache_stats()
    ids = prompt(20, 14)
    stream = engine.generate(input_ids=ids, **greedy(200))
    if phase == "decode":
        async for _ in stream:  # it has decoded: its next microbatch is a decode
            break
    engine.testing.stages.hold(stage)
    try:
        await until(engine, stage)
        engine.abort(stream.rid)
        done = await stream.result()
        assert done.finish_reason == "abort"
        snap = await engine.snapshot()
        assert stream.rid in snap.finishing and snap.launched_batches
        # Its row and pages stay with it while its microbatch is in the stage.
        assert (await engine.cache_stats()).request_pages > 0
    finally:
        engine.testing.stages.release(stage)
    await engine.check_integrity()
    end = await engine.cache_stats()
    assert end.free_rows == start.free_rows
    assert end.request_pages == end.locked_pages == 0
    # The aborted request's finished KV is reusable, and right.
    again = await engine.generate(input_ids=ids, **greedy(5)).result()
    assert list(again.token_ids) == deep_reference.greedy(ids, 5, True)
    assert again.usage.cached_tokens > 0


async def test_session_turn_aborted_in_a_stage_rolls_back_and_close_waits(
    staged: Staged, deep_reference: Reference
) -> None:
    """A session's turn aborted while its decode microbatch is in stage 2: the session rolls
    back to the turn before, and the next turn (itself held in stage 1 while the session is
    closed) equals a stateless request on the history."""
    engine = await staged(3, chunk_size=8)
    session = await engine.open_session()
    first = prompt(11, 16)
    done = await session.turn(input_ids=first, **greedy(5)).result()
    history = first + list(done.token_ids)
    stream = session.turn(input_ids=prompt(6, 17), **greedy(200))
    async for _ in stream:
        break
    engine.testing.stages.hold(2)
    try:
        await until(engine, 2)
        stream.abort()
        assert (await stream.result()).finish_reason == "abort"
    finally:
        engine.testing.stages.release(2)
    new = prompt(4, 18)
    engine.testing.stages.hold(1)
    try:
        turn = session.turn(input_ids=new, **greedy(6))
        await until(engine, 1)
        closing = asyncio.create_task(session.close())
        await stays_pending(closing)  # close waits for the live turn
    finally:
        engine.testing.stages.release(1)
    after = await turn.result()
    await closing
    assert list(after.token_ids) == deep_reference.greedy(history + new, 6, True)
    assert after.usage.cached_tokens >= len(history) - 4
    await engine.check_integrity()
    stats = await engine.cache_stats()
    assert stats.sessions == stats.session_pages == stats.locked_pages == 0


async def spread_over_stages(
    engine: Engine, count: int, start: Callable[[int], Awaitable[T]] | None = None
) -> list[T]:
    """`count` requests, each launched alone by the step gate: the first held in stage 2,
    the rest queued at stage 1 (counts (0, count - 1, 1)); then the gate is let go and
    stages 1 and 2 stay held. `start(i)` starts request i and returns once the engine has it
    (default: engine.generate, a stream)."""

    async def generate(i: int) -> Any:
        return engine.generate(input_ids=prompt(9 + i, 20 + i), **greedy(100))

    begin = start or generate
    engine.testing.stages.hold(2)
    engine.testing.hold()
    started = [await begin(0)]
    assert await engine.testing.advance() is not None
    await until(engine, 2)
    engine.testing.stages.hold(1)
    for i in range(1, count):
        started.append(await begin(i))
        assert await engine.testing.advance() is not None
        await until(engine, 1, i)
    engine.testing.release()  # results wait in the stages, not at the scheduler's gate
    assert engine.testing.stages.counts() == (0, count - 1, 1)
    assert len((await engine.snapshot()).launched_batches) == count
    return started


def release_stages(engine: Engine) -> None:
    engine.testing.stages.release(1)
    engine.testing.stages.release(2)
    engine.testing.release()  # when spread_over_stages failed before letting the gate go


async def test_update_with_abort_all_over_microbatches_in_every_later_stage(
    staged: Staged, second_folder: Path, second_reference: Reference
) -> None:
    engine = await staged(3)
    try:
        streams = await spread_over_stages(engine, 4)
        update = asyncio.create_task(
            engine.update_weights_from_disk(second_folder, abort_all_requests=True)
        )
        await stays_pending(update)
        assert engine.testing.stages.counts() == (0, 3, 1)
    finally:
        release_stages(engine)
    done = await asyncio.gather(*(s.result() for s in streams))
    assert {d.finish_reason for d in done} == {"abort"}
    result = await update
    assert result.success, result.message
    await engine.check_integrity()
    ids = prompt(11, 99)
    after = await engine.generate(input_ids=ids, **greedy(6)).result()
    assert list(after.token_ids) == second_reference.greedy(ids, 6, True)


async def test_http_abort_all_over_microbatches_in_every_later_stage(
    serve: ServeFactory, deep_model: LoadedModel, deep_reference: Reference
) -> None:
    served = await serve(model=deep_model, pipeline_stages=3, page_size=4)
    engine = served.engine

    async def post(i: int) -> asyncio.Task[Any]:
        rid = f"http-{i}"
        body = {"input_ids": prompt(9 + i, 20 + i), "sampling_params": greedy(100), "rid": rid}
        request = asyncio.create_task(served.http.post(served.url + "/generate", json=body))
        while rid not in (await engine.snapshot()).waiting:  # its arrival, not a window
            await asyncio.sleep(0.005)
        return request

    try:
        requests = await spread_over_stages(engine, 4, post)
        async with served.http.post(
            served.url + "/abort_request", json={"abort_all": True}
        ) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["aborted"] == 4
        assert engine.testing.stages.counts() == (0, 3, 1)
    finally:
        release_stages(engine)
    for request in requests:
        async with await request as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["meta_info"]["finish_reason"]["type"] == "abort"
    await engine.check_integrity()
    ids = prompt(11, 98)
    after = await engine.generate(input_ids=ids, **greedy(6)).result()
    assert list(after.token_ids) == deep_reference.greedy(ids, 6, True)


async def test_client_disconnect_with_its_microbatch_in_the_last_stage(
    staged: Staged, deep_reference: Reference
) -> None:
    """The Python engine's disconnect: cancelling the task that iterates the stream."""
    engine = await staged(3)
    ids = prompt(19, 15)
    stream = engine.generate(input_ids=ids, **greedy(200))
    got: list[int] = []
    decoding = asyncio.Event()

    async def consume() -> None:
        async for delta in stream:
            got.extend(delta.token_ids)
            if len(got) >= 2:
                decoding.set()

    reader = asyncio.create_task(consume())
    await decoding.wait()
    engine.testing.stages.hold(2)
    try:
        await until(engine, 2)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        done = await stream.result()
        assert done.finish_reason == "abort"
        assert (await engine.snapshot()).launched_batches
    finally:
        engine.testing.stages.release(2)
    await engine.check_integrity()
    assert engine.testing.stages.counts() == (0, 0, 0)
    assert len(got) >= 2 and got == deep_reference.greedy(ids, len(got), True)
    after = await engine.generate(input_ids=ids, **greedy(5)).result()
    assert list(after.token_ids) == deep_reference.greedy(ids, 5, True)


@pytest.mark.parametrize("stage", [1, 2])
async def test_a_stage_failure_mid_flight_ends_requests_with_an_error(
    staged: Staged, deep_reference: Reference, stage: int
) -> None:
    engine = await staged(3)
    try:
        streams = await spread_over_stages(engine, 4)
        engine.testing.stages.fail_next(stage)
    finally:
        release_stages(engine)
    done = await asyncio.wait_for(asyncio.gather(*(s.result() for s in streams)), WAIT_S)
    # The failed microbatch's request (the one in stage 2, or the first queued at stage 1)
    # ends with an error; the executor is not trusted after a failed step, so the rest do too.
    failed = done[0] if stage == 2 else done[1]
    assert failed.finish_reason == "error", failed
    assert failed.message.startswith("forward failed"), failed.message
    assert all(d.finish_reason in ("error", "length") for d in done)
    assert engine.dead_reason is None
    await engine.check_integrity()
    assert engine.testing.stages.counts() == (0, 0, 0)
    # The same prompts again (nothing half-written was kept for them), and more.
    prompts = [prompt(9 + i, 20 + i) for i in range(4)]
    prompts += mixed_prompts(engine.loaded.config.vocab_size)
    again = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in again] == [
        deep_reference.greedy(p, NEW_TOKENS) for p in prompts
    ]


# ---- families whose layers differ: each stage must know its layers' global indices -------

# Qwen3's window only below max_window_layers, Gemma's alternating windows and per-type rope,
# Qwen3-MoE's dense mlp_only_layers, Mistral's window trims, Mixtral's experts.
LAYERED_FAMILIES = {
    "qwen3": "1,2",
    "gemma2": "1,1,1",
    "gemma3": "2,1",
    "qwen3_moe": "1,1,1",
    "mistral": "1,1",
    "mixtral": "1,1",
    "phi3": "1,1",
}


@pytest.mark.parametrize("family", sorted(LAYERED_FAMILIES))
async def test_families_with_per_layer_differences_split_over_stages(
    make_engine: EngineFactory, tmp_path: Path, family: str
) -> None:
    folder = make_family_folder(tmp_path / family, family)
    loaded = load_model(folder, progress=False)
    reference = Reference(folder, loaded.config.eos_token_ids)
    layers = LAYERED_FAMILIES[family]
    engine = await make_engine(
        loaded,
        pipeline_stages=len(layers.split(",")),
        stage_layers=layers,
        page_size=4,
        chunk_size=7,
    )
    prompts = mixed_prompts(loaded.config.vocab_size)
    done = await run_all(engine, prompts)
    assert [list(d.token_ids) for d in done] == [reference.greedy(p, NEW_TOKENS) for p in prompts]
    # A long generation: a windowed model trims pages below the window while it runs.
    ids = prompt(30, 70)
    long = await engine.generate(input_ids=ids, **greedy(60)).result()
    assert list(long.token_ids) == reference.greedy(ids, 60, True)


# ---- the engine dying with microbatches in the stages ------------------------------------


def threads_named(prefix: str, before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t not in before]


async def test_engine_death_with_microbatches_mid_pipeline_leaves_no_thread_waiting(
    staged: Staged, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fatal failure elsewhere (the cache manager's plan) stops the engine while one
    microbatch is held in stage 1 and another is queued behind it: the stage threads are
    shut down under them. Every stream ends, and no executor thread is left waiting for a
    microbatch that will never come back (a thread blocked for ever also hangs the
    interpreter's exit, which joins them). The test unblocks such a thread itself, so that a
    failure here does not hang the test run."""
    futures: list[Future[Any]] = []
    submit = StagePipeline.submit

    def recorded(self: StagePipeline, h: Any, micro: Any) -> Future[Any]:
        futures.append(submit(self, h, micro))
        return futures[-1]

    monkeypatch.setattr(StagePipeline, "submit", recorded)
    before = set(threading.enumerate())
    engine = await staged(3)
    monitor = engine.testing.stages  # which refuses once the engine is dead
    monitor.hold(1)
    try:
        streams = [engine.generate(input_ids=prompt(9, 30), **greedy(50))]
        await until(engine, 1)
        streams.append(engine.generate(input_ids=prompt(12, 31), **greedy(50)))
        await until(engine, 1, 2)  # queued at stage 1's thread
        engine.testing.faults.arm("cache manager", "PlanRequest")
        streams.append(engine.generate(input_ids=prompt(9, 32), **greedy(5)))
        for stream in streams:
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(stream.result(), WAIT_S)
        assert engine.dead_reason is not None and "cache manager" in engine.dead_reason
    finally:
        monitor.release(1)
    try:
        for thread in threads_named("shoal-", before):
            await asyncio.to_thread(thread.join, 2.0)
        stuck = [t.name for t in threads_named("shoal-", before) if t.is_alive()]
        lost = sum(not f.done() for f in futures)
        assert not stuck and not lost, f"stuck threads {stuck}, {lost} step(s) never answered"
        assert monitor.counts() == (0, 0, 0)
    finally:
        for future in futures:  # rescue: let a stuck completion thread end
            if not future.done():
                future.set_exception(RuntimeError("never answered (rescued by the test)"))
