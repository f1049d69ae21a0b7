"""Streaming sessions over HTTP (docs/architecture.md, "Sessions"): open, then send each turn's
new input as an ordinary request carrying `session_params`, then close.

    POST /open_session {"timeout_s"?: 600, "max_tokens"?: null}  -> {"session_id": "session-..."}
    POST /generate {"input_ids" | "text": <only the new input>, "session_params": {"id": ...}, ...}
    POST /v1/chat/completions {"messages": [<only the new messages>], "session_params": {...}}
    POST /close_session {"session_id": ...}                       -> {"session_id", "success"}
                                                                     (404 if it is not open)

A turn of a session that is not open (never opened, closed, or reaped after timeout_s idle)
answers 404 code "session_not_found"; a turn while another streams answers 409 code
"session_busy" (streamed or not: a streaming turn's response starts only once it is admitted).
Opening is bounded: timeout_s at most max_session_timeout_s (longer: 400 naming the bound), and
at most max_sessions_per_client open sessions of one client, counted by its peer address (more:
429 "too_many_sessions", as past max_sessions), so no one client can hold every session.
A session turn is one prompt with one choice (a batch or n > 1: 400). Its max_tokens not
given is SamplingParams' default (not the room left); the engine measures the turn against the
whole history when it reaches the front of its line.
Closing is idempotent: a session already gone answers the same. Sessions opened here are the
client's: they are not closed when the server stops (they time out). The websocket
(ws_sessions) keeps one session per connection instead and closes it with the connection.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from shoal.api.http.body import decode_body, json_response
from shoal.api.http.errors import ApiError, FieldNames, bad_request, from_engine, refused
from shoal.api.http.gateway import Gateway
from shoal.api.http.limits import check_id
from shoal.api.http.native_protocol import SessionParams
from shoal.results import RequestError


class OpenSessionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    timeout_s: float | None = None
    max_tokens: int | None = None  # a cap on the whole history, inputs and outputs


class OpenSessionResponse(msgspec.Struct):
    session_id: str


class CloseSessionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    session_id: str


class CloseSessionResponse(msgspec.Struct):
    session_id: str
    success: bool


class SessionRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def open_session(self, request: web.Request) -> web.Response:
        body = await decode_body(request, OpenSessionRequest)
        session_id = await open_session(
            self.gateway, body.timeout_s, body.max_tokens, request.remote
        )
        return json_response(OpenSessionResponse(session_id))

    async def close_session(self, request: web.Request) -> web.Response:
        body = await decode_body(request, CloseSessionRequest)
        check_id(body.session_id, self.gateway.limits, "session_id")
        try:
            await self.gateway.engine.close_session(body.session_id)
        except Exception as exc:  # not open (never opened, closed or reaped): 404
            raise from_engine(exc, FieldNames()) from None
        return json_response(CloseSessionResponse(body.session_id, True))


async def open_session(
    gateway: Gateway, timeout_s: float | None, max_tokens: int | None, client: str | None
) -> str:
    """Open a session on the engine for `client` (the peer address): its id, or ApiError (400
    a bad option, 429 too many sessions open, or too many of this client's, 503 draining or
    the engine is not serving)."""
    if gateway.draining:
        raise ApiError(503, "the server is shutting down")
    try:
        session = await gateway.engine.open_session(timeout_s, max_tokens, client=client)
    except RequestError as exc:  # a bad option (400), or too many sessions open (429)
        raise refused(exc, exc.field) from None
    except Exception as exc:
        raise from_engine(exc, FieldNames()) from None
    return session.id


def session_turn(params: SessionParams, n: int = 1) -> str:
    """The session a request with session_params runs as the next turn of; 400 for what a
    turn cannot be."""
    for name in ("rid", "offset", "replace"):
        if getattr(params, name) not in (None, False):
            where = f"session_params.{name}"
            raise bad_request(f"{where} (branching a session) is not supported", where)
    if not params.id:
        raise bad_request("session_params.id must not be empty", "session_params.id")
    if n != 1:
        raise bad_request(f"a session turn has one choice: n must be 1, got {n}", "n")
    return params.id
