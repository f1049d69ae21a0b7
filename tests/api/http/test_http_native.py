"""The native (SGLang-named) routes: /generate, health, info."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
from served import ServeFactory, chat, post, sse_events


async def test_generate_text_and_ids_match_the_engine(serve: ServeFactory) -> None:
    s = await serve(page_size=2)
    sampling = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    status, got = await post(s, "/generate", {"text": "The sea is", "sampling_params": sampling})
    direct = await s.engine.generate(
        "The sea is", max_new_tokens=10, temperature=0.0, ignore_eos=True
    ).result()
    assert status == 200
    assert got["text"] == direct.text and got["output_ids"] == list(direct.token_ids)
    meta = got["meta_info"]
    assert meta["id"] and meta["finish_reason"] == {"type": "length", "length": 10}
    assert meta["prompt_tokens"] == direct.usage.prompt_tokens
    assert meta["completion_tokens"] == 10 and meta["weight_version"] == "0"
    assert meta["cached_tokens"] >= 0 and meta["e2e_latency"] > 0
    assert "output_token_logprobs" not in meta
    ids = s.engine.tokenizer.encode("The sea is")
    status, by_ids = await post(s, "/generate", {"input_ids": ids, "sampling_params": sampling})
    assert by_ids["output_ids"] == got["output_ids"]
    assert by_ids["meta_info"]["cached_tokens"] > 0


async def test_generate_stop_reports_what_matched(serve: ServeFactory) -> None:
    s = await serve()
    base = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    _, full = await post(s, "/generate", {"text": "The quick", "sampling_params": base})
    token = full["output_ids"][2]
    _, cut = await post(
        s,
        "/generate",
        {"text": "The quick", "sampling_params": {**base, "stop_token_ids": [token]}},
    )
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    text = full["text"]
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip())
    _, by_text = await post(
        s, "/generate", {"text": "The quick", "sampling_params": {**base, "stop": stop}}
    )
    assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert by_text["text"] == text[: text.index(stop)]
    kept_params = {**base, "stop": stop, "no_stop_trim": True}  # as slime sends it
    _, kept = await post(s, "/generate", {"text": "The quick", "sampling_params": kept_params})
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert kept["text"] == text[: text.index(stop)] + stop
    assert kept["output_ids"] == by_text["output_ids"]


async def test_generate_batch_rids_seeds_and_logprobs(serve: ServeFactory) -> None:
    s = await serve()
    body = {
        "text": ["The sea is", "Once upon"],
        "rid": ["a", "b"],
        "sampling_params": [
            {"max_new_tokens": 5, "temperature": 0.9, "sampling_seed": 3},
            {"max_new_tokens": 7, "temperature": 0},
        ],
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    status, got = await post(s, "/generate", body)
    assert status == 200 and [g["meta_info"]["id"] for g in got] == ["a", "b"]
    assert [g["meta_info"]["completion_tokens"] for g in got] == [5, 7] or (
        got[1]["meta_info"]["finish_reason"]["type"] == "stop"
    )
    seeded = await s.engine.generate(
        "The sea is", max_new_tokens=5, temperature=0.9, seed=3
    ).result()
    assert got[0]["output_ids"] == list(seeded.token_ids)
    for answer in got:
        meta = answer["meta_info"]
        logprobs, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
        assert len(logprobs) == len(tops) == len(answer["output_ids"])
        assert [t for _, t, _ in logprobs] == answer["output_ids"]
        assert all(len(top) == 2 and top[0][0] >= top[1][0] for top in tops)
    greedy = got[1]["meta_info"]
    for (chosen, _, _), top in zip(
        greedy["output_token_logprobs"], greedy["output_top_logprobs"], strict=True
    ):
        assert math.isclose(chosen, top[0][0], abs_tol=1e-5)


async def test_generate_stream_is_cumulative_and_ends_with_done(serve: ServeFactory) -> None:
    s = await serve()
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    body = {"text": "The sea is", "sampling_params": sampling, "stream": True, "rid": "s1"}
    async with s.http.post(s.url + "/generate", json=body) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(resp)
    _, whole = await post(s, "/generate", {"text": "The sea is", "sampling_params": sampling})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["meta_info"]["id"] == "s1" for c in chunks)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[0] >= 1  # cumulative


async def test_a_rid_in_use_is_refused(serve: ServeFactory) -> None:
    s = await serve()
    long = {
        "text": "hi",
        "rid": "dup",
        "sampling_params": {"max_new_tokens": 600, "ignore_eos": True},
    }
    first = asyncio.create_task(post(s, "/generate", long))
    while "dup" not in s.server.gateway.jobs:
        await asyncio.sleep(0.005)
    status, got = await post(s, "/generate", {"text": "hi", "rid": "dup"})
    assert status == 400 and got["error"]["param"] == "rid"
    await post(s, "/abort_request", {"rid": "dup"})
    status, _ = await first
    assert status == 200


async def test_health_and_info_routes(serve: ServeFactory) -> None:
    s = await serve(context_length=300)
    async with s.http.get(s.url + "/health") as resp:
        assert resp.status == 200
    async with s.http.get(s.url + "/health_generate") as resp:
        assert resp.status == 200 and (await resp.json())["checked"] == "generation"
    async with s.http.get(s.url + "/get_model_info") as resp:
        info = await resp.json()
    assert info["model_path"] == str(s.engine.loaded.path)  # type: ignore[union-attr]
    assert info["weight_version"] == "0" and info["context_length"] == 300
    assert (info["family"], info["model_type"], info["sliding_window"]) == ("llama", "llama", None)
    async with s.http.get(s.url + "/get_server_info") as resp:
        server = await resp.json()
    stats = await s.engine.cache_stats()
    assert server["engine_options"]["context_length"] == 300
    assert server["resolved"]["context_length"] == 300
    assert server["total_pages"] == stats.total_pages
    assert server["running"] == 0 and server["waiting"] == 0
    assert server["server"]["api_key"] is None and server["server"]["max_n"] >= 1


async def test_health_generate_answers_at_once_under_load(serve: ServeFactory) -> None:
    s = await serve(max_running_requests=4)
    load = [
        asyncio.create_task(
            post(s, "/v1/chat/completions", chat("hi", max_tokens=150, ignore_eos=True))
        )
        for _ in range(12)  # more than the engine runs at once: some wait
    ]
    while s.server.metrics.last_token_at == 0.0:
        await asyncio.sleep(0.005)
    async with s.http.get(s.url + "/health_generate") as resp:
        assert resp.status == 200 and (await resp.json())["checked"] == "recent tokens"
    await post(s, "/abort_request", {"abort_all": True})
    assert all(status == 200 for status, _ in await asyncio.gather(*load))


async def test_health_generate_says_paused_at_once(serve: ServeFactory) -> None:
    """Paused, no generation can prove health: the answer comes at once, 200 "paused" (a
    liveness probe must not restart a server paused on purpose), not a 503 after the wait."""
    s = await serve(health_timeout_s=20.0)
    await post(s, "/pause_generation", {})
    async with asyncio.timeout(5):  # well inside health_timeout_s
        async with s.http.get(s.url + "/health_generate") as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "paused"
    await post(s, "/continue_generation", {})
    async with s.http.get(s.url + "/health_generate") as resp:
        assert resp.status == 200 and (await resp.json())["checked"] == "generation"


async def test_a_bad_checkpoint_path_logs_one_line(
    serve: ServeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The client hears why; the log says it in one warning line, with no traceback."""
    s = await serve()
    with caplog.at_level(logging.WARNING):
        status, refused = await post(s, "/update_weights_from_disk", {"model_path": "/nope/x"})
    assert status == 400 and "does not exist" in refused["message"], refused
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.levelno for r in logged] == [logging.WARNING], logged
    assert logged[0].exc_info is None and "\n" not in logged[0].getMessage()


