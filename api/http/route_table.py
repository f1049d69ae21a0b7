"""Every route the server answers, declared once: its method, path, handler, request and
response types, who may ask (access) and whether it generates. The app serves this table
(routing.add_routes), /openapi.json documents it (openapi.py), the guard checks its access
(guard.py) and the disaggregation fields' middleware knows its generations from it
(bootstrap_fields.RoomRefusals). tests/api/http/test_http_openapi.py fails if a served route is
missing from /openapi.json, or listed but not served.

A new route: its handler, a method of a route class (a new class: one line in
Server._build_app), and its row here. Not declared, a POST needs the admin key
(routing.Route.needs): a route any API client may call says access="key".
"""

from __future__ import annotations

from typing import Any

from shoal.api.http.admin import AdminRoutes
from shoal.api.http.errors import ErrorEnvelope
from shoal.api.http.lifecycle import (
    LifecycleRoutes,
    Outcome,
    PauseRequest,
    UpdateWeightsRequest,
)
from shoal.api.http.loads import LoadRoutes, Loads
from shoal.api.http.native import NativeRoutes
from shoal.api.http.native_protocol import AbortRequest, GenerateRequest, GenerateResponse
from shoal.api.http.openai_protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    ModelList,
    TextCompletion,
)
from shoal.api.http.openai_routes import OpenAIRoutes
from shoal.api.http.openapi import OpenAPIRoute
from shoal.api.http.routing import SSE, TEXT, Body, Query, Route, ok
from shoal.api.http.sessions import (
    CloseSessionRequest,
    CloseSessionResponse,
    OpenSessionRequest,
    OpenSessionResponse,
    SessionRoutes,
)
from shoal.api.http.ws_sessions import SessionSockets

_STREAMED = (
    "With `stream: true` the answer is SSE: `data: <chunk>` ... `data: [DONE]`, with a comment "
    "line `: keep-alive` whenever nothing was sent for sse_keepalive_s."
)
_OBJECT = Body(dict[str, Any])

