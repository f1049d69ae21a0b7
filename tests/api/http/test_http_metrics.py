"""/metrics parses as Prometheus text and its counters match the traffic sent."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families
from served import MODEL, Served, ServeFactory, chat


async def scrape(s: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with s.http.get(s.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_counters_match_the_traffic(serve: ServeFactory) -> None:
    s = await serve(page_size=4)
    empty = await scrape(s)
    assert value(empty, "shoal_requests_total", finish_reason="length") == 0
    assert value(empty, "shoal_kv_cache_usage_ratio") == 0

    prompt_tokens = completion_tokens = cached_tokens = 0
    replies = []
    for i in range(4):  # 4 non-streamed chats, the last three hit the prefix cache
        replies.append(
            await s.client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me about the sea and the fish"}],
                max_tokens=5 + i,
                extra_body={"ignore_eos": True},
            )
        )
    stream = await s.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            replies.append(chunk)  # type: ignore[arg-type]
    three = await s.client.completions.create(
        model=MODEL, prompt="The sea", max_tokens=4, n=3, extra_body={"ignore_eos": True}
    )
    for reply in [*replies, three]:
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        completion_tokens += reply.usage.completion_tokens
        cached_tokens += reply.usage.prompt_tokens_details.cached_tokens
        prompt_tokens += reply.usage.prompt_tokens
    prompt_tokens += 2 * three.usage.prompt_tokens  # type: ignore[union-attr]  # n=3: 3 requests
    greedy = await s.engine.generate(  # straight to the engine: not in the server's metrics
        "The sea", max_new_tokens=20, temperature=0.0, ignore_eos=True
    ).result()
    stop = await s.client.completions.create(
        model=MODEL,
        prompt="The sea",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [greedy.token_ids[3]]},
    )
    async with s.http.post(s.url + "/v1/chat/completions", json=chat("hi", temperature=9)) as r:
        assert r.status == 400
    await s.engine.wait_idle()

    m = await scrape(s)
    assert stop.choices[0].finish_reason == "stop"
    lengths, stops = 4 + 1 + 3, 1
    assert value(m, "shoal_requests_total", finish_reason="length") == lengths
    assert value(m, "shoal_requests_total", finish_reason="stop") == stops
    assert value(m, "shoal_requests_total", finish_reason="abort") == 0
    assert value(m, "shoal_requests_total", finish_reason="error") == 0
    assert stop.usage is not None
    all_completion = completion_tokens + stop.usage.completion_tokens
    assert value(m, "shoal_generation_tokens_total") == all_completion
    assert value(m, "shoal_prompt_tokens_total") == prompt_tokens + stop.usage.prompt_tokens
    assert value(m, "shoal_cached_prompt_tokens_total") >= cached_tokens > 0
    num_requests = lengths + stops
    for histogram in ("ttft", "e2e"):
        name = {
            "ttft": "shoal_time_to_first_token_seconds",
            "e2e": "shoal_e2e_request_latency_seconds",
        }[histogram]
        assert value(m, name + "_count") == num_requests
        assert value(m, name + "_sum") > 0
        assert value(m, name + "_bucket", le="+Inf") == num_requests
    assert 0 < value(m, "shoal_inter_token_latency_seconds_count") <= all_completion - num_requests
    hit = value(m, "shoal_cached_prompt_tokens_total") / value(m, "shoal_prompt_tokens_total")
    assert abs(value(m, "shoal_prefix_cache_hit_rate") - hit) < 1e-9
    assert value(m, "shoal_num_running_requests") == 0
    assert value(m, "shoal_num_waiting_requests") == 0
    assert value(m, "shoal_kv_cache_usage_ratio") == 0  # idle: nothing held by a request
    assert value(m, "shoal_kv_cache_evictable_pages") > 0  # but the prefix cache keeps pages
    stats = await s.engine.cache_stats()
    assert value(m, "shoal_kv_cache_total_pages") == stats.total_pages
    route = "/v1/chat/completions"
    assert value(m, "shoal_http_requests_total", route=route, status="200") == 5
    assert value(m, "shoal_http_requests_total", route=route, status="400") == 1
    assert value(m, "shoal_http_requests_total", route="/v1/completions", status="200") == 2


async def test_running_and_waiting_gauges_are_live(serve: ServeFactory) -> None:
    s = await serve(max_running_requests=2)
    body = chat("hi", max_tokens=300, ignore_eos=True)
    load = [
        asyncio.create_task(s.http.post(s.url + "/v1/chat/completions", json=body))
        for _ in range(5)
    ]
    while s.server.gateway.num_open < 5 or s.server.metrics.last_token_at == 0.0:
        await asyncio.sleep(0.005)
    m = await scrape(s)
    assert value(m, "shoal_num_running_requests") == 2
    assert value(m, "shoal_num_waiting_requests") == 3
    assert 0 < value(m, "shoal_kv_cache_usage_ratio") < 1
    async with s.http.post(s.url + "/abort_request", json={"abort_all": True}) as resp:
        assert (await resp.json())["aborted"] == 5
    for task in load:
        (await task).close()
    await s.engine.wait_idle()
    m = await scrape(s)
    assert value(m, "shoal_requests_total", finish_reason="abort") == 5
