"""Disaggregation that verifies what it is told (issue 29, item 6; docs/disaggregation.md):

- the prefill server's bootstrap listener answers hostile bodies as the main app does (4xx
  in its error shape, no traceback) and wants the server's key when one is set;
- a decode server contacts only the prefill servers of its own configuration
  (disaggregation_prefill_peers), never one a client names;
- a prefill server that accepts and never answers ends the client's request within the
  timeout, the room's pages quarantined until the peer is gone, then freed;
- the two servers match weights by a digest that survives a restart: a prefill server
  restarted on other weights is refused with a 400 "weights_mismatch" (which SGLang's
  router passes on and never retries), not used.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from disagg_helpers import NEW_TOKENS, WAIT_S, free_port, wait_for_counts
from engines import EngineFactory
from parity import mixed_prompts
from reference import Reference
from served import ServeFactory

from shoal import Engine
from shoal.disagg.backend import LocalFabric
from shoal.disagg.layout import KVLayout
from shoal.disagg.peers import PrefillPeers
from shoal.disagg.wire import RoomRequest
from shoal.loading.identity import weights_digest
from shoal.models.load import LoadedModel, load_model
from shoal.params import Bootstrap
from shoal.results import RequestError

LOCAL = {"disaggregation_transfer_backend": "local", "disaggregation_bootstrap_port": 0}


class SilentPeer:
    """A TCP server that accepts every connection and never answers (nor closes)."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> SilentPeer:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)  # kept open, never written to

    async def close(self) -> None:
        """Gone: its connections are reset and its port refuses."""
        if self.server is not None:
            self.server.close()
            for writer in self.writers:
                writer.close()
            await self.server.wait_closed()
            self.server = None


def error_body(raw: bytes) -> dict[str, Any]:
    """The main app's error shape (api/http/errors.py), checked."""
    body = msgspec.json.decode(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def room_request(**changes: Any) -> dict[str, Any]:
    layout = KVLayout(2, 2, 16, 16, "torch.float32", 2048, 8, (1, 2), (3, 4))
    request = RoomRequest("nowhere", layout, (0,), 0, 6, "digest")
    return {**msgspec.to_builtins(request), **changes}


# ---- the bootstrap listener -----------------------------------------------------------------


HOSTILE = [
    ("nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000, 400, "json_too_deep"),
    ("not JSON", b'{"endpoint": ', 400, "invalid_value"),
    ("empty", b"", 400, "invalid_value"),
    ("a wrong type", msgspec.json.encode(room_request(endpoint=5)), 400, "invalid_value"),
    ("a list", b"[1, 2, 3]", 400, "invalid_value"),
    ("not valid UTF-8", b'{"endpoint": "\xff"}', 400, "invalid_value"),
    ("a page outside the layout", msgspec.json.encode(room_request(pages=[99])), 400, None),
    ("too few addresses", msgspec.json.encode(room_request(layout={
        **msgspec.to_builtins(room_request()["layout"]), "k_addrs": [1]})), 400, None),
    ("over 32 MiB", b" " * (33 * 2**20), 413, "request_too_large"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "status", "code"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
async def test_the_listener_answers_hostile_bodies_with_a_4xx_in_the_apps_shape(
    make_engine: EngineFactory,
    caplog: pytest.LogCaptureFixture,
    body: bytes,
    status: int,
    code: str | None,
) -> None:
    prefill = await make_engine(disaggregation_mode="prefill", **LOCAL)
    url = f"http://127.0.0.1:{prefill.bootstrap_port}/shoal/pd/rooms/7"
    headers = {"Content-Type": "application/json"}
    with caplog.at_level(logging.WARNING):
        async with (
            aiohttp.ClientSession() as http,
            http.post(url, data=body, headers=headers) as response,
        ):
            assert response.status == status, await response.text()
            error = error_body(await response.read())
    if code is not None:
        assert error["code"] == code, error
    assert set((await prefill.transfer_counts()).values()) == {0}  # no room opened
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("POST", "/shoal/pd/rooms/abc", {}, 400),
        ("POST", "/shoal/pd/rooms/-1", {}, 400),
        ("DELETE", "/shoal/pd/rooms/99999999999999999999", {}, 400),
        ("DELETE", "/shoal/pd/rooms/%D9%A1", {}, 400),  # an Arabic-Indic digit
        ("POST", "/shoal/pd/rooms/7", {"Origin": "http://evil.example"}, 403),
        ("DELETE", "/shoal/pd/rooms/7", {"Origin": "null"}, 403),
        ("GET", "/shoal/pd/rooms/7", {}, 405),
        ("GET", "/nothing", {}, 404),
    ],
)
async def test_the_listener_refuses_bad_rooms_routes_and_web_pages(
    make_engine: EngineFactory, method: str, path: str, headers: dict[str, str], status: int
) -> None:
    prefill = await make_engine(disaggregation_mode="prefill", **LOCAL)
    url = f"http://127.0.0.1:{prefill.bootstrap_port}{path}"
    body = msgspec.json.encode(room_request())
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, url, data=body, headers=headers) as response,
    ):
        assert response.status == status, await response.text()
        error_body(await response.read())
    assert set((await prefill.transfer_counts()).values()) == {0}


