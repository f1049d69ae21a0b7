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

from shoal.api.http.admin import AdminRoutes, WeightVersion
from shoal.api.http.lifecycle import LifecycleRoutes, Outcome, PauseRequest
from shoal.api.http.loads import LoadRoutes, Loads, RankLoad
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
from shoal.api.http.tokenize_routes import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizeRoutes,
)
from shoal.api.http.weight_route_table import WEIGHT_ROUTES
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
    # ---- the tokenizer (tokenize_routes) ----
    Route(
        method="POST",
        path="/tokenize",
        handler=TokenizeRoutes.tokenize,
        summary="Token ids of a prompt, prompts or chat messages (SGLang's and vLLM's)",
        responses=ok(Body(TokenizeResponse)),
        request=TokenizeRequest,
        access="key",
        example={"prompt": "Hello", "add_special_tokens": True},
        description="One of prompt (a string, or a list of them: one id list each) or "
        "messages (the chat template, add_generation_prompt true by default). "
        "add_special_tokens: true for a prompt, false for messages unless given. Counted with "
        "generation's limits; model, when given, must be the served name.",
        tags=("native",),
    ),
    Route(
        method="POST",
        path="/detokenize",
        handler=TokenizeRoutes.detokenize,
        summary="The text of token ids (SGLang's and vLLM's)",
        responses=ok(Body(DetokenizeResponse)),
        request=DetokenizeRequest,
        access="key",
        example={"tokens": [1, 2, 3]},
        description="The answer carries the text twice: `text` (SGLang's name) and `prompt` "
        "(vLLM's). A list of id lists answers a list of texts. An id outside the "
        "vocabulary, or more ids than the context length, is a 400.",
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
        path="/get_load",
        handler=LoadRoutes.rank_loads,
        summary="Requests and KV tokens per data-parallel rank (SGLang's older load route)",
        responses=ok(Body(list[RankLoad])),
        description="What sglang-router's GET /get_loads and power_of_two policy read.",
        tags=("admin",),
    ),
    *(
        Route(
            method="GET",
            path=path,
            handler=AdminRoutes.model_info,
            summary="Model facts" + alias,
            responses=ok(_OBJECT),
            tags=("admin",),
        )
        for path, alias in (("/get_model_info", ""), ("/model_info", " (SGLang's newer name)"))
    ),
    Route(
        method="GET",
        path="/get_weight_version",
        handler=AdminRoutes.get_weight_version,
        summary="The serving weights' version, a string",
        responses=ok(Body(WeightVersion)),
        description="`weight_version` as /generate's meta_info reports it, as a string.",
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
    *WEIGHT_ROUTES,
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
