"""The Engine facade: sampling, validation, stops, streaming, aborts and failures."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from engines import EngineFactory
from reference import Reference

from shoal import EngineDeadError, SamplingParams
from shoal.actors.executor.device_state import DeviceState
from shoal.actors.executor.pending_step import PendingStep


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


async def test_seeded_sampling_is_the_same_whatever_the_batch(make_engine: EngineFactory) -> None:
    engine = await make_engine(page_size=4)
    target = prompt_ids(20, 1)
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_new_tokens=16)

    alone = await engine.generate(input_ids=target, sampling=sampling).result()
    others = [
        engine.generate(input_ids=prompt_ids(5 + 9 * i, 10 + i), max_new_tokens=20)
        for i in range(5)
    ]
    crowded = engine.generate(input_ids=target, sampling=sampling)
    more = [
        engine.generate(input_ids=prompt_ids(30, 20 + i), temperature=1.0, max_new_tokens=9)
        for i in range(3)
    ]
    results = await asyncio.gather(crowded.result(), *(s.result() for s in others + more))
    assert results[0].token_ids == alone.token_ids
    reseeded = await engine.generate(
        input_ids=target,
        sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_new_tokens=16),
    ).result()
    assert reseeded.token_ids != alone.token_ids


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),  # 0: the prefill alone (prompt logprobs)
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": (10**9,)}, "stop_token_ids"),
        ({"stop": ("",)}, "stop"),
        ({"max_new_tokens": "many"}, "max_new_tokens"),
    ],
)
async def test_bad_sampling_raises_before_anything_is_queued(
    make_engine: EngineFactory, options: dict[str, object], field: str
) -> None:
    engine = await make_engine()
    with pytest.raises(ValueError, match=field):
        engine.generate(input_ids=[5, 6, 7], **options)
    snap = await engine.snapshot()
    assert snap.idle and not snap.waiting


async def test_bad_inputs_end_the_stream_with_a_clear_error(make_engine: EngineFactory) -> None:
    engine = await make_engine(context_length=64)
    with pytest.raises(ValueError, match="context length"):
        await engine.generate(input_ids=list(range(3, 60)), max_new_tokens=10).result()
    with pytest.raises(ValueError, match="vocabulary"):
        await engine.generate(input_ids=[5, 100_000]).result()
    with pytest.raises(ValueError, match="empty"):
        await engine.generate(input_ids=[]).result()
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate("text", input_ids=[1])
    with pytest.raises(TypeError, match="unknown sampling"):
        engine.generate("text", temprature=0.5)
    ok = await engine.generate(input_ids=[5, 6, 7], max_new_tokens=3).result()
    assert len(ok.token_ids) <= 3


async def test_stream_deltas_add_up_to_the_completion(make_engine: EngineFactory) -> None:
    engine = await make_engine()
    stream = engine.generate(
        "Once upon a time", max_new_tokens=24, temperature=0.0, ignore_eos=True
    )
    deltas = [d async for d in stream]
    done = await stream.result()
    assert "".join(d.text for d in deltas) == done.text
    assert tuple(t for d in deltas for t in d.token_ids) == done.token_ids
    assert done.text == engine.tokenizer.decode(list(done.token_ids), skip_special_tokens=True)
    assert done.finish_reason == "length" and done.usage.completion_tokens == 24


async def test_stop_string_trims_the_text_and_ends_the_request(
    make_engine: EngineFactory,
) -> None:
    engine = await make_engine()
    full = await engine.generate(
        "The quick", max_new_tokens=40, temperature=0.0, ignore_eos=True
    ).result()
    text = full.text
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if text[i : i + 3].strip())
    cut = await engine.generate(
        "The quick", max_new_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]
    ).result()
    assert cut.finish_reason == "stop" and cut.matched_stop == stop
    assert cut.text == text[: text.index(stop)]
    assert len(cut.token_ids) < len(full.token_ids)
    kept = await engine.generate(
        "The quick",
        max_new_tokens=40,
        temperature=0.0,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=True,
    ).result()
    assert kept.text == cut.text + stop and kept.token_ids == cut.token_ids
    assert kept.finish_reason == "stop" and kept.matched_stop == stop


async def test_stop_token_and_eos(make_engine: EngineFactory, tiny_reference: Reference) -> None:
    engine = await make_engine()
    prompt = prompt_ids(12, 3)
    full = await engine.generate(
        input_ids=prompt, max_new_tokens=10, temperature=0.0, ignore_eos=True
    ).result()
    token = full.token_ids[4]
    first = full.token_ids.index(token)
    cut = await engine.generate(
        input_ids=prompt,
        max_new_tokens=10,
        temperature=0.0,
        ignore_eos=True,
        stop_token_ids=[token],
    ).result()
    assert cut.finish_reason == "stop" and cut.matched_stop == token
    assert cut.token_ids == full.token_ids[: first + 1]
    assert full.token_ids == tuple(tiny_reference.greedy(prompt, 10, ignore_eos=True))


async def test_abort_mid_stream_and_by_leaving_the_block(make_engine: EngineFactory) -> None:
    engine = await make_engine()
    stream = engine.generate(input_ids=prompt_ids(30, 4), max_new_tokens=400, ignore_eos=True)
    async for _ in stream:
        stream.abort()
    done = await stream.result()
    assert done.finish_reason == "abort" and len(done.token_ids) < 400

    async with engine.generate(
        input_ids=prompt_ids(30, 5), max_new_tokens=400, ignore_eos=True
    ) as second:
        async for _ in second:
            break
    await engine.wait_idle()

    third = engine.generate(input_ids=prompt_ids(30, 6), max_new_tokens=400, ignore_eos=True)
    engine.abort(third.rid)
    assert (await third.result()).finish_reason == "abort"


async def test_cancelling_the_consumer_aborts_the_request(make_engine: EngineFactory) -> None:
    engine = await make_engine()
    stream = engine.generate(input_ids=prompt_ids(8, 7), max_new_tokens=400, ignore_eos=True)

    async def consume() -> None:
        async for _ in stream:
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.wait_idle(timeout_s=10)


async def test_duplicate_request_id_is_refused(make_engine: EngineFactory) -> None:
    engine = await make_engine()
    first = engine.generate(input_ids=[5, 6], max_new_tokens=50, ignore_eos=True, rid="same")
    second = engine.generate(input_ids=[5, 6], max_new_tokens=5, rid="same")
    with pytest.raises(ValueError, match="already in use"):
        await second.result()
    assert (await first.result()).finish_reason == "length"


async def test_chat_messages_use_the_template(make_engine: EngineFactory) -> None:
    engine = await make_engine()
    messages = [{"role": "user", "content": "Hello there"}]
    done = await engine.generate(messages=messages, max_new_tokens=5, temperature=0.0).result()
    text = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert done.usage.prompt_tokens == len(ids)
    same = await engine.generate(input_ids=ids, max_new_tokens=5, temperature=0.0).result()
    assert same.token_ids == done.token_ids
    assert same.usage.cached_tokens > 0


@pytest.mark.parametrize("where", ["launch", "result"])
async def test_a_failing_forward_ends_requests_with_an_error_and_serving_goes_on(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A fault while queuing a step (launch thread) or while fetching its results
    (completion thread) ends the step's requests with an error; the engine goes on."""
    engine = await make_engine()
    owner = DeviceState if where == "launch" else PendingStep
    real = getattr(owner, where)
    calls = 0

    def flaky(self, *args):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected device fault")
        return real(self, *args)

    monkeypatch.setattr(owner, where, flaky)
    streams = [
        engine.generate(input_ids=prompt_ids(10, i), max_new_tokens=30, ignore_eos=True)
        for i in range(3)
    ]
    done = await asyncio.gather(*(s.result() for s in streams))
    assert {d.finish_reason for d in done} == {"error"}
    # The client learns that the step failed, not how: the exception stays in the log.
    assert "forward failed" in done[0].message
    assert "injected device fault" not in done[0].message
    after = await engine.generate(input_ids=[5, 6, 7], max_new_tokens=4, ignore_eos=True).result()
    assert after.finish_reason == "length"