async def test_the_listener_wants_the_servers_key_and_the_decode_side_sends_it(
    make_engine: EngineFactory, tiny_model: LoadedModel, tiny_reference: Reference
) -> None:
    fabric = LocalFabric()
    common = {**LOCAL, "fabric": fabric, "disaggregation_timeout_s": 5.0}
    prefill = await make_engine(disaggregation_mode="prefill", peer_key="sekrit", **common)
    peers = f"127.0.0.1:{prefill.bootstrap_port}"
    base = f"http://127.0.0.1:{prefill.bootstrap_port}"
    body = msgspec.json.encode(room_request())
    async with aiohttp.ClientSession() as http:
        for given in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            async with http.post(base + "/shoal/pd/rooms/7", data=body, headers=given) as r:
                assert r.status == 401, await r.text()
                assert "same one" in error_body(await r.read())["message"]
            async with http.delete(base + "/shoal/pd/rooms/7", headers=given) as r:
                assert r.status == 401
        async with http.get(base + "/health") as r:
            assert r.status == 200
    assert set((await prefill.transfer_counts()).values()) == {0}

    prompt = mixed_prompts(tiny_model.config.vocab_size)[1]
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    keyless = await make_engine(
        disaggregation_mode="decode", disaggregation_prefill_peers=peers, **common
    )
    done = await keyless.generate(
        input_ids=prompt, bootstrap=Bootstrap("127.0.0.1", prefill.bootstrap_port, 1), **sampling
    ).result()
    assert done.finish_reason == "error" and "401" in done.message and "--api-key" in done.message

    keyed = await make_engine(
        disaggregation_mode="decode", disaggregation_prefill_peers=peers, peer_key="sekrit",
        **common,
    )  # fmt: skip
    b = Bootstrap("127.0.0.1", prefill.bootstrap_port, 2)
    first = prefill.generate(input_ids=prompt, bootstrap=b, **sampling)
    second = keyed.generate(input_ids=prompt, bootstrap=b, **sampling)
    await first.result()
    assert list((await second.result()).token_ids) == tiny_reference.greedy(prompt, NEW_TOKENS)
    for engine in (prefill, keyless, keyed):
        await engine.wait_idle(WAIT_S)
        assert set((await engine.transfer_counts()).values()) == {0}


# ---- the peers a decode server contacts ----------------------------------------------------


