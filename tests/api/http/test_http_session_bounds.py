"""No client holds the server's sessions: a session's timeout_s is bounded (400 naming the
bound, on /open_session and the websocket), and one client (one peer address) holds at most
max_sessions_per_client of them (429), whoever else is left free to open theirs.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from served import Served, ServeFactory

OTHER_CLIENT = "127.0.0.2"  # another loopback address: another peer, as far as the server sees


async def open_over_http(s: Served, http: aiohttp.ClientSession, **body: Any) -> tuple[int, Any]:
    async with http.post(s.url + "/open_session", json=body) as resp:
        return resp.status, await resp.json()


async def open_over_ws(s: Served, http: aiohttp.ClientSession, **fields: Any) -> Any:
    ws = await http.ws_connect(s.url + "/v1/sessions/ws")
    await ws.send_json({"type": "open", **fields})
    answer = await ws.receive_json(timeout=30)
    await ws.close()  # closes what it opened
    return answer


async def test_a_session_timeout_past_the_bound_is_refused_naming_it(serve: ServeFactory) -> None:
    s = await serve(max_session_timeout_s=120.0)
    for huge in (1e300, 121):
        status, got = await open_over_http(s, s.http, timeout_s=huge)
        assert status == 400, got
        assert got["error"]["param"] == "timeout_s", got
        assert "max_session_timeout_s" in got["error"]["message"], got
        answer = await open_over_ws(s, s.http, timeout_s=huge)
        assert answer["type"] == "error" and answer["param"] == "timeout_s", answer
    assert not s.engine.actors.tokenizer.sessions.states  # nothing was opened
    status, got = await open_over_http(s, s.http, timeout_s=120)
    assert status == 200, got
    async with s.http.post(s.url + "/close_session", json=got) as resp:
        assert resp.status == 200


async def test_one_client_cannot_take_every_session(serve: ServeFactory) -> None:
    s = await serve(max_sessions=8, max_sessions_per_client=2)
    held = []
    for _ in range(2):
        status, got = await open_over_http(s, s.http)
        assert status == 200, got
        held.append(got["session_id"])
    status, got = await open_over_http(s, s.http)
    assert status == 429, got
    assert got["error"]["code"] == "too_many_sessions", got
    assert "max_sessions_per_client" in got["error"]["message"], got
    answer = await open_over_ws(s, s.http)
    assert answer["type"] == "error" and answer["code"] == "too_many_sessions", answer
    # another client is served meanwhile, over HTTP and the websocket
    other = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(OTHER_CLIENT, 0)))
    async with other:
        status, got = await open_over_http(s, other)
        assert status == 200, got
        assert (await open_over_ws(s, other))["type"] == "opened"
        async with other.post(s.url + "/close_session", json=got) as resp:
            assert resp.status == 200
    # closing one gives its client the slot back
    async with s.http.post(s.url + "/close_session", json={"session_id": held.pop()}) as resp:
        assert resp.status == 200
    assert (await open_over_ws(s, s.http))["type"] == "opened"
    async with s.http.post(s.url + "/close_session", json={"session_id": held.pop()}) as resp:
        assert resp.status == 200