async def test_a_dead_actor_fails_every_open_request(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shoal.actors.scheduler.planner import Planner

    engine = await make_engine()

    def broken(self: Planner, done):  # type: ignore[no-untyped-def]
        raise RuntimeError("scheduler bug")

    streams = [
        engine.generate(input_ids=prompt_ids(10, i), max_new_tokens=50, ignore_eos=True)
        for i in range(3)
    ]
    monkeypatch.setattr(Planner, "process", broken)
    for stream in streams:
        with pytest.raises(EngineDeadError, match="scheduler"):
            await asyncio.wait_for(stream.result(), timeout=10)
    assert engine.dead_reason is not None
    with pytest.raises(EngineDeadError):
        engine.generate(input_ids=[5, 6])


async def test_logprobs_are_the_models_raw_log_probabilities(
    make_engine: EngineFactory, tiny_reference: Reference
) -> None:
    import torch

    engine = await make_engine()
    prompt = prompt_ids(9, 8)
    stream = engine.generate(
        input_ids=prompt, max_new_tokens=4, temperature=0.0, ignore_eos=True, top_logprobs=3
    )
    deltas = [d async for d in stream]
    done = await stream.result()
    assert done.logprobs is not None and len(done.logprobs) == 4
    assert tuple(lp for d in deltas for lp in d.logprobs or ()) == done.logprobs
    ids = torch.tensor([prompt + list(done.token_ids)])
    with torch.no_grad():
        logits = tiny_reference.model(ids).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for step, lp in enumerate(done.logprobs):
        assert lp.token_id == done.token_ids[step]
        assert abs(lp.logprob - float(expected[step, lp.token_id])) < 1e-4
        assert [t for t, _ in lp.top] == expected[step].topk(3).indices.tolist()
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely
    plain = await engine.generate(input_ids=prompt, max_new_tokens=2).result()
    assert plain.logprobs is None


async def test_messages_the_chat_template_rejects_are_a_request_error(
    make_engine: EngineFactory,
) -> None:
    """A template error is the caller's mistake: it must never take the tokenizer down."""
    from shoal import RequestError

    engine = await make_engine()
    with pytest.raises(RequestError, match="chat template") as caught:
        await engine.generate(messages=[{"role": "user"}], max_new_tokens=2).result()
    assert caught.value.field == "messages"
    session = await engine.open_session()
    with pytest.raises(RequestError, match="chat template"):
        await session.turn(messages=[{"role": "user"}], max_new_tokens=2).result()
    ok = session.turn(messages=[{"role": "user", "content": "hi"}], max_new_tokens=2)
    assert (await ok.result()).finish_reason in ("stop", "length")
    await session.close()
    with pytest.raises(RequestError, match="not open"):
        await engine.close_session(session.id)
    assert engine.dead_reason is None


async def test_penalties_see_every_earlier_token_under_overlap(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With two steps in flight, a row with penalties waits for its last token to reach the
    host before it samples again: the same tokens as with no overlap at all. Results are
    slowed down so that the next step is always launched before the last one's tokens are
    back (as on a GPU)."""
    real_result = PendingStep.result

    def slow_result(self: PendingStep):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        return real_result(self)

    monkeypatch.setattr(PendingStep, "result", slow_result)
    penalties = dict(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3)
    results = []
    for inflight in (1, 2):
        engine = await make_engine(max_inflight=inflight)
        streams = [
            engine.generate(
                input_ids=prompt_ids(6, i),
                max_new_tokens=24,
                ignore_eos=True,
                temperature=0.0,
                **penalties,
            )
            for i in range(4)
        ]
        done = await asyncio.gather(*(s.result() for s in streams))
        results.append([list(d.token_ids) for d in done])
    plain = await make_engine(max_inflight=2)
    unpenalized = await plain.generate(
        input_ids=prompt_ids(6, 0), max_new_tokens=24, ignore_eos=True, temperature=0.0
    ).result()
    assert results[0] == results[1]
    assert results[0][0] != list(unpenalized.token_ids)  # the penalties did something
