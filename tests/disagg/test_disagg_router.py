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
import contextlib
import ctypes
import importlib
import importlib.util
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
from disagg_helpers import free_port
from served import MODEL, Served, ServeFactory, chat, sse_events

from shoal.disagg.layout import KVLayout
from shoal.disagg.wire import RoomRequest, RoomResult, prompt_digest
from shoal.models.load import load_model


def missing_parts() -> str | None:
    """Why this module cannot run here, or None: the test extra's router, and Mooncake's
    engine, which also needs the system library libibverbs1 (.ci/run installs it)."""
    if importlib.util.find_spec("sglang_router") is None:
        return "needs the test extra's sglang-router"
    try:
        importlib.import_module("mooncake.engine")
    except ImportError as exc:
        return f"Mooncake's transfer engine does not load ({exc}): apt-get install libibverbs1"
    return None


pytestmark = pytest.mark.skipif(missing_parts() is not None, reason=str(missing_parts()))
NEW_TOKENS = 8
WAIT_S = 30.0


class PD:
    def __init__(self, prefill: Served, decode: Served, solo: Served, url: str) -> None:
        self.prefill, self.decode, self.solo, self.url = prefill, decode, solo, url

    async def idle(self) -> None:
        for served in (self.prefill, self.decode):
            await served.engine.wait_idle(WAIT_S)
            async with served.http.get(served.url + "/get_server_info") as response:
                queues = (await response.json())["disaggregation_queues"]
            assert set(queues.values()) == {0}, queues


class Router:
    """SGLang's router in PD mode, its own process, in front of one prefill and one decode."""

    def __init__(self, prefill_url: str, bootstrap_port: int, decode_url: str) -> None:
        port = free_port()
        argv = [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--pd-disaggregation",
            "--prefill", prefill_url, str(bootstrap_port),
            "--decode", decode_url, "--worker-startup-check-interval", "1",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--disable-circuit-breaker",
        ]  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def ready(self, http: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the router exited"
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(self.url + "/readiness") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.2)
        raise AssertionError("the router did not become ready in 60 s")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
async def routers() -> AsyncIterator[list[Router]]:
    started: list[Router] = []
    yield started
    for router in started:
        router.stop()


@pytest.fixture
async def pd(serve: ServeFactory, routers: list[Router]) -> AsyncIterator[Any]:
    async def start(
        prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None
    ) -> PD:
        common = {
            "disaggregation_transfer_backend": "mooncake",
            "disaggregation_bootstrap_port": 0,
            "disaggregation_timeout_s": 10.0,
        }
        first = await serve(disaggregation_mode="prefill", **{**common, **(prefill or {})})
        assert first.engine.bootstrap_port is not None
        peers = f"127.0.0.1:{first.engine.bootstrap_port}"  # the decode server's only peer
        decode = {"disaggregation_prefill_peers": peers, **(decode or {})}
        second = await serve(disaggregation_mode="decode", **{**common, **decode})
        solo = await serve()
        router = Router(first.url, first.engine.bootstrap_port, second.url)
        routers.append(router)
        await router.ready(first.http)
        return PD(first, second, solo, router.url)

    yield start


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


async def test_a_batch_through_the_router_equals_one_server(pd: Any) -> None:
    """A batch /generate of token ids: the router gives each prompt its own room (a list)."""
    pair = await pd()
    batch = [[5, 17, 42, 99, 7, 3], [11, 12, 13], list(range(40, 90))]
    body = {"input_ids": batch, "sampling_params": {"max_new_tokens": NEW_TOKENS}}
    body["sampling_params"] |= {"temperature": 0.0}
    answers = []
    for url in (pair.url, pair.solo.url):
        async with pair.solo.http.post(url + "/generate", json=body) as response:
            assert response.status == 200, await response.text()
            answers.append([a["output_ids"] for a in await response.json(content_type=None)])
    assert answers[0] == answers[1]
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
    pair.prefill.engine.testing.faults.arm("scheduler", "Admit")  # the first attempt fails: 500
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


