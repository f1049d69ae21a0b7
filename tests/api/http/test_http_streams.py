"""Streams and the clients that read them: a client that stops reading is cut after the write
timeout and its requests aborted, the 429 cap counts engine work rather than stuck sockets,
SSE keep-alive comments flow while a request waits (and readers, the openai package among
them, ignore them), and /generate's incremental streaming sends each token once.

A client that "never reads" is a raw socket with a tiny receive buffer that sends its request
and never calls recv: the server's socket buffer (about 2 MB on loopback) then aiohttp's fill,
and its writes block. /generate's default (cumulative) stream with 20 top logprobs fills them
in about a hundred tokens, since every event repeats everything so far.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from served import MODEL, Served, ServeFactory, chat, sse_events

from shoal.api.http.ws_sessions import SessionSockets

# A stream that fills the connection's buffers fast: cumulative events with 20 top logprobs
# each (~600 bytes a token, so event n is ~600 n bytes: 100 tokens send ~3 MB).
HEAVY = {"return_logprob": True, "top_logprobs_num": 20, "stream": True}


def heavy(text: str, max_new_tokens: int) -> dict[str, Any]:
    sampling = {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0}
    return {"text": text, "sampling_params": sampling, **HEAVY}


class Stuck:
    """A client that sends one request and never reads a byte of the answer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    async def connect(cls, s: Served, clients: list[Stuck]) -> Stuck:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: the window
        sock.setblocking(False)
        clients.append(cls(sock))
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", s.server.port))
        return clients[-1]

    @classmethod
    async def post(cls, s: Served, clients: list[Stuck], path: str, body: dict[str, Any]) -> Stuck:
        stuck = await cls.connect(s, clients)
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{s.server.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        await stuck.send(head.encode() + payload)
        return stuck

    async def send(self, data: bytes) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def wait_closed(self, timeout_s: float) -> int:
        """Read until the server ends the connection; the bytes it had sent. (Reading makes
        this client a reader: call it once the server has cut it.)"""
        loop = asyncio.get_running_loop()
        total = 0
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    data = await loop.sock_recv(self.sock, 1 << 20)
                except ConnectionResetError:
                    return total
                if not data:
                    return total
                total += len(data)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def stuck() -> Iterator[list[Stuck]]:
    """Stuck clients to close after the test, before its servers stop (which would wait on
    them if a test failed before the server cut them)."""
    clients: list[Stuck] = []
    yield clients
    for client in clients:
        client.close()


async def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def wait_cuts(s: Served, count: int, timeout_s: float) -> None:
    """Until the server has cut `count` streams (the clients not having read meanwhile)."""
    cuts = s.server.metrics.stream_cuts
    await wait_for(lambda: counter(cuts) >= count, timeout_s, f"{count} streams to be cut")


async def settle(s: Served, timeout_s: float = 30.0) -> None:
    """No HTTP job open, the engine idle, the abandoned requests' ends recorded."""
    await wait_for(lambda: not s.server.gateway.jobs, timeout_s, "the jobs to close")
    await s.engine.wait_idle(timeout_s=timeout_s)
    await wait_for(lambda: not s.server.gateway.late, timeout_s, "abandoned requests' ends")


def counter(metric: Any) -> float:
    value: float = metric._value.get()
    return value


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def cuts_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "read nothing" in r.getMessage()]


async def wait_progress_or_cut(s: Served, rid: str, positions: int) -> None:
    """Until the engine has launched `positions` positions of request `rid` (enough to fill the
    stream's buffers) or the server has cut a stream: a write that waits is cut after the write
    timeout, which on a slow machine may come before the engine gets that far."""
    cuts = s.server.metrics.stream_cuts
    deadline = time.monotonic() + 30.0
    while (await s.engine.snapshot()).progress.get(rid, 0) < positions and counter(cuts) < 1:
        assert time.monotonic() < deadline, (
            f"{rid} neither reached {positions} positions nor was cut"
        )
        await asyncio.sleep(0.01)


# ---- the cap and the write timeout -----------------------------------------------------------


async def test_8_never_reading_streams_leave_every_other_client_served(
    serve: ServeFactory, stuck: list[Stuck], caplog: pytest.LogCaptureFixture
) -> None:
    write_timeout_s = 8.0
    s = await serve(
        max_running_requests=8, max_queued_requests=0, stream_write_timeout_s=write_timeout_s
    )
    caplog.set_level(logging.WARNING)
    gateway = s.server.gateway
    began = time.monotonic()
    for i in range(8):
        await Stuck.post(s, stuck, "/generate", heavy(f"story {i}", 120))
    await wait_for(lambda: len(gateway.jobs) == 8, 30, "the 8 stuck requests to open")
    await s.engine.wait_idle(timeout_s=30)  # their generations are done ...
    assert len(gateway.jobs) == 8  # ... but their handlers still wait on the clients
    assert gateway.num_open == 0  # they hold no engine work, so they hold no place in the cap

    async def other(i: int) -> int:
        if i % 2:
            body = {"text": f"hello {i}", "sampling_params": {"max_new_tokens": 4}}
            async with s.http.post(s.url + "/generate", json=body) as resp:
                return resp.status
        body = chat(f"hi {i}", max_tokens=4, stream=True)
        async with s.http.post(s.url + "/v1/chat/completions", json=body) as resp:
            if resp.status == 200:
                assert (await sse_events(resp))[-1] == "[DONE]"
            return resp.status

    statuses = await asyncio.gather(*(other(i) for i in range(8)))  # the cap's worth at once
    assert statuses == [200] * 8
    assert time.monotonic() - began < write_timeout_s  # served before any stuck one was cut
    assert len(gateway.jobs) == 8, "the stuck streams were still open while others were served"

    # After the write timeout the server cuts them, and lets go of everything they held.
    await wait_cuts(s, 8, timeout_s=write_timeout_s + 30)
    for c in stuck:
        await c.wait_closed(timeout_s=10)
    await settle(s)
    assert gateway.num_open == 0
    assert counter(s.server.metrics.stream_cuts) == 8
    assert len(cuts_logged(caplog)) == 8
    assert errors_logged(caplog) == []


