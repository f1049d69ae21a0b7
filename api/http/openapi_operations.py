"""The table /openapi.json is built from: one row per (method, path) the app serves.

    Operation(method, path, summary, responses={"200": (Body(ChatCompletion), ...)},
              request=ChatCompletionRequest, query=(Query(...),), example={...})

Each request and response type named here is the msgspec type its handler decodes or
encodes (openapi.py turns them into schemas, so the document cannot drift from the wire).
Handlers that answer a plain dict (the admin routes) are documented as `dict[str, Any]`.
tests/test_http_openapi.py fails if a served route is missing here, or listed but not served.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shoal.api.http.errors import JSON, ErrorEnvelope
from shoal.api.http.lifecycle import Outcome, UpdateWeightsRequest
from shoal.api.http.native_protocol import AbortRequest, GenerateRequest, GenerateResponse
from shoal.api.http.openai_protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    ModelList,
    TextCompletion,
)
from shoal.api.http.sessions import (
    CloseSessionRequest,
    CloseSessionResponse,
    OpenSessionRequest,
    OpenSessionResponse,
)
from shoal.api.http.ws_protocol import ClientMessage, ServerMessage

SSE = "text/event-stream"
TEXT = "text/plain"
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


_STREAMED = (
    "With `stream: true` the answer is SSE: `data: <chunk>` ... `data: [DONE]`, with a comment "
    "line `: keep-alive` whenever nothing was sent for sse_keepalive_s."
)
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
        description="One prompt answers one object, a batch a list. "
        + _STREAMED
        + " Each event carries the text, output_ids and logprobs so far (with "
        "incremental_streaming_output: only what is new since the previous event).",
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
            "#/components/schemas/ServerMessage (see api/http/ws_protocol.py). Without the "
            "upgrade headers: 400."
        ),
        tags=("sessions",),
    ),
    # ---- this document ----
    Operation("get", "/openapi.json", "This document", _ok(_OBJECT), tags=("meta",)),
)