async def test_other_weights_are_a_400_the_router_does_not_retry(
    pd: Any, other_folder: Any
) -> None:
    """The prefill server serves other weights: both servers answer 400 "weights_mismatch"
    and the router passes it on at once. It retries a 408, 429 or 5xx, and turns any status
    but 400, 404, 500, 502 and 503 (a 409 among them) into a 500, which it retries too and
    counts against both servers' circuit breakers: so a 400."""
    pair = await pd(prefill={"model": load_model(other_folder, progress=False)})
    body = chat(PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0.0)
    async with pair.solo.http.post(pair.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 400, await response.text()
        assert "other weights" in (await response.json())["error"]["message"]
    await pair.idle()
    for served in (pair.prefill, pair.decode):
        answers = served.server.metrics.registry.get_sample_value(
            "shoal_http_requests_total", {"route": "/v1/chat/completions", "status": "400"}
        )
        assert answers == 1, answers  # one attempt: no retry


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


async def test_a_transfer_timeout_ends_both_halves(pd: Any) -> None:
    """The prefill server never computes the prompt (its step gate is held): the decode
    server's wait times out, it cancels the room, and both halves end."""
    pair = await pd(decode={"disaggregation_timeout_s": 1.0})
    pair.prefill.engine.testing.hold()
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}}
    async with pair.solo.http.post(pair.url + "/generate", json=body) as response:
        assert response.status >= 500
    pair.prefill.engine.testing.release()
    await pair.idle()


@pytest.mark.parametrize("held", ["prefill", "decode"])
async def test_a_client_gone_before_the_transfer_ends_both_halves(pd: Any, held: str) -> None:
    """The client hangs up while the prompt waits to be computed (the prefill server's step
    gate held: its room is "prefilling"), or once it is computed but the decode server has
    not asked for it (the decode server's gate held: the prefill room is "bootstrap")."""
    pair = await pd()
    engine = pair.prefill.engine if held == "prefill" else pair.decode.engine
    state = "prefilling" if held == "prefill" else "bootstrap"
    engine.testing.hold()
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}}
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(http.post(pair.url + "/generate", json=body))
        await wait_for_rooms(pair.prefill, state, 1)
        task.cancel()
    await wait_for_rooms(pair.prefill, state, 0)
    engine.testing.release()
    await pair.idle()


async def wait_for_rooms(served: Served, state: str, count: int) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if (await served.engine.transfer_counts())[state] == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{state} never reached {count}")


# ---- a server killed (a real process, SIGKILL) ----------------------------------------------


class Process:
    """`python -m shoal serve` on the tiny model, in a process of its own."""

    def __init__(
        self, folder: Any, mode: str, port: int, bootstrap_port: int = 0, peers: str = ""
    ) -> None:
        argv = [
            sys.executable, "-m", "shoal", "serve", "--model", str(folder), "--port", str(port),
            "--served-model-name", MODEL, "--num-threads", "1", "--dtype", "float32",
            "--disaggregation-mode", mode, "--disaggregation-timeout-s", "10",
            "--disaggregation-bootstrap-port", str(bootstrap_port),
        ]  # fmt: skip
        if peers:
            argv += ["--disaggregation-prefill-peers", peers]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def ready(self, http: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the server exited"
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(self.url + "/health") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.2)
        raise AssertionError("the server did not start in 120 s")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


async def test_a_killed_decode_server_ends_the_prefill_half(
    serve: ServeFactory, tiny_folder: Any, routers: list[Router]
) -> None:
    """SIGKILL the decode server while the prefill server holds the request's prompt: the
    prefill server's write (or the dropped bootstrap connection) fails the room, its request
    ends, it is idle with nothing leaked, and a fresh decode server is served next. The
    router retries the request on the dead decode server 4 more times, each with a new room
    that no decode server ever claims: each ends at the prefill server's deadline (2 s)."""
    prefill = await serve(
        disaggregation_mode="prefill",
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=0,
        disaggregation_timeout_s=2.0,
    )
    port, processes = free_port(), []
    assert prefill.engine.bootstrap_port is not None
    peers = f"127.0.0.1:{prefill.engine.bootstrap_port}"
    try:
        decode = Process(tiny_folder, "decode", port, peers=peers)
        processes.append(decode)
        await decode.ready(prefill.http)
        router = Router(prefill.url, prefill.engine.bootstrap_port, decode.url)
        routers.append(router)
        await router.ready(prefill.http)
        url = router.url
        prefill.engine.testing.hold()
        body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}}
        sent = asyncio.create_task(prefill.http.post(url + "/generate", json=body))
        await wait_for_rooms(prefill, "prefilling", 1)
        decode.kill()
        prefill.engine.testing.release()
        await wait_for_rooms(prefill, "prefilling", 0)
        with contextlib.suppress(aiohttp.ClientError):
            (await sent).release()
        await prefill.engine.wait_idle(WAIT_S)
        assert set((await prefill.engine.transfer_counts()).values()) == {0}
        decode = Process(tiny_folder, "decode", port, peers=peers)  # the router's address
        processes.append(decode)
        await decode.ready(prefill.http)
        for _ in range(10):  # the router may take a moment to send to it again
            async with prefill.http.post(url + "/generate", json=body) as response:
                if response.status == 200:
                    break
            await asyncio.sleep(0.5)
        assert response.status == 200
        await prefill.engine.wait_idle(WAIT_S)
    finally:
        prefill.engine.testing.release()
        for process in processes:
            if process.proc.poll() is None:
                process.kill()