async def test_a_cut_stream_has_its_engine_request_aborted(
    serve: ServeFactory, stuck: list[Stuck], caplog: pytest.LogCaptureFixture
) -> None:
    s = await serve(stream_write_timeout_s=1.0)
    caplog.set_level(logging.WARNING)
    client = await Stuck.post(s, stuck, "/generate", {**heavy("a long story", 900), "rid": "slow"})
    await wait_progress_or_cut(s, "slow", 300)  # ~30 MB of cumulative events: the writes block
    s.engine.pause_generation()  # it stays unfinished: only the cut can end it
    try:
        await wait_cuts(s, 1, timeout_s=10)  # reading first would make it a reader
        await client.wait_closed(timeout_s=10)
        await wait_for(lambda: not s.server.gateway.jobs, 30, "the cut stream's job to close")
        assert s.server.gateway.num_open == 0
    finally:
        s.engine.continue_generation()
    await settle(s)
    metrics = s.server.metrics
    assert counter(metrics.requests.labels("abort")) == 1
    assert counter(metrics.generation_tokens) < 900
    assert counter(metrics.stream_cuts) == 1
    assert len(cuts_logged(caplog)) == 1 and errors_logged(caplog) == []


async def test_a_finished_request_still_being_written_leaves_the_cap(
    serve: ServeFactory, stuck: list[Stuck]
) -> None:
    s = await serve(max_running_requests=1, max_queued_requests=0)  # room for one request
    gateway = s.server.gateway
    client = await Stuck.post(s, stuck, "/generate", heavy("story", 120))
    await wait_for(lambda: len(gateway.jobs) == 1, 30, "the stuck request to open")
    await s.engine.wait_idle(timeout_s=30)
    assert len(gateway.jobs) == 1 and gateway.num_open == 0  # written to, not generating
    async with s.http.post(s.url + "/generate", json={"text": "hi"}) as resp:
        assert resp.status == 200
    # Engine work still counts: a live request fills the one place.
    s.engine.pause_generation()
    try:
        body = heavy("held", 50)
        async with s.http.post(s.url + "/generate", json=body) as held:
            assert held.status == 200
            await wait_for(lambda: gateway.num_open == 1, 30, "the held request to count")
            async with s.http.post(s.url + "/generate", json={"text": "hi"}) as resp:
                assert resp.status == 429
            held.close()
    finally:
        s.engine.continue_generation()
    client.close()  # the client goes: its handler's write fails and its job closes
    await settle(s)


async def test_a_never_reading_websocket_is_cut_and_its_turn_aborted(
    serve: ServeFactory,
    stuck: list[Stuck],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A turn's deltas are small (no event repeats another), so shrink the server's buffers
    # for this connection: a few hundred KB then fill them, as megabytes would on a real one.
    connect = SessionSockets.connect

    async def small_buffers(self: SessionSockets, request: Any) -> Any:
        transport = request.transport
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        transport.set_write_buffer_limits(high=4096)
        return await connect(self, request)

    monkeypatch.setattr(SessionSockets, "connect", small_buffers)
    s = await serve(stream_write_timeout_s=1.0)
    caplog.set_level(logging.WARNING)
    client = await Stuck.connect(s, stuck)
    await client.send(
        f"GET /v1/sessions/ws HTTP/1.1\r\nHost: 127.0.0.1:{s.server.port}\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode()
    )
    await client.send(ws_frame({"type": "open"}))
    turn = {"type": "turn", "text": "a long story", "max_new_tokens": 900, "ignore_eos": True}
    await client.send(ws_frame({**turn, "logprobs": True, "top_logprobs": 20}))
    gateway = s.server.gateway
    await wait_for(lambda: len(gateway.jobs) == 1, 30, "the turn to start")
    (rid,) = gateway.jobs
    await wait_progress_or_cut(s, rid, 700)  # aiohttp waits on the buffers past 256 KiB sent
    s.engine.pause_generation()  # it stays unfinished: only the cut can end it
    try:
        await wait_cuts(s, 1, timeout_s=10)
        await client.wait_closed(timeout_s=10)
        await wait_for(lambda: not s.server.sockets.open, 30, "the websocket to end")
        assert not gateway.jobs and gateway.num_open == 0
    finally:
        s.engine.continue_generation()
    await settle(s)
    metrics = s.server.metrics
    assert counter(metrics.requests.labels("abort")) == 1
    assert counter(metrics.stream_cuts) == 1
    assert len(cuts_logged(caplog)) == 1 and errors_logged(caplog) == []


def ws_frame(message: dict[str, Any]) -> bytes:
    """One masked text frame, as a client must send it (RFC 6455, 5.2)."""
    payload = json.dumps(message).encode()
    mask = b"\x01\x02\x03\x04"
    if len(payload) < 126:
        head = bytes([0x81, 0x80 | len(payload)])
    else:
        head = bytes([0x81, 0x80 | 126]) + len(payload).to_bytes(2, "big")
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return head + mask + masked


# ---- keep-alive comments ---------------------------------------------------------------------


async def test_keep_alive_comments_flow_while_a_request_waits(serve: ServeFactory) -> None:
    s = await serve(sse_keepalive_s=0.05)
    s.engine.pause_generation()  # the request waits: no event to send
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 5}, "stream": True}
    try:
        async with s.http.post(s.url + "/generate", json=body) as resp:
            assert resp.status == 200  # the first keep-alive brings the headers too
            async with asyncio.timeout(30):
                lines = [await resp.content.readline() for _ in range(4)]
            assert lines == [b": keep-alive\n", b"\n"] * 2
            s.engine.continue_generation()
            events = await sse_events(resp)
    finally:
        s.engine.continue_generation()
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"


