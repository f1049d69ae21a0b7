"""The route table (api/http/route_table.py): each route declared once, and read by the app,
the guard, /openapi.json and the disaggregation fields. A state-changing route needs the admin
key unless its declaration says otherwise."""

from __future__ import annotations

import dataclasses
from typing import Any

import aiohttp
from engines import EngineFactory

from shoal.api.http.lifecycle import LifecycleRoutes, Outcome
from shoal.api.http.route_table import ROUTES
from shoal.api.http.routing import Body, Route, ok
from shoal.api.http.server import Server, ServerOptions

API, ADMIN = "api-key-5e1f", "admin-key-0b7c"
PAUSE = Route(
    method="POST",
    path="/pause_again",
    handler=LifecycleRoutes.pause,
    summary="A new state-changing route, its access not declared",
    responses=ok(Body(Outcome)),
)
RESUME = dataclasses.replace(
    PAUSE, path="/resume_again", handler=LifecycleRoutes.resume, access="key"
)


def test_the_method_decides_what_a_route_not_declared_needs() -> None:
    assert PAUSE.access is None and PAUSE.needs == "admin"
    assert dataclasses.replace(PAUSE, method="GET").needs == "key"
    assert RESUME.needs == "key"


def test_the_table_guards_and_generates_as_the_server_always_has() -> None:
    by_access: dict[str, set[str]] = {}
    for route in ROUTES:
        by_access.setdefault(route.needs, set()).add(route.path)
    assert by_access["open"] == {"/health"}
    assert by_access["admin"] == {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/flush_cache",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
    }
    generating = {route.path for route in ROUTES if route.generates}
    assert generating == {"/generate", "/v1/completions", "/v1/chat/completions"}
    assert len({(route.method, route.path) for route in ROUTES}) == len(ROUTES)


async def test_a_new_route_is_served_guarded_and_documented_from_its_row(
    make_engine: EngineFactory,
) -> None:
    engine = await make_engine()
    options = ServerOptions(port=0, api_key=API, admin_api_key=ADMIN)
    server = Server(engine, options, routes=(*ROUTES, PAUSE, RESUME))
    async with server, aiohttp.ClientSession() as http:

        async def post(path: str, key: str | None) -> int:
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            async with http.post(server.url + path, headers=headers) as resp:
                return resp.status

        assert await post("/pause_again", None) == 401
        assert await post("/pause_again", API) == 403  # the admin key's, not the API key's
        assert await post("/pause_again", ADMIN) == 200
        assert engine.paused
        assert await post("/resume_again", None) == 401
        assert await post("/resume_again", API) == 200  # declared: any API client
        assert not engine.paused
        headers = {"Authorization": f"Bearer {API}"}
        async with http.get(server.url + "/openapi.json", headers=headers) as resp:
            doc: dict[str, Any] = await resp.json()
    assert doc["paths"]["/pause_again"]["post"]["security"] == [{"adminKey": []}]
    assert doc["paths"]["/resume_again"]["post"]["security"] == [{"apiKey": []}]