def test_prefill_peers_parse_and_refuse() -> None:
    peers = PrefillPeers.parse(" 127.0.0.1:8998, [::1]:9000,Prefill.Example:1 ")
    assert peers.refusal("127.0.0.1", 8998) is None
    assert peers.refusal("::1", 9000) is None and peers.refusal("[::1]", 9000) is None
    assert peers.refusal("prefill.example", 1) is None
    assert peers.refusal("127.0.0.1", 8999) is not None
    assert peers.refusal("127.0.0.1", 8999)[0] == "bootstrap_port"  # type: ignore[index]
    assert peers.refusal("10.0.0.1", 8998)[0] == "bootstrap_host"  # type: ignore[index]
    assert peers.refusal("localhost", 8998) is not None  # compared as written
    for bad in ("", "host", "host:", ":80", "h:0", "h:65536", "h:8o", "::1:80", "h:\u0661"):
        with pytest.raises(ValueError):
            PrefillPeers.parse(bad)


async def test_a_client_chosen_peer_is_refused_before_anything_is_reserved(
    serve: ServeFactory, tiny_model: LoadedModel
) -> None:
    """Any client of a decode server could otherwise make it send requests to any host and
    port: the body's bootstrap_host/port must be one of its configured peers (by default
    127.0.0.1:8998, the prefill server's default bootstrap address)."""
    evil = await SilentPeer().start()
    try:
        s = await serve(disaggregation_mode="decode", **LOCAL, disaggregation_timeout_s=1.0)
        assert s.engine.options.disaggregation_prefill_peers == "127.0.0.1:8998"
        ids = mixed_prompts(tiny_model.config.vocab_size)[1]
        bodies = [
            ({"bootstrap_host": "127.0.0.1", "bootstrap_port": evil.port}, "bootstrap_port"),
            ({"bootstrap_host": "10.9.8.7", "bootstrap_port": 8998}, "bootstrap_host"),
            ({"bootstrap_host": "10.9.8.7"}, "bootstrap_host"),  # the default port
        ]
        for fields, param in bodies:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, **fields}
            body["bootstrap_room"] = 5
            async with s.http.post(s.url + "/generate", json=body) as response:
                assert response.status == 400, await response.text()
                error = error_body(await response.read())
                assert (
                    error["param"] == param and "disaggregation_prefill_peers" in error["message"]
                )
            chat = {
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, **fields, "bootstrap_room": 6,
            }  # fmt: skip
            async with s.http.post(s.url + "/v1/chat/completions", json=chat) as response:
                assert response.status == 400
                assert error_body(await response.read())["param"] == param
        with pytest.raises(RequestError) as refused:
            s.engine.generate(input_ids=ids, bootstrap=Bootstrap("10.9.8.7", 8998, 9))
        assert refused.value.field == "bootstrap_host"
        s.engine.drop_room(Bootstrap("127.0.0.1", evil.port, 10), "refused")  # not sent
        await s.engine.wait_idle(WAIT_S)
        assert set((await s.engine.transfer_counts()).values()) == {0}
        assert evil.writers == []  # never contacted
    finally:
        await evil.close()


# ---- a silent peer ----------------------------------------------------------------------------


async def test_a_silent_peer_ends_the_request_within_the_timeout_and_its_pages_come_back(
    serve: ServeFactory, tiny_model: LoadedModel
) -> None:
    """The prefill server accepts the bootstrap connection and never answers: the client's
    request ends with an error within disaggregation_timeout_s; the room's pages stay
    quarantined (its row and pages held, counted as "cancelling") while the peer may still
    write, and come back once it is gone."""
    silent = await SilentPeer().start()
    try:
        s = await serve(
            disaggregation_mode="decode",
            disaggregation_prefill_peers=f"127.0.0.1:{silent.port}",
            disaggregation_timeout_s=1.0,
            **LOCAL,
        )
        ids = mixed_prompts(tiny_model.config.vocab_size)[1]
        body = {
            "input_ids": ids, "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": silent.port, "bootstrap_room": 3,
        }  # fmt: skip
        began = time.monotonic()
        response = await asyncio.wait_for(s.http.post(s.url + "/generate", json=body), WAIT_S)
        took = time.monotonic() - began
        async with response:
            assert response.status == 500, await response.text()
            assert "no KV from the prefill server within 1s" in (await response.text())
        assert took < 1.0 + 5.0, took  # the timeout, and not much more
        await wait_for_counts(s.engine, cancelling=1)  # quarantined: the peer may still write
        assert (await s.engine.snapshot()).finishing  # its row and pages held meanwhile
        await silent.close()  # gone: nothing of it can write any more
        await wait_for_counts(s.engine, cancelling=0, waiting=0)
        await s.engine.wait_idle(WAIT_S)
        cache = await s.engine.cache_stats()
        assert cache.free_rows == cache.total_rows and cache.request_pages == 0
    finally:
        await silent.close()


