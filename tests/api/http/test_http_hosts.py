"""The Host check (api/http/hosts.py, api/http/guard.py): a page whose name was re-pointed at
the server (DNS rebinding) is refused on every route and the websocket, while the names the
server is really reached by (IP literals, localhost, the bound name, --allowed-hosts) pass.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from served import Served, ServeFactory

from shoal.api.cli import build_parser
from shoal.api.http.hosts import HostCheck
from shoal.api.http.server import ServerOptions

REBOUND = "evil.example"  # the attacker's name, now resolving to 127.0.0.1


def browser_headers(host: str) -> dict[str, str]:
    """What a page loaded from http://<host> sends to its own origin: Host and Origin agree."""
    return {"Host": host, "Origin": f"http://{host}"}


async def assert_refused(resp: aiohttp.ClientResponse, method: str, path: str) -> None:
    assert resp.status == 403, (method, path, resp.status, await resp.text())
    if method != "HEAD":
        body: dict[str, Any] = await resp.json()
        assert body["error"]["code"] == "host_not_allowed", (method, path, body)
        assert "--allowed-hosts" in body["error"]["message"], body


async def test_a_rebound_host_is_refused_on_every_route_and_the_websocket(
    serve: ServeFactory,
) -> None:
    s = await serve()
    rebound = browser_headers(f"{REBOUND}:{s.server.port}")
    routes = [
        (route.method, route.resource.canonical)
        for route in s.server.app.router.routes()
        if route.resource is not None
    ]
    assert ("GET", "/health") in routes and ("GET", "/v1/sessions/ws") in routes
    assert ("POST", "/pause_generation") in routes and len(routes) > 20
    for method, path in [*routes, ("GET", "/nope")]:
        assert "{" not in path, f"fill in the dynamic route {path}"
        body = b"{}" if method == "POST" else None
        headers = {**rebound, "Content-Type": "application/json"} if body else rebound
        async with s.http.request(method, s.url + path, data=body, headers=headers) as resp:
            await assert_refused(resp, method, path)
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await s.http.ws_connect(s.url + "/v1/sessions/ws", headers=rebound)
    assert refused.value.status == 403
    # nothing reached the engine: not paused, nothing opened
    async with s.http.post(s.url + "/generate", json={"text": "hi"}) as resp:
        assert resp.status == 200, await resp.text()


async def test_the_names_the_server_is_reached_by_pass(serve: ServeFactory) -> None:
    s = await serve()
    port = s.server.port
    for host in (
        f"127.0.0.1:{port}",
        f"localhost:{port}",
        f"LocalHost.:{port}",
        f"[::1]:{port}",
        "127.8.9.10",  # the rest of 127/8
        f"10.0.0.5:{port}",  # an address of this machine's, or one mapped to it (NAT, Docker)
    ):
        headers = browser_headers(host)
        async with s.http.get(s.url + "/v1/models", headers=headers) as resp:
            assert resp.status == 200, (host, await resp.text())
        async with s.http.post(s.url + "/pause_generation", headers=headers) as resp:
            assert resp.status == 200, (host, await resp.text())
        async with s.http.post(s.url + "/continue_generation", headers=headers) as resp:
            assert resp.status == 200, (host, await resp.text())
    ws = await s.http.ws_connect(
        s.url + "/v1/sessions/ws", headers=browser_headers(f"localhost:{port}")
    )
    await ws.send_json({"type": "open"})
    assert (await ws.receive_json(timeout=30))["type"] == "opened"
    await ws.close()
    assert await raw_status(s, b"GET /health HTTP/1.0\r\n\r\n") == 200  # no Host at all


async def raw_status(s: Served, request: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", s.server.port)
    try:
        writer.write(request)
        line = await asyncio.wait_for(reader.readline(), 30)
        return int(line.split()[1])
    finally:
        writer.close()


async def test_allowed_hosts_add_names_and_domains(serve: ServeFactory) -> None:
    s = await serve(allowed_hosts=("api.example.com", ".corp.example"))
    for host in ("api.example.com", "API.example.com:443", "corp.example", "a.b.corp.example"):
        async with s.http.get(s.url + "/v1/models", headers=browser_headers(host)) as resp:
            assert resp.status == 200, (host, await resp.text())
    for host in (REBOUND, "x.api.example.com", "evilcorp.example", "corp.example.evil.example"):
        async with s.http.get(s.url + "/health", headers=browser_headers(host)) as resp:
            await assert_refused(resp, "GET", f"/health as {host}")
    anyone = await serve(allowed_hosts=("*",))
    headers = browser_headers(f"{REBOUND}:{anyone.server.port}")
    async with anyone.http.get(anyone.url + "/v1/models", headers=headers) as resp:
        assert resp.status == 200


def test_the_host_check_reads_the_header_as_a_browser_writes_it() -> None:
    anywhere = HostCheck((), "0.0.0.0")  # every address of the machine: names must be listed
    for header in ("127.0.0.1", "192.168.1.7:30000", "[::1]", "[fe80::1]:80", "localhost:1", None):
        assert anywhere.allows(header), header
    for header in (REBOUND, "a.localhost", "[::1", "[1.2.3.4]", "::1", "x y", "localhost:abc"):
        assert not anywhere.allows(header), header
    named = HostCheck((), "gpu-box.lan")  # bound to a name: served by it
    assert named.allows("gpu-box.lan:30000") and named.allows("GPU-box.lan.")
    assert not named.allows("box.lan") and not named.allows("x.gpu-box.lan")


def test_allowed_hosts_are_validated_and_the_flag_reaches_them() -> None:
    for bad in ("http://api.example.com", "api.example.com:8080", "api.example.com/v1", "a b"):
        with pytest.raises(ValueError, match="allowed host"):
            ServerOptions(allowed_hosts=(bad,)).validate()
    args = build_parser().parse_args(["serve", "--allowed-hosts", "api.example.com, .corp.example"])
    assert args.allowed_hosts == ("api.example.com", ".corp.example")
    assert build_parser().parse_args(["serve"]).allowed_hosts == ()