async def test_the_openai_client_reads_streams_with_keep_alives(serve: ServeFactory) -> None:
    s = await serve(sse_keepalive_s=0.02)
    alone = await s.engine.generate(
        "Once", max_new_tokens=12, ignore_eos=True, temperature=0
    ).result()
    s.engine.pause_generation()
    try:

        async def completion() -> str:
            stream = await s.client.completions.create(
                model=MODEL,
                prompt="Once",
                max_tokens=12,
                stream=True,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async def chat_text() -> str:
            stream = await s.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        reading = [asyncio.create_task(completion()), asyncio.create_task(chat_text())]
        # A stream opened after them sees keep-alives: so have they, meanwhile.
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "stream": True}
        async with s.http.post(s.url + "/generate", json=body) as resp:
            async with asyncio.timeout(30):
                lines = [await resp.content.readline() for _ in range(6)]
            assert lines == [b": keep-alive\n", b"\n"] * 3
            s.engine.continue_generation()
            await sse_events(resp)
        text, _ = await asyncio.gather(*reading)
    finally:
        s.engine.continue_generation()
    assert text == alone.text


async def test_keep_alives_can_be_turned_off(serve: ServeFactory) -> None:
    s = await serve(sse_keepalive_s=0.0)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 3}, "stream": True}
    async with s.http.post(s.url + "/generate", json=body) as resp:
        raw = await resp.read()
    assert b"keep-alive" not in raw and raw.endswith(b"data: [DONE]\n\n")


# ---- incremental /generate streams -----------------------------------------------------------


async def test_incremental_streams_send_each_token_once(serve: ServeFactory) -> None:
    cumulative = await serve()  # SGLang's default: every event repeats everything so far
    incremental = await serve(incremental_streaming_output=True)
    sampling = {"max_new_tokens": 60, "ignore_eos": True, "temperature": 0}
    body = {"text": "The sea is", "sampling_params": sampling, "return_logprob": True}
    body["top_logprobs_num"] = 3
    async with incremental.http.post(incremental.url + "/generate", json=body) as resp:
        whole = await resp.json()
    streams = []
    for s in (cumulative, incremental):
        async with s.http.post(s.url + "/generate", json={**body, "stream": True}) as resp:
            streams.append(await resp.read())
    before, raw = streams
    events = [json.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    assert len(events) > 2 and raw.endswith(b"data: [DONE]\n\n")
    assert "".join(e["text"] for e in events) == whole["text"]
    assert [t for e in events for t in e["output_ids"]] == whole["output_ids"]
    meta = whole["meta_info"]
    streamed = [row for e in events for row in e["meta_info"]["output_token_logprobs"]]
    assert [row[1] for row in streamed] == [row[1] for row in meta["output_token_logprobs"]]
    top = [rows for e in events for rows in e["meta_info"]["output_top_logprobs"]]
    assert [[r[1] for r in rows] for rows in top] == [
        [r[1] for r in rows] for rows in meta["output_top_logprobs"]
    ]
    counts = [e["meta_info"]["completion_tokens"] for e in events]  # cumulative, as SGLang's
    assert counts == sorted(counts) and counts[-1] == 60
    assert [len(e["output_ids"]) for e in events[:-1]] == [
        b - a for a, b in zip([0, *counts[:-2]], counts[:-1], strict=True)
    ]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 60}
    # The default stream's last event is the same answer, whole; it sent far more to get there.
    last = json.loads(before.split(b"\n\n")[-3][6:])
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert len(raw) < 4 * len(json.dumps(whole)) < len(before) / 4  # linear, not quadratic