async def test_a_killed_prefill_server_ends_the_decode_half(
    serve: ServeFactory, tiny_folder: Any, routers: list[Router]
) -> None:
    """SIGSTOP the prefill server, send a request (the decode server registers and waits on
    it), then SIGKILL it: the decode server's wait is reset, the request ends, and it is idle
    with nothing leaked and its gauges at 0."""
    bootstrap_port = free_port()
    decode = await serve(
        disaggregation_mode="decode",
        disaggregation_transfer_backend="mooncake",
        disaggregation_timeout_s=10.0,
        disaggregation_prefill_peers=f"127.0.0.1:{bootstrap_port}",
    )
    prefill = Process(tiny_folder, "prefill", free_port(), bootstrap_port)
    try:
        await prefill.ready(decode.http)
        router = Router(prefill.url, bootstrap_port, decode.url)
        routers.append(router)
        await router.ready(decode.http)
        url = router.url
        prefill.proc.send_signal(signal.SIGSTOP)
        body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}}
        sent = asyncio.create_task(decode.http.post(url + "/generate", json=body))
        await wait_for_rooms(decode, "waiting", 1)
        prefill.kill()
        await wait_for_rooms(decode, "waiting", 0)
        sent.cancel()
        await decode.engine.wait_idle(WAIT_S)
        assert set((await decode.engine.transfer_counts()).values()) == {0}
    finally:
        if prefill.proc.poll() is None:
            prefill.kill()


async def test_a_write_mooncake_rejects_ends_the_prefill_half(pd: Any) -> None:
    """A decode server (this test, with a Mooncake engine of its own) names addresses outside
    the memory it registered: Mooncake rejects the prefill server's write, the room fails
    with the cause on both halves, and the prefill server is idle with its gauges at 0."""
    from mooncake.engine import TransferEngine

    pair = await pd()
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buffer = ctypes.create_string_buffer(1 << 16)
    assert engine.register_memory(ctypes.addressof(buffer), len(buffer)) == 0
    config = pair.prefill.engine.loaded.config
    options = pair.prefill.engine.options
    page_bytes = config.num_kv_heads * config.head_dim * 4 * options.page_size
    outside = ctypes.addressof(buffer) + (1 << 30)
    layout = KVLayout(
        config.num_layers, config.num_kv_heads, config.head_dim, options.page_size,
        "torch.float32", page_bytes, 4, (outside,) * config.num_layers,
        (outside,) * config.num_layers,
    )  # fmt: skip
    ids = [5, 17, 42, 99, 7, 3]
    room = 77
    endpoint = f"127.0.0.1:{engine.get_rpc_port()}"
    digest = pair.prefill.engine.weights_digest  # the same weights: the write is tried
    request = RoomRequest(endpoint, layout, (0,), 0, len(ids), prompt_digest(ids), digest)
    bootstrap = f"http://127.0.0.1:{pair.prefill.engine.bootstrap_port}/shoal/pd/rooms/{room}"
    body = {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 4},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": pair.prefill.engine.bootstrap_port,
        "bootstrap_room": room,
    }  # fmt: skip
    http = pair.prefill.http
    asked = http.post(bootstrap, data=msgspec.json.encode(request))
    sent = http.post(pair.prefill.url + "/generate", json=body)
    answer, response = await asyncio.gather(asked, sent)
    result = msgspec.json.decode(await answer.read(), type=RoomResult)
    assert not result.ok and "Mooncake" in result.error
    assert response.status == 500 and "Mooncake" in (await response.text())
    await pair.idle()
