"""GET /openapi.json: an OpenAPI 3.1 document generated from the msgspec wire types.

    OPERATIONS   one row per (method, path): summary, request body type or query parameters,
                 response types per status
    document()   OPERATIONS + msgspec.json.schema_components -> the document (a dict)

The schemas are never written by hand: every request and response type named below is the
one its handler decodes or encodes, so the document cannot drift from the wire. Handlers that
answer a plain dict (the admin routes) are documented as `dict[str, Any]`. A test walks the
app's router and fails if a route is missing here, or named here but not served; another
fuzzes every operation with schemathesis.

Every failure answers the one error shape (http_errors.ErrorEnvelope), documented as each
operation's "default" response. The websocket route is documented as a GET that upgrades
(101); its messages (ws_protocol) are the components ClientMessage and ServerMessage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from shoal.api.http_errors import JSON, ErrorEnvelope
from shoal.api.http_lifecycle import Outcome, UpdateWeightsRequest
from shoal.api.http_native_protocol import AbortRequest, GenerateRequest, GenerateResponse
from shoal.api.http_sessions import (
    CloseSessionRequest,
    CloseSessionResponse,
    OpenSessionRequest,
    OpenSessionResponse,
)
from shoal.api.openai_protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    ModelList,
    TextCompletion,
)
from shoal.api.ws_protocol import ClientMessage, ServerMessage

SSE = "text/event-stream"
TEXT = "text/plain"
REF = "#/components/schemas/{name}"
WS_MESSAGES: Mapping[str, Any] = {"ClientMessage": ClientMessage, "ServerMessage": ServerMessage}


@dataclass(frozen=True)
class Body:
    """A response body: its msgspec type (None: no schema, e.g. metrics text) and media type.
    For SSE the type is each event's JSON payload. Several bodies of one media type under
    one status are alternatives."""

    type: Any
    media_type: str = JSON


@dataclass(frozen=True)
class Query:
    name: str
    schema: Mapping[str, Any]
    description: str


@dataclass(frozen=True)
class Operation:
    method: str  # lower case, as OpenAPI spells it
    path: str
    summary: str
    responses: Mapping[str, tuple[Body, ...]]  # status ("200", "101") -> media types
    request: Any = None  # the JSON body's type; None: no body
    example: Any = None  # a request body that works (a test decodes it as `request`)
    query: tuple[Query, ...] = ()
    description: str = ""
    tags: tuple[str, ...] = field(default=())


def _ok(*bodies: Body) -> Mapping[str, tuple[Body, ...]]:
    return {"200": bodies}


_STREAMED = "With `stream: true` the answer is SSE: `data: <chunk>` ... `data: [DONE]`."
_OBJECT = Body(dict[str, Any])

OPERATIONS: tuple[Operation, ...] = (
    # ---- OpenAI-compatible (openai_routes) ----
    Operation(
        "post",
        "/v1/chat/completions",
        "Chat completion (OpenAI)",
        _ok(Body(ChatCompletion), Body(ChatCompletionChunk, SSE)),
        request=ChatCompletionRequest,
        example={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
        description=_STREAMED + " With session_params: an open session's next turn.",
        tags=("openai",),
    ),
    Operation(
        "post",
        "/v1/completions",
        "Text completion (OpenAI)",
        _ok(Body(TextCompletion), Body(TextCompletion, SSE)),
        request=CompletionRequest,
        example={"prompt": "Once upon a time", "max_tokens": 8},
        description=_STREAMED,
        tags=("openai",),
    ),
    Operation(
        "get", "/v1/models", "The served model names", _ok(Body(ModelList)), tags=("openai",)
    ),
    # ---- native (http_native) ----
    Operation(
        "post",
        "/generate",
        "Generate (SGLang's native route)",
        _ok(Body(GenerateResponse | list[GenerateResponse]), Body(GenerateResponse, SSE)),
        request=GenerateRequest,
        example={"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        description="One prompt answers one object, a batch a list. " + _STREAMED,
        tags=("native",),
    ),
    # ---- admin (http_admin) ----
    Operation("get", "/health", "Alive (no API key needed)", _ok(_OBJECT), tags=("admin",)),
    Operation("get", "/health_generate", "Alive and generating", _ok(_OBJECT), tags=("admin",)),
    Operation("get", "/get_model_info", "Model facts", _ok(_OBJECT), tags=("admin",)),
    Operation(
        "get",
        "/get_server_info",
        "Resolved config and live accounting",
        _ok(_OBJECT),
        tags=("admin",),
    ),
    Operation(
        "post",
        "/abort_request",
        "Abort a request by rid, or all",
        _ok(_OBJECT),
        request=AbortRequest,
        example={"rid": "gen-0"},
        tags=("admin",),
    ),
    Operation("get", "/metrics", "Prometheus metrics", _ok(Body(None, TEXT)), tags=("admin",)),
    # ---- lifecycle (http_lifecycle) ----
    Operation(
        "post",
        "/update_weights_from_disk",
        "Load a same-architecture checkpoint",
        {"200": (Body(Outcome),), "400": (Body(Outcome), Body(ErrorEnvelope))},
        request=UpdateWeightsRequest,
        description="A refused checkpoint (400, success false) leaves the old weights serving.",
        tags=("lifecycle",),
    ),
    Operation(
        "post",
        "/flush_cache",
        "Empty the prefix cache once idle",
        {"200": (Body(Outcome),), "409": (Body(Outcome),)},
        query=(
            Query(
                "timeout",
                {"type": "number", "minimum": 0},
                "seconds to wait for the engine to become idle (default 30)",
            ),
        ),
        tags=("lifecycle",),
    ),
    Operation(
        "post",
        "/pause_generation",
        "Pause: new requests queue, running ones keep their KV",
        _ok(Body(Outcome)),
        tags=("lifecycle",),
    ),
    Operation(
        "post",
        "/continue_generation",
        "Continue generating",
        _ok(Body(Outcome)),
        tags=("lifecycle",),
    ),
    # ---- sessions (http_sessions, ws_sessions) ----
    Operation(
        "post",
        "/open_session",
        "Open a streaming session",
        _ok(Body(OpenSessionResponse)),
        request=OpenSessionRequest,
        example={"timeout_s": 1.0},
        tags=("sessions",),
    ),
    Operation(
        "post",
        "/close_session",
        "Close a session",
        _ok(Body(CloseSessionResponse)),
        request=CloseSessionRequest,
        tags=("sessions",),
    ),
    Operation(
        "get",
        "/v1/sessions/ws",
        "A streaming session over a websocket",
        {"101": ()},
        description=(
            "Upgrades to a websocket: one JSON object per text frame, client messages "
            "#/components/schemas/ClientMessage, server messages "
            "#/components/schemas/ServerMessage (see api/ws_protocol.py). Without the "
            "upgrade headers: 400."
        ),
        tags=("sessions",),
    ),
    # ---- this document ----
    Operation("get", "/openapi.json", "This document", _ok(_OBJECT), tags=("meta",)),
)


def document(operations: tuple[Operation, ...] = OPERATIONS, api_key: bool = False) -> Any:
    """The OpenAPI 3.1 document for `operations` (with bearer auth when a key is set)."""
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
        paths.setdefault(op.path, {})[op.method] = _operation(op, schema_of, api_key)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "shoal", "version": "0.1.0"},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _key(kind: Any) -> str:
    return repr(kind)  # types like `A | B` are not all hashable; their repr is stable


def _operation(op: Operation, schema_of: Mapping[str, Any], api_key: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "operationId": f"{op.method}_{op.path.strip('/').replace('/', '_').replace('.', '_')}",
        "summary": op.summary,
        "tags": list(op.tags),
        "responses": {
            status: _response(status, bodies, schema_of) for status, bodies in op.responses.items()
        },
    }
    out["responses"]["default"] = {
        "description": "an error, in the one error shape (see api/http_errors.py)",
        "content": {JSON: {"schema": schema_of[_key(ErrorEnvelope)]}},
    }
    if op.description:
        out["description"] = op.description
    if op.request is not None:
        out["requestBody"] = {
            "required": True,
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
    if api_key and op.path != "/health":
        out["security"] = [{"bearer": []}]
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
    """Serves the document, encoded once."""

    def __init__(self, api_key: bool) -> None:
        self.body = msgspec.json.encode(document(api_key=api_key))

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/openapi.json", self.openapi)]

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self.body, content_type=JSON)