# ---- the weights -------------------------------------------------------------------------------


def test_the_weights_digest_is_the_weights(tiny_model: LoadedModel, other_folder: Path) -> None:
    again = load_model(tiny_model.path, progress=False)  # a restart: a fresh load
    assert weights_digest(again.weights) == weights_digest(tiny_model.weights)
    other = load_model(other_folder, progress=False)
    assert weights_digest(other.weights) != weights_digest(tiny_model.weights)
    assert weights_digest(tiny_model.weights, "int8") != weights_digest(tiny_model.weights)
    one_changed = dict(tiny_model.weights)
    name = sorted(one_changed)[0]
    one_changed[name] = one_changed[name] + 1.0
    assert weights_digest(one_changed) != weights_digest(tiny_model.weights)


async def test_a_prefill_server_restarted_on_other_weights_is_refused_with_a_400(
    serve: ServeFactory, tiny_model: LoadedModel, other_folder: Path, tiny_reference: Reference
) -> None:
    """weight_version restarts at 0 with the server, so it cannot tell weights apart: the
    digest can. The decode server answers 400 "weights_mismatch" (which SGLang's router
    does not retry), the prefill half ends with the same code, and nothing is written."""
    fabric = LocalFabric()
    port = free_port()
    common: dict[str, Any] = {
        "disaggregation_transfer_backend": "local",
        "disaggregation_bootstrap_port": port,
        "disaggregation_timeout_s": 5.0,
        "fabric": fabric,
        "strict_integrity": True,
        "dtype": "float32",  # both halves as make_engine's (auto: bfloat16 with AMX or AVX512-BF16)
    }
    s = await serve(
        disaggregation_mode="decode", disaggregation_prefill_peers=f"127.0.0.1:{port}", **common
    )
    ids = mixed_prompts(tiny_model.config.vocab_size)[1]
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}

    async def both(prefill: Engine, room: int) -> tuple[Any, aiohttp.ClientResponse]:
        b = Bootstrap("127.0.0.1", port, room)
        first = prefill.generate(input_ids=ids, bootstrap=b, **sampling)
        body = {
            "input_ids": ids, "sampling_params": sampling,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room,
        }  # fmt: skip
        second = await s.http.post(s.url + "/generate", json=body)
        await second.read()
        return await first.result(), second

    prefill = await Engine(tiny_model, disaggregation_mode="prefill", **common).start()
    try:
        _, response = await both(prefill, 1)
        assert response.status == 200
        assert (await response.json())["output_ids"] == tiny_reference.greedy(ids, NEW_TOKENS)
        await prefill.close()
        other = load_model(other_folder, progress=False)
        prefill = await Engine(other, disaggregation_mode="prefill", **common).start()
        assert prefill.weight_version == s.engine.weight_version == "0"  # the counter cannot tell
        written = fabric.bytes_written
        first, response = await both(prefill, 2)
        assert response.status == 400, await response.text()
        error = error_body(await response.read())
        assert error["code"] == "weights_mismatch" and "other weights" in error["message"]
        assert first.finish_reason == "error" and first.code == "weights_mismatch"
        assert fabric.bytes_written == written  # refused before anything was written
        await prefill.wait_idle(WAIT_S)
        await s.engine.wait_idle(WAIT_S)
        for engine in (prefill, s.engine):
            assert set((await engine.transfer_counts()).values()) == {0}
    finally:
        await prefill.close()
