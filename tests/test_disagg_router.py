"""Prefill/decode disaggregation end to end on 127.0.0.1: a prefill and a decode shoal server
(HTTP, in this process), SGLang's router (`sglang-router`, its own process) in PD mode in
front of them, and KV moved by Mooncake's transfer engine over TCP (docs/disaggregation.md).

Greedy output through the router equals one plain server's, on /generate, /v1/completions
and /v1/chat/completions, streaming and not, 32 requests at once. A prefill server that
answers 400 or 500, a client that goes away mid-stream and an abort_all on either server end
the request on both servers; every test ends with both idle, nothing leaked (make_engine
checks) and the rooms' gauges at 0.
"""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from test_http_support import MODEL, Served, ServeFactory, chat, serve, sse_events

__all__ = ["serve"]  # the fixture, used by name

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None
    or importlib.util.find_spec("mooncake") is None,
    reason="needs the test extra's sglang-router and mooncake-transfer-engine-non-cuda",
)
NEW_TOKENS = 8
WAIT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PD:
    def __init__(self, prefill: Served, decode: Served, solo: Served, url: str) -> None:
        self.prefill, self.decode, self.solo, self.url = prefill, decode, solo, url

    async def idle(self) -> None:
        for served in (self.prefill, self.decode):
            await served.engine.wait_idle(WAIT_S)
            async with served.http.get(served.url + "/get_server_info") as response:
                queues = (await response.json())["disaggregation_queues"]
            assert set(queues.values()) == {0}, queues


async def router_ready(http: aiohttp.ClientSession, url: str, router: Any) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert router.poll() is None, "the router exited"
        try:
            async with http.get(url + "/readiness") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError("the router did not become ready in 60 s")


@pytest.fixture
async def pd(serve: ServeFactory) -> AsyncIterator[Any]:
    async def start(prefill: dict[str, Any] | None = None) -> PD:
        common = {
            "disaggregation_transfer_backend": "mooncake",
            "disaggregation_bootstrap_port": 0,
            "disaggregation_timeout_s": 10.0,
        }
        first = await serve(disaggregation_mode="prefill", **{**common, **(prefill or {})})
        second = await serve(disaggregation_mode="decode", **common)
        solo = await serve()
        port = free_port()
        argv = [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--pd-disaggregation",
            "--prefill", first.url, str(first.engine.bootstrap_port),
            "--decode", second.url, "--worker-startup-check-interval", "1",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--disable-circuit-breaker",
        ]  # fmt: skip
        router = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        routers.append(router)
        url = f"http://127.0.0.1:{port}"
        await router_ready(first.http, url, router)
        return PD(first, second, solo, url)

    routers: list[subprocess.Popen[bytes]] = []
    yield start
    for router in routers:
        router.terminate()
        router.wait(10)


def requests_of_every_route(prompts: list[str]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for i, text in enumerate(prompts):
        stream = i % 2 == 1
        route = i % 3
        if route == 0:
            sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}
            out.append(("/generate", {"text": text, "sampling_params": sampling, "stream": stream}))
        elif route == 1:
            body = {"model": MODEL, "prompt": text, "max_tokens": NEW_TOKENS, "temperature": 0.0}
            out.append(("/v1/completions", {**body, "stream": stream}))
        else:
            body = chat(text, max_tokens=NEW_TOKENS, temperature=0.0, stream=stream)
            out.append(("/v1/chat/completions", body))
    return out


async def text_of(http: aiohttp.ClientSession, url: str, route: str, body: dict[str, Any]) -> str:
    """The generated text, from an SSE stream or one JSON answer."""
    async with http.post(url + route, json=body) as response:
        assert response.status == 200, await response.text()
        if not body.get("stream"):
            answer = await response.json()
            if route == "/generate":
                return str(answer["text"])
            choice = answer["choices"][0]
            return str(
                choice["text"] if route == "/v1/completions" else choice["message"]["content"]
            )
        events = [e for e in await sse_events(response) if e != "[DONE]"]
    if route == "/generate":
        return str(events[-1]["text"])
    if route == "/v1/completions":
        return "".join(e["choices"][0]["text"] for e in events if e["choices"])
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


PROMPTS = [f"Tell me about the number {i} and what comes after it." for i in range(32)]


async def test_greedy_through_the_router_equals_one_server(pd: Any) -> None:
    pair = await pd()
    http = pair.solo.http
    work = requests_of_every_route(PROMPTS)
    routed = await asyncio.gather(*(text_of(http, pair.url, r, b) for r, b in work))
    alone = await asyncio.gather(*(text_of(http, pair.solo.url, r, b) for r, b in work))
    assert routed == alone
    await pair.idle()


async def test_a_prefill_400_ends_the_decode_half(pd: Any) -> None:
    """The prefill server's context is shorter: it refuses the prompt (400), the router
    answers 400, and the decode server, which had accepted it, ends it at once."""
    pair = await pd(prefill={"context_length": 24})
    body = {"text": " ".join(["word"] * 40), "sampling_params": {"max_new_tokens": 4}}
    started = time.monotonic()
    async with pair.solo.http.post(pair.url + "/generate", json=body) as response:
        assert response.status == 400
    await pair.idle()
    assert time.monotonic() - started < 10.0  # the decode half did not wait out its timeout
    route, body = requests_of_every_route(["Hi"])[0]
    assert await text_of(pair.solo.http, pair.url, route, body)
    await pair.idle()


async def test_a_prefill_500_is_retried_and_the_failed_attempt_ends_on_both(pd: Any) -> None:
    pair = await pd()
    pair.prefill.engine.faults.arm("scheduler", "Admit")  # the first attempt fails: 500
    route, body = requests_of_every_route(PROMPTS[:1])[0]
    routed = await text_of(pair.solo.http, pair.url, route, body)  # the router's retry
    assert routed == await text_of(pair.solo.http, pair.solo.url, route, body)
    await pair.idle()


async def test_a_client_gone_mid_stream_ends_both_halves(pd: Any) -> None:
    pair = await pd()
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 200}, "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(pair.url + "/generate", json=body) as response,
    ):
        assert response.status == 200
        await response.content.readline()  # the first event: then hang up
    await pair.idle()


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_abort_all_on_either_server(pd: Any, side: str) -> None:
    pair = await pd()
    served = pair.prefill if side == "prefill" else pair.decode
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}

    async def one() -> int:
        async with pair.solo.http.post(pair.url + "/generate", json=body) as response:
            await response.read()
            return response.status

    running = [asyncio.create_task(one()) for _ in range(6)]
    await asyncio.sleep(0.3)
    async with served.http.post(served.url + "/abort_request", json={"abort_all": True}) as r:
        assert r.status == 200
    await asyncio.wait_for(asyncio.gather(*running), WAIT_S)
    await pair.idle()