ROUTES: tuple[Route, ...] = (
    # ---- OpenAI-compatible (openai_routes) ----
    Route(
        method="POST",
        path="/v1/chat/completions",
        handler=OpenAIRoutes.chat,
        summary="Chat completion (OpenAI)",
        responses=ok(Body(ChatCompletion), Body(ChatCompletionChunk, SSE)),
        request=ChatCompletionRequest,
        access="key",
        generates=True,
        example={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
        description=_STREAMED + " With session_params: an open session's next turn.",
        tags=("openai",),
    ),
    Route(
        method="POST",
        path="/v1/completions",
        handler=OpenAIRoutes.completions,
        summary="Text completion (OpenAI)",
        responses=ok(Body(TextCompletion), Body(TextCompletion, SSE)),
        request=CompletionRequest,
        access="key",
        generates=True,
        example={"prompt": "Once upon a time", "max_tokens": 8},
        description=_STREAMED,
        tags=("openai",),
    ),
    Route(
        method="GET",
        path="/v1/models",
        handler=OpenAIRoutes.models,
        summary="The served model names",
        responses=ok(Body(ModelList)),
        tags=("openai",),
    ),
    # ---- native (native) ----
    Route(
        method="POST",
        path="/generate",
        handler=NativeRoutes.generate,
        summary="Generate (SGLang's native route)",
        responses=ok(Body(GenerateResponse | list[GenerateResponse]), Body(GenerateResponse, SSE)),
        request=GenerateRequest,
        access="key",
        generates=True,
        example={"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        description="One prompt answers one object, a batch a list. "
        + _STREAMED
        + " Each event carries the text, output_ids and logprobs so far (with "
        "incremental_streaming_output: only what is new since the previous event).",
        tags=("native",),
    ),
    # ---- admin (admin) ----
    Route(
        method="GET",
        path="/health",
        handler=AdminRoutes.health,
        summary="Alive (no API key needed)",
        responses=ok(_OBJECT),
        access="open",
        tags=("admin",),
    ),
    Route(
        method="GET",
        path="/health_generate",
        handler=AdminRoutes.health_generate,
        summary="Alive and generating",
        responses=ok(_OBJECT),
        tags=("admin",),
    ),
    Route(
        method="GET",
        path="/v1/loads",
        handler=LoadRoutes.loads,
        summary="Requests running and waiting, KV tokens used (SGLang's core load fields)",
        responses=ok(Body(Loads)),
        query=(
            Query("include", {"type": "string"}, "SGLang's sections, comma-separated"),
            Query("dp_rank", {"type": "integer", "minimum": 0}, "a data-parallel rank (0)"),
            Query("format", {"type": "string", "enum": ["json"]}, "json"),
        ),
        tags=("admin",),
    ),
    Route(
        method="GET",
        path="/get_model_info",
        handler=AdminRoutes.model_info,
        summary="Model facts",
        responses=ok(_OBJECT),
        tags=("admin",),
    ),
    Route(
        method="GET",
        path="/get_server_info",
        handler=AdminRoutes.server_info,
        summary="Resolved config and live accounting",
        responses=ok(_OBJECT),
        tags=("admin",),
    ),
    Route(
        method="POST",
        path="/abort_request",
        handler=AdminRoutes.abort_request,
        summary="Abort a request by rid, or all",
        responses=ok(_OBJECT),
        request=AbortRequest,
        example={"rid": "gen-0"},
        tags=("admin",),
    ),
    Route(
        method="GET",
        path="/metrics",
        handler=AdminRoutes.prometheus,
        summary="Prometheus metrics",
        responses=ok(Body(None, TEXT)),
        tags=("admin",),
    ),
    # ---- lifecycle (lifecycle) ----
    Route(
        method="POST",
        path="/update_weights_from_disk",
        handler=LifecycleRoutes.update_weights,
        summary="Load a same-architecture checkpoint",
        responses={"200": (Body(Outcome),), "400": (Body(Outcome), Body(ErrorEnvelope))},
        request=UpdateWeightsRequest,
        description="A refused checkpoint (400, success false) leaves the old weights serving.",
        tags=("lifecycle",),
    ),
    # GET too, as SGLang serves it (verl and slime call GET); admin either way: it changes
    # the engine's state, whatever the method
    *(
        Route(
            method=method,
            path="/flush_cache",
            handler=LifecycleRoutes.flush_cache,
            summary="Empty the prefix cache once idle",
            access="admin",
            responses={"200": (Body(Outcome),), "409": (Body(Outcome),)},
            query=(
                Query(
                    "timeout",
                    {"type": "number", "minimum": 0},
                    "seconds to wait for the engine to become idle (default 30)",
                ),
            ),
            tags=("lifecycle",),
        )
        for method in ("POST", "GET")
    ),
    Route(
        method="POST",
        path="/pause_generation",
        handler=LifecycleRoutes.pause,
        summary="Pause: new requests queue; running ones end, give their KV back or stop",
        responses=ok(Body(Outcome)),
        request=PauseRequest,
        body_optional=True,  # SGLang's clients send {} or nothing: the default mode
        example={"mode": "abort"},
        tags=("lifecycle",),
    ),
    Route(
        method="POST",
        path="/continue_generation",
        handler=LifecycleRoutes.resume,
        summary="Continue generating",
        responses=ok(Body(Outcome)),
        tags=("lifecycle",),
    ),
    # ---- sessions (sessions, ws_sessions) ----
    Route(
        method="POST",
        path="/open_session",
        handler=SessionRoutes.open_session,
        summary="Open a streaming session",
        responses=ok(Body(OpenSessionResponse)),
        request=OpenSessionRequest,
        access="key",
        example={"timeout_s": 1.0},
        tags=("sessions",),
    ),
    Route(
        method="POST",
        path="/close_session",
        handler=SessionRoutes.close_session,
        summary="Close a session",
        responses=ok(Body(CloseSessionResponse)),
        request=CloseSessionRequest,
        access="key",
        tags=("sessions",),
    ),
    Route(
        method="GET",
        path="/v1/sessions/ws",
        handler=SessionSockets.connect,
        summary="A streaming session over a websocket",
        responses={"101": ()},
        description=(
            "Upgrades to a websocket: one JSON object per text frame, client messages "
            "#/components/schemas/ClientMessage, server messages "
            "#/components/schemas/ServerMessage (see api/http/ws_protocol.py). Without the "
            "upgrade headers: 400."
        ),
        tags=("sessions",),
    ),
    # ---- this document ----
    Route(
        method="GET",
        path="/openapi.json",
        handler=OpenAPIRoute.openapi,
        summary="This document",
        responses=ok(_OBJECT),
        tags=("meta",),
    ),
)