async def test_lifecycle_routes_are_served_and_weight_version_shows(
    serve: ServeFactory, tiny_folder: Path
) -> None:
    s = await serve()
    status, flushed = await post(s, "/flush_cache", {})
    assert status == 200 and flushed["success"] is True
    async with s.http.get(s.url + "/flush_cache") as resp:  # verl and slime send GET
        assert resp.status == 200 and (await resp.json())["success"] is True
    body = {"model_path": str(tiny_folder), "weight_version": 7}  # a number: its digits
    status, updated = await post(s, "/update_weights_from_disk", body)
    assert status == 200 and updated["success"] is True and updated["weight_version"] == "7"
    _, got = await post(s, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert got["meta_info"]["weight_version"] == "7"
    async with s.http.get(s.url + "/get_model_info") as resp:
        assert (await resp.json())["weight_version"] == "7"
    status, refused = await post(s, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert status == 400 and refused["success"] is False and refused["error"]["param"]
    # as slime sends it: the version a string, SGLang's load_format and flush_cache
    body = {"model_path": str(tiny_folder), "weight_version": "8", "load_format": "auto"}
    status, updated = await post(s, "/update_weights_from_disk", {**body, "flush_cache": True})
    assert status == 200 and updated["weight_version"] == "8"
    status, updated = await post(s, "/update_weights_from_disk", {"model_path": str(tiny_folder)})
    assert status == 200 and updated["weight_version"] == "9"  # a number's next
    for version in ("rl-step-10", 2**63):
        status, updated = await post(
            s, "/update_weights_from_disk", {**body, "weight_version": version}
        )
        assert status == 200 and updated["weight_version"] == str(version), updated
    status, updated = await post(s, "/update_weights_from_disk", {"model_path": str(tiny_folder)})
    assert status == 200 and updated["weight_version"] == str(2**63 + 1)
    # flush_cache false is taken, and the answer says the cache went all the same
    status, updated = await post(s, "/update_weights_from_disk", {**body, "flush_cache": False})
    assert status == 200 and "flushed all the same" in updated["message"], updated
    for wrong, param in (
        ({"weight_version": "9" * 257}, "weight_version"),
        ({"weight_version": ""}, "weight_version"),
        ({"load_format": "pt"}, "load_format"),
        ({"is_async": True}, "is_async"),
    ):
        status, refused = await post(s, "/update_weights_from_disk", {**body, **wrong})
        assert status == 400 and refused["error"]["param"] == param, refused
    async with s.http.get(s.url + "/get_model_info") as resp:
        assert (await resp.json())["weight_version"] == "8"  # the refusals changed nothing


async def test_pause_generation_aborts_by_default_with_the_partial_output(
    serve: ServeFactory,
) -> None:
    """`POST /pause_generation {}` is SGLang's "abort": a /generate in flight returns at once,
    200 with what it generated and finish reason abort; a request sent while paused waits
    for /continue_generation. A mode SGLang does not know is a 400 naming it."""
    s = await serve()
    sampling = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    body = {"text": "The sea is", "sampling_params": sampling, "stream": True}
    async with s.http.post(s.url + "/generate", json=body) as resp:
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        status, paused = await post(s, "/pause_generation", {})
        assert status == 200 and paused["success"] is True and "abort" in paused["message"]
        events = [first.decode().removeprefix("data: ").strip(), *await sse_events(resp)]
    last = json.loads(events[-2]) if isinstance(events[-2], str) else events[-2]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < last["meta_info"]["completion_tokens"] == len(last["output_ids"]) < 400
    waiting = asyncio.create_task(
        post(s, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    )
    await asyncio.sleep(0.2)
    assert not waiting.done()
    status, refused = await post(s, "/pause_generation", {"mode": "later"})
    assert status == 400 and refused["error"]["param"] == "mode"
    for mode in ("in_place", "retract"):
        assert (await post(s, "/pause_generation", {"mode": mode}))[0] == 200
    assert (await post(s, "/continue_generation", {}))[0] == 200
    status, answered = await asyncio.wait_for(waiting, 10)
    assert status == 200 and answered["meta_info"]["finish_reason"]["type"] == "length"


async def test_loads_count_running_and_waiting_as_slime_reads_them(serve: ServeFactory) -> None:
    """slime's end of a rollout: `abort_request {"abort_all": true}`, then `GET /v1/loads?
    include=core` until running + waiting is 0 (SGLang's core fields)."""
    s = await serve(max_running_requests=2)
    sampling = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}
    load = [
        asyncio.create_task(post(s, "/generate", {"text": f"t{i}", "sampling_params": sampling}))
        for i in range(4)
    ]

    async def loads(query: str = "?include=core") -> tuple[int, Any]:
        async with s.http.get(s.url + "/v1/loads" + query) as resp:
            return resp.status, await resp.json()

    for _ in range(200):
        status, got = await loads()
        core = got["loads"][0]
        if core["num_running_reqs"] == 2 and core["num_waiting_reqs"] == 2:
            break
        await asyncio.sleep(0.01)
    assert status == 200 and got["version"] and got["timestamp"]
    assert core["dp_rank"] == 0 and core["max_running_requests"] == 2
    assert (core["num_running_reqs"], core["num_waiting_reqs"]) == (2, 2)
    assert 0 < core["num_used_tokens"] <= core["num_total_tokens"]
    assert core["token_usage"] == round(core["num_used_tokens"] / core["num_total_tokens"], 4)
    assert (await post(s, "/abort_request", {"abort_all": True}))[0] == 200
    for _ in range(200):
        core = (await loads())[1]["loads"][0]
        if core["num_running_reqs"] + core["num_waiting_reqs"] == 0:
            break
        await asyncio.sleep(0.01)
    assert core["num_running_reqs"] + core["num_waiting_reqs"] == 0
    assert all(status == 200 for status, _ in await asyncio.gather(*load))
    assert (await loads("?dp_rank=1"))[1]["loads"] == []
    for query, param in (("?include=cores", "include"), ("?format=prometheus", "format")):
        status, refused = await loads(query)
        assert status == 400 and refused["error"]["param"] == param
