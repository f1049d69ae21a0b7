"""GET /openapi.json documents exactly the routes the app serves, from the wire types."""

from __future__ import annotations

from typing import Any

import msgspec
from served import ServeFactory

from shoal.api.http.openapi import document
from shoal.api.http.route_table import ROUTES

ADMIN_ROUTES = {route.path for route in ROUTES if route.needs == "admin"}
OPERATIONS = ROUTES


METHODS = {"get", "post", "put", "patch", "delete", "head", "options"}


def documented(doc: Any) -> set[tuple[str, str]]:
    return {
        (method, path)
        for path, item in doc["paths"].items()
        for method in item
        if method in METHODS
    }


async def test_every_route_is_documented(serve: ServeFactory) -> None:
    s = await serve()
    served: set[tuple[str, str]] = set()
    gets: set[str] = set()
    heads: set[str] = set()
    for route in s.server.app.router.routes():
        resource = route.resource
        assert resource is not None
        method, path = route.method.lower(), resource.canonical
        if method == "head":  # aiohttp adds HEAD to every GET: it answers as GET, no body
            heads.add(path)
            continue
        if method == "get":
            gets.add(path)
        served.add((method, path))
    assert heads <= gets, f"HEAD without a GET: {sorted(heads - gets)}"
    async with s.http.get(s.url + "/openapi.json") as response:
        assert response.status == 200
        assert response.content_type == "application/json"
        doc = await response.json()
    listed = documented(doc)
    assert not served - listed, f"routes missing from /openapi.json: {sorted(served - listed)}"
    assert not listed - served, f"documented but not served: {sorted(listed - served)}"
    assert ("get", "/health") in listed and ("get", "/openapi.json") in listed
    assert doc["openapi"].startswith("3.1")


def test_components_come_from_the_wire_types() -> None:
    doc = document(ROUTES)
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "GenerateRequest", "ErrorEnvelope", "Outcome"):
        assert name in schemas, name
    for name in ("ClientMessage", "ServerMessage", "Open", "Turn", "Done", "Error"):
        assert name in schemas, name  # the websocket's messages
    assert schemas["ClientMessage"]["discriminator"]["propertyName"] == "type"
    sampling = schemas["NativeSampling"]
    assert sampling["additionalProperties"] is False  # forbid_unknown_fields, carried over
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    event = chat["responses"]["200"]["content"]["text/event-stream"]["schema"]
    chunk = event["properties"]["data"]["anyOf"][1]["contentSchema"]["anyOf"][0]
    assert chunk == {"$ref": "#/components/schemas/ChatCompletionChunk"}  # each event's data
    assert "security" not in chat and "securitySchemes" not in doc["components"]
    ws = doc["paths"]["/v1/sessions/ws"]["get"]
    assert "101" in ws["responses"] and "ws_protocol" in ws["description"]


def security(doc: Any) -> dict[str, list[Any]]:
    return {
        path: operation.get("security", [])
        for path, item in doc["paths"].items()
        for operation in item.values()
    }


def test_keys_are_documented_where_they_are_checked() -> None:
    api = document(ROUTES, api_key=True)
    assert set(api["components"]["securitySchemes"]) == {"apiKey"}
    for path, needs in security(api).items():
        assert needs == ([] if path == "/health" else [{"apiKey": []}]), path
    admin = document(ROUTES, admin_key=True)
    assert set(admin["components"]["securitySchemes"]) == {"adminKey"}
    for path, needs in security(admin).items():
        assert needs == ([{"adminKey": []}] if path in ADMIN_ROUTES else []), path
    both = security(document(ROUTES, api_key=True, admin_key=True))
    assert both["/flush_cache"] == [{"adminKey": []}] and both["/generate"] == [{"apiKey": []}]


async def test_served_document_follows_the_server_keys(serve: ServeFactory) -> None:
    s = await serve(api_key="api-key-7c1e", admin_api_key="admin-key-93d0")
    headers = {"Authorization": "Bearer api-key-7c1e"}
    async with s.http.get(s.url + "/openapi.json", headers=headers) as response:
        assert response.status == 200
        text = await response.text()
    assert '"adminKey"' in text and '"apiKey"' in text
    assert "key-7c1e" not in text and "key-93d0" not in text  # names no key


def test_examples_decode_as_their_request_types() -> None:
    examples = [op for op in OPERATIONS if op.example is not None]
    assert examples
    for op in examples:
        assert op.request is not None, op.path
        msgspec.convert(op.example, op.request)  # raises if the example drifted
