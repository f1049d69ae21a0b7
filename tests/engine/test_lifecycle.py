"""Lifecycle guarantees, each driven into its window deterministically (docs/architecture.md,
"Lifecycle laws", laws 1-5): weight updates under load, flush only when truly idle,
pause/continue, aborts everywhere."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from engines import EngineFactory
from grammar_cases import tiny_grammars
from reference import Reference
from tiny_model import make_tiny_model_folder
from weight_pushes import checkpoint
from workload import idle_stats, prompt

from shoal import Engine
from shoal.actors.executor.device_state import DeviceState
from shoal.params import GrammarSpec
from shoal.results import RequestStream


@pytest.fixture(scope="module")
def other_reference(other_folder: Path) -> Reference:
    return Reference(other_folder, (2,))


BIASES: list[dict[int, float]] = [{}, {17: 6.0, 300: -100.0, 41: 3.5}]
GRAMMAR = GrammarSpec("regex", "[a-z]{2,4}( [a-z]{2,4}){2}")  # a grammar row (grammar_row.py)


def greedy(**extra: Any) -> dict[str, Any]:
    return {"temperature": 0.0, "ignore_eos": True, **extra}


# ---- weight updates ---------------------------------------------------------------------


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
async def test_update_right_after_each_response_100_times(
    make_engine: EngineFactory,
    tiny_folder: Path,
    other_folder: Path,
    tiny_reference: Reference,
    other_reference: Reference,
    speculative: bool,
) -> None:
    spec = {"speculative_algorithm": "ngram"} if speculative else {}
    engine = await make_engine(page_size=4, **spec)
    ids = prompt(10, 1)
    if speculative:  # the tiny model's greedy answer repeats one token: drafts are kept
        ids = [321, 133, 382, 186, 410] * 3
    refs = {tiny_folder: tiny_reference, other_folder: other_reference}
    assert tiny_reference.greedy(ids, 6, True) != other_reference.greedy(ids, 6, True)
    grammars = tiny_grammars(engine.tokenizer)
    current = tiny_folder
    for i in range(100):
        bias = BIASES[i % 2]  # every other request with a row constraint (kernels/constraints.py)
        if i % 5 == 4:  # and some with a grammar, whose matcher lives in the row
            done = await engine.generate(
                input_ids=ids, max_new_tokens=12, temperature=0.0, regex=GRAMMAR.source
            ).result()
            want = refs[current].greedy(ids, 12, grammar=grammars.matcher(GRAMMAR))
            assert list(done.token_ids) == want, f"round {i}"
        else:
            done = await engine.generate(
                input_ids=ids, max_new_tokens=6, **greedy(logit_bias=bias)
            ).result()
            assert list(done.token_ids) == refs[current].greedy(ids, 6, True, bias), f"round {i}"
        assert done.weight_version == str(i)
        current = other_folder if current == tiny_folder else tiny_folder
        result = await engine.update_weights_from_disk(current)
        assert result.success, result.message
        assert result.weight_version == str(i + 1) == engine.weight_version
    if speculative:
        snapshot = await engine.snapshot()
        assert snapshot.spec_steps > 20 and snapshot.spec_accepted > 0


async def until_admitted(engine: Engine, rids: set[str]) -> None:
    """Wait (up to 10 s) until the scheduler holds every one of these requests in a row."""
    for _ in range(1000):
        snap = await engine.snapshot()
        if rids <= set(snap.rows):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not admitted: {sorted(rids - set(snap.rows))}")


@pytest.mark.parametrize("source", ["disk", "tensors"])
async def test_update_waits_for_in_flight_requests_which_keep_old_weights(
    make_engine: EngineFactory,
    other_folder: Path,
    tiny_reference: Reference,
    other_reference: Reference,
    source: str,
) -> None:
    """From disk or pushed as tensors (api/weight_calls.py), an update is one writer."""
    engine = await make_engine(page_size=4, chunk_size=16)
    pushed = sorted(checkpoint(other_folder).items())
    prompts = [prompt(5 + 3 * i, 100 + i) for i in range(16)]
    streams = [
        engine.generate(input_ids=p, max_new_tokens=40, **greedy(logit_bias=BIASES[i % 2]))
        for i, p in enumerate(prompts)
    ]
    for stream in streams:  # every one admitted and decoding: its first token is out
        async for _ in stream:
            break
    # No step launches until released (stage 0 is the launch thread's, one stage or several):
    # only the steps already launched end, a token or two each, so none of the 16 can finish.
    engine.testing.stages.hold(0)
    try:
        await until_admitted(engine, {s.rid for s in streams})
        update = asyncio.create_task(
            engine.update_weights_from_disk(other_folder)
            if source == "disk"
            else engine.update_weights_from_tensor(pushed)
        )
        await asyncio.sleep(0)  # the update is posted first
        late_bias = greedy(logit_bias=BIASES[1])
        late = engine.generate(input_ids=prompts[0], max_new_tokens=8, **late_bias)  # waits
        await asyncio.sleep(0.05)
        assert not any(s.ended for s in streams)
        assert not update.done() and not late.ended  # both wait for the 16 in flight
    finally:
        engine.testing.stages.release(0)
    done = await asyncio.gather(*(s.result() for s in streams))
    result = await update
    assert result.success, result.message
    for i, (d, p) in enumerate(zip(done, prompts, strict=True)):
        assert d.finish_reason == "length"
        assert list(d.token_ids) == tiny_reference.greedy(p, 40, True, BIASES[i % 2])
        assert d.weight_version == "0"
    after = await late.result()
    assert list(after.token_ids) == other_reference.greedy(prompts[0], 8, True, BIASES[1])
    assert after.weight_version == "1" and after.usage.cached_tokens == 0  # the cache was flushed


async def test_update_with_abort_all_ends_in_flight_requests_as_aborts(
    make_engine: EngineFactory, other_folder: Path, other_reference: Reference
) -> None:
    engine = await make_engine(page_size=4)
    streams = [
        engine.generate(input_ids=prompt(12, i), max_new_tokens=300, **greedy()) for i in range(16)
    ]
    await asyncio.sleep(0.05)
    result = await engine.update_weights_from_disk(other_folder, abort_all_requests=True)
    assert result.success, result.message
    done = await asyncio.gather(*(s.result() for s in streams))
    assert {d.finish_reason for d in done} == {"abort"}
    ids = prompt(7, 99)
    after = await engine.generate(input_ids=ids, max_new_tokens=5, **greedy()).result()
    assert list(after.token_ids) == other_reference.greedy(ids, 5, True)


async def test_bad_updates_change_nothing(
    make_engine: EngineFactory, tmp_path: Path, tiny_reference: Reference
) -> None:
    engine = await make_engine()
    wrong_shapes = make_tiny_model_folder(tmp_path / "wide", hidden_size=96, seed=3)
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((wrong_shapes / "config.json").read_text())
    ids = prompt(9, 5)
    for bad, reason in [
        (tmp_path / "missing", "does not exist"),
        (wrong_shapes, "different architecture"),
        (empty, "missing"),
        (no_weights, "safetensors"),
    ]:
        result = await engine.update_weights_from_disk(bad)
        assert not result.success and reason in result.message, result.message
        assert result.weight_version == engine.weight_version == "0"
        done = await engine.generate(input_ids=ids, max_new_tokens=5, **greedy()).result()
        assert list(done.token_ids) == tiny_reference.greedy(ids, 5, True)


# ---- flush --------------------------------------------------------------------------------


async def test_flush_posted_while_a_batch_is_in_flight_waits_for_idle(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    engine = await make_engine(page_size=4)
    ids = prompt(21, 7)
    await engine.generate(input_ids=ids, max_new_tokens=3, **greedy()).result()  # warm cache
    assert (await engine.cache_stats()).cached_tokens > 0
    engine.testing.hold()
    stream = engine.generate(input_ids=ids, max_new_tokens=3, **greedy())
    assert await engine.testing.advance() is not None
    snap = await engine.snapshot()
    # The window: a batch launched, its result not processed, every queue empty.
    assert snap.launched_batches and not snap.waiting and not snap.prefill
    flush = asyncio.create_task(engine.flush_cache(timeout_s=30))
    await asyncio.sleep(0.1)
    assert not flush.done()  # it did not run inside the window
    engine.testing.release()
    done = await stream.result()
    assert list(done.token_ids) == tiny_reference.greedy(ids, 3, True)
    result = await flush
    assert result.success, result.message
    stats = await engine.cache_stats()
    assert stats.cached_tokens == 0 and stats.free_pages == stats.total_pages


async def test_flush_that_times_out_refuses_and_loses_nothing(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    engine = await make_engine()
    engine.testing.hold()
    ids = prompt(15, 8)
    stream = engine.generate(input_ids=ids, max_new_tokens=4, **greedy())
    await engine.testing.advance()
    result = await engine.flush_cache(timeout_s=0.05)
    assert not result.success and "did not become idle" in result.message
    engine.testing.release()
    assert list((await stream.result()).token_ids) == tiny_reference.greedy(ids, 4, True)
    flushes = await asyncio.gather(*(engine.flush_cache(timeout_s=5) for _ in range(3)))
    assert all(f.success for f in flushes)


# ---- row ownership under chunking ---------------------------------------------------------


async def test_chunked_request_keeps_its_row_with_the_table_full(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    engine = await make_engine(page_size=4, chunk_size=4, max_running_requests=2)
    long_prompt = prompt(30, 9)
    shorts = [prompt(3 + i, 200 + i) for i in range(6)]
    engine.testing.hold()
    long_stream = engine.generate(input_ids=long_prompt, max_new_tokens=5, **greedy())
    streams = [engine.generate(input_ids=p, max_new_tokens=4, **greedy()) for p in shorts]
    long_rows: set[int] = set()
    chunks = 0
    while not long_stream.ended or not all(s.ended for s in streams):
        launched = await engine.testing.advance()
        snap = await engine.snapshot()
        rows = snap.rows
        if long_stream.rid in rows:
            long_rows.add(rows[long_stream.rid])
            others = [rid for rid, row in rows.items() if rid != long_stream.rid]
            assert all(rows[rid] != rows[long_stream.rid] for rid in others)
            chunks += long_stream.rid in snap.prefill or snap.progress[long_stream.rid] > 0
        if launched is not None or snap.launched_batches:
            await engine.testing.deliver()
    engine.testing.release()
    assert len(long_rows) == 1 and chunks >= 4
    assert list((await long_stream.result()).token_ids) == tiny_reference.greedy(
        long_prompt, 5, True
    )
    for s, p in zip(streams, shorts, strict=True):
        assert list((await s.result()).token_ids) == tiny_reference.greedy(p, 4, True)


async def test_a_reused_row_keeps_nothing_of_its_previous_requests_sampling(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    """What the executor keeps per row on the device (temperature, filters, the seed's step,
    logprobs: actors/executor/sampling_slots.py) is its request's alone: with one row, every
    request takes the row the previous one left, and draws as it would on a fresh one."""
    engine = await make_engine(page_size=4, max_running_requests=1)
    ids = prompt(10, 3)
    seeded = {"temperature": 0.9, "top_k": 20, "seed": 5, "ignore_eos": True}
    first = await engine.generate(input_ids=ids, max_new_tokens=8, **seeded).result()
    hot = {"temperature": 1.5, "top_p": 0.5, "seed": 77, "ignore_eos": True, "top_logprobs": 2}
    await engine.generate(input_ids=prompt(7, 4), max_new_tokens=12, **hot).result()
    plain = await engine.generate(input_ids=ids, max_new_tokens=8, **greedy()).result()
    assert list(plain.token_ids) == tiny_reference.greedy(ids, 8, True)
    assert plain.logprobs is None
    again = await engine.generate(input_ids=ids, max_new_tokens=8, **seeded).result()
    assert again.token_ids == first.token_ids


# ---- aborts at every stage ----------------------------------------------------------------


async def run_to(engine: Engine, rid: str, stage: str) -> None:
    """Step the held engine until request `rid` is at `stage`."""
    for _ in range(50):
        snap = await engine.snapshot()
        in_flight = any(rid in rids for rids in snap.launched_batches.values())
        if stage == "waiting" and rid in snap.waiting:
            return
        chunked = rid in snap.prefill and snap.progress[rid] > 0
        if stage == "mid-chunk" and chunked and not in_flight:
            return
        if stage == "launched" and rid in snap.running and in_flight:
            return
        if stage == "decoding" and rid in snap.running and not in_flight:
            return
        if stage == "finished" and rid in snap.finishing and not in_flight:
            return
        if snap.launched_batches:
            await engine.testing.deliver()  # waits for the result (max_inflight is 1 here)
        elif await engine.testing.advance() is None:
            break
    pytest.fail(f"never reached {stage}: {await engine.snapshot()}")


@pytest.mark.parametrize("stage", ["waiting", "mid-chunk", "launched", "decoding", "finished"])
async def test_abort_at_every_stage_releases_everything(
    make_engine: EngineFactory, stage: str
) -> None:
    engine = await make_engine(page_size=4, chunk_size=4, max_running_requests=1, max_inflight=1)
    start = await idle_stats(engine)
    engine.testing.hold()
    blocker = engine.generate(input_ids=prompt(3, 1), max_new_tokens=2, **greedy())
    max_new = 1 if stage == "finished" else 50
    target = engine.generate(input_ids=prompt(14, 2), max_new_tokens=max_new, **greedy())
    if stage != "waiting":
        while not blocker.ended:
            if (await engine.snapshot()).launched_batches:
                await engine.testing.deliver()
            else:
                await engine.testing.advance()
    await run_to(engine, target.rid, stage)
    engine.abort(target.rid)
    engine.testing.release()
    done = await target.result()
    assert done.finish_reason == ("length" if stage == "finished" else "abort")
    await blocker.result()
    end = await idle_stats(engine)
    assert end.free_rows == start.free_rows
    assert end.request_pages == end.locked_pages == 0
    assert end.free_pages + end.evictable_pages == start.free_pages


# ---- pause / continue ---------------------------------------------------------------------


async def test_pause_holds_work_and_continue_resumes_it(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    engine = await make_engine()
    ids = prompt(11, 12)
    running = engine.generate(input_ids=ids, max_new_tokens=60, **greedy())
    async for _ in running:
        break
    engine.pause_generation()
    await asyncio.sleep(0.05)
    queued = engine.generate(input_ids=ids, max_new_tokens=5, **greedy())
    snap = await engine.snapshot()
    before = snap.progress[running.rid]
    await asyncio.sleep(0.1)
    snap = await engine.snapshot()
    assert snap.paused and snap.progress[running.rid] == before
    assert not snap.launched_batches and not queued.ended
    engine.continue_generation()
    assert list((await running.result()).token_ids) == tiny_reference.greedy(ids, 60, True)
    assert list((await queued.result()).token_ids) == tiny_reference.greedy(ids, 5, True)


async def test_pause_abort_ends_requests_with_their_output_and_a_resubmission_goes_on(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    """SGLang's default pause ("abort"), as AReaL uses it around a weight update: the
    running request ends at once with what it generated; resubmitted as prompt + partial
    output, it waits while paused and then decodes the rest, token for token."""
    engine = await make_engine(page_size=4)
    ids = prompt(13, 13)
    expected = tiny_reference.greedy(ids, 60, True)
    running = engine.generate(input_ids=ids, max_new_tokens=60, **greedy())
    async for _ in running:
        break
    engine.pause_generation("abort")
    done = await asyncio.wait_for(running.result(), 5)
    partial = list(done.token_ids)
    assert done.finish_reason == "abort" and 0 < len(partial) < 60
    assert partial == expected[: len(partial)] and done.usage.completion_tokens == len(partial)
    rest = engine.generate(input_ids=ids + partial, max_new_tokens=60 - len(partial), **greedy())
    await asyncio.sleep(0.1)
    snap = await engine.snapshot()
    assert snap.paused and not rest.ended and not snap.launched_batches
    engine.continue_generation()
    assert partial + list((await rest.result()).token_ids) == expected
    await engine.wait_idle()


async def test_pause_retract_gives_the_kv_back_and_continue_prefills_again(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    """ "retract": the running request holds no row while paused (its pages are the
    cache's again), and after continue it finishes as if never stopped."""
    engine = await make_engine(page_size=4)
    ids = prompt(17, 11)
    running = engine.generate(input_ids=ids, max_new_tokens=60, **greedy())
    async for _ in running:
        break
    engine.pause_generation("retract")
    for _ in range(200):  # the retraction waits for the batches in flight
        snap = await engine.snapshot()
        if running.rid in snap.waiting:
            break
        await asyncio.sleep(0.01)
    assert snap.paused and running.rid in snap.waiting and running.rid not in snap.rows
    assert not running.ended
    engine.continue_generation()
    assert list((await running.result()).token_ids) == tiny_reference.greedy(ids, 60, True)
    with pytest.raises(ValueError, match="mode must be one of"):
        engine.pause_generation("later")  # type: ignore[arg-type]


async def paused_after(engine: Engine, ids: list[int], tokens: int) -> RequestStream:
    """A greedy 30-token request, and the engine paused once it has streamed `tokens`."""
    stream = engine.generate(input_ids=ids, max_new_tokens=30, **greedy())
    seen: list[int] = []
    async for delta in stream:
        seen.extend(delta.token_ids)
        if len(seen) >= tokens:
            engine.pause_generation()
            break
    return stream


async def test_update_during_pause_keeps_requests_which_continue_on_new_weights(
    make_engine: EngineFactory,
    other_folder: Path,
    tiny_reference: Reference,
    other_reference: Reference,
) -> None:
    engine = await make_engine(page_size=4)
    ids = prompt(13, 13)
    stream = await paused_after(engine, ids, 5)
    await asyncio.sleep(0.05)
    snap = await engine.snapshot()
    while snap.launched_batches:
        await asyncio.sleep(0.01)
        snap = await engine.snapshot()
    result = await engine.update_weights_from_disk(other_folder)
    assert result.success, result.message
    engine.continue_generation()
    done = await stream.result()
    assert done.finish_reason == "length" and len(done.token_ids) == 30
    tokens = list(done.token_ids)
    k = next(i for i in range(30) if tokens[: i + 1] != tiny_reference.greedy(ids, i + 1, True))
    assert k >= 5  # everything before the pause came from the old weights
    assert tokens[k:] == other_reference.greedy(ids + tokens[:k], 30 - k, True)


async def test_continue_during_a_paused_update_waits_for_the_new_weights(
    make_engine: EngineFactory,
    other_folder: Path,
    other_reference: Reference,
    tiny_reference: Reference,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """continue_generation while a paused update loads: the parked request is not admitted
    again until the load and the flush are done (else it would hold pages, and read KV, from
    the old weights when the flush lands), and it ends on the new weights, reporting them."""
    loading, release = threading.Event(), threading.Event()
    load = DeviceState.load_weights

    def held_load(self: DeviceState, model_path: str) -> str | None:
        loading.set()
        release.wait(10)
        return load(self, model_path)

    monkeypatch.setattr(DeviceState, "load_weights", held_load)
    engine = await make_engine(page_size=4)
    ids = prompt(13, 13)
    stream = await paused_after(engine, ids, 5)
    update = asyncio.create_task(engine.update_weights_from_disk(other_folder))
    while not loading.is_set():
        await asyncio.sleep(0.01)
    engine.continue_generation()
    await asyncio.sleep(0.2)  # room for a wrong re-admission
    snap = await engine.snapshot()
    assert not snap.rows and not snap.launched_batches, snap
    release.set()
    result = await update
    assert result.success, result.message
    done = await stream.result()
    assert done.finish_reason == "length" and len(done.token_ids) == 30
    assert done.weight_version == result.weight_version
    tokens = list(done.token_ids)
    k = next(i for i in range(30) if tokens[: i + 1] != tiny_reference.greedy(ids, i + 1, True))
    assert k >= 5
    assert tokens[k:] == other_reference.greedy(ids + tokens[:k], 30 - k, True)
    await engine.check_integrity()
