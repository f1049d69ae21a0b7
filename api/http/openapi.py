"""GET /openapi.json: an OpenAPI 3.1 document generated from the msgspec wire types.

    document(ROUTES)   the route table (route_table.py) + msgspec.json.schema_components -> a dict
    OpenAPIRoute serves it, encoded once

No schema is written by hand: msgspec derives every one from the types the handlers decode
and encode, so the document cannot drift from the wire; tests/api/http/test_http_fuzz.py holds the
server to it with schemathesis. Every failure answers the one error shape
(http_errors.ErrorEnvelope), each operation's "default" response. Streamed answers are
documented per SSE event (OpenAPI 3.1: `schema` describes one event): `data` is `[DONE]` or
a JSON chunk (contentSchema). The websocket route is a GET that upgrades (101); its messages
(ws_protocol) are the components ClientMessage and ServerMessage. Security follows each
route's access, as the guard checks it (routing.py, Route.needs): the admin key on "admin"
routes when one is set, the API key on all but "open" ones when one is set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from aiohttp import web

from shoal.api.http.errors import JSON, ErrorEnvelope
from shoal.api.http.routing import SSE, Access, Body, Route
from shoal.api.http.ws_protocol import ClientMessage, ServerMessage

REF = "#/components/schemas/{name}"
WS_MESSAGES: Mapping[str, Any] = {"ClientMessage": ClientMessage, "ServerMessage": ServerMessage}
SCHEMES = {
    "apiKey": {"type": "http", "scheme": "bearer", "description": "the API key (or admin key)"},
    "adminKey": {"type": "http", "scheme": "bearer", "description": "the admin key"},
}


def document(operations: Sequence[Route], api_key: bool = False, admin_key: bool = False) -> Any:
    """The OpenAPI 3.1 document for these routes, with the keys the server checks."""
    request_types = [op.request for op in operations if op.request is not None]
    response_types = [
        body.type
        for op in operations
        for bodies in op.responses.values()
        for body in bodies
        if body.type is not None
    ]
    types = [ErrorEnvelope, *WS_MESSAGES.values(), *request_types, *response_types]
    schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    schema_of = dict(zip(map(_key, types), schemas, strict=True))
    components.update({name: schema_of[_key(t)] for name, t in WS_MESSAGES.items()})
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        out = _operation(op, schema_of)
        scheme = _scheme(op.needs, api_key, admin_key)
        if scheme is not None:
            out["security"] = [{scheme: []}]
        paths.setdefault(op.path, {})[op.method.lower()] = out
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "shoal", "version": "0.1.0"},
        "paths": paths,
        "components": {"schemas": components},
    }
    used = {s for op in operations if (s := _scheme(op.needs, api_key, admin_key)) is not None}
    if used:
        doc["components"]["securitySchemes"] = {k: v for k, v in SCHEMES.items() if k in used}
    return doc


def _scheme(needs: Access, api_key: bool, admin_key: bool) -> str | None:
    """Which key a route needs (guard.authorize), if any."""
    if admin_key and needs == "admin":
        return "adminKey"
    if api_key and needs != "open":
        return "apiKey"
    return None


def _key(kind: Any) -> str:
    return repr(kind)  # types like `A | B` are not all hashable; their repr is stable


def _operation(op: Route, schema_of: Mapping[str, Any]) -> dict[str, Any]:
    path = op.path.strip("/").replace("/", "_").replace(".", "_")
    out: dict[str, Any] = {
        "operationId": f"{op.method.lower()}_{path}",
        "summary": op.summary,
        "tags": list(op.tags),
        "responses": {
            status: _response(status, bodies, schema_of) for status, bodies in op.responses.items()
        },
    }
    out["responses"]["default"] = {
        "description": "an error, in the one error shape (see api/http/errors.py)",
        "content": {JSON: {"schema": schema_of[_key(ErrorEnvelope)]}},
    }
    if op.description:
        out["description"] = op.description
    if op.request is not None:
        out["requestBody"] = {
            "required": not op.body_optional,
            "content": {JSON: {"schema": schema_of[_key(op.request)]}},
        }
        if op.example is not None:
            out["requestBody"]["content"][JSON]["example"] = op.example
    if op.query:
        out["parameters"] = [
            {
                "name": q.name,
                "in": "query",
                "required": False,
                "schema": dict(q.schema),
                "description": q.description,
            }
            for q in op.query
        ]
    return out


def _response(
    status: str, bodies: tuple[Body, ...], schema_of: Mapping[str, Any]
) -> dict[str, Any]:
    """Bodies of one media type are alternatives (anyOf); SSE and text are strings."""
    if not bodies:
        return {"description": "switching protocols"}
    alternatives: dict[str, list[Any]] = {}
    for body in bodies:
        if body.type is None:
            schema: Any = {"type": "string"}
        elif body.media_type == SSE:
            schema = _sse_event(schema_of[_key(body.type)], schema_of[_key(ErrorEnvelope)])
        else:
            schema = schema_of[_key(body.type)]
        alternatives.setdefault(body.media_type, []).append(schema)
    content = {
        media_type: {"schema": schemas[0] if len(schemas) == 1 else {"anyOf": schemas}}
        for media_type, schemas in alternatives.items()
    }
    return {"description": "success" if status < "300" else "refused", "content": content}


def _sse_event(payload: Any, error: Any) -> dict[str, Any]:
    """One SSE event (OpenAPI 3.1: `schema` describes each event): `data:` is a JSON chunk,
    an error event, or the final `[DONE]`."""
    chunk = {
        "type": "string",
        "contentMediaType": JSON,
        "contentSchema": {"anyOf": [payload, error]},
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, chunk]}},
    }


class OpenAPIRoute:
    """Serves the document of the server's routes, encoded once."""

    def __init__(
        self, routes: Sequence[Route], api_key: str | None, admin_api_key: str | None
    ) -> None:
        doc = document(routes, bool(api_key), bool(admin_api_key))  # names no key
        self.body = msgspec.json.encode(doc)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self.body, content_type=JSON)
