"""The routes RL loops call between rollouts (docs/architecture.md, "Weight updates, cache flush
and pause").

    (the weight updates: api/http/weight_routes.py)
    POST /flush_cache?timeout=30    200 {"success": true, "message"} once the engine was idle,
                                    or 409 if it did not become idle in time (nothing changed);
                                    GET too, as SGLang serves it (verl and slime call GET)
    POST /pause_generation          {"mode": "abort" | "retract" | "in_place"} (SGLang's; default
                                    "abort", also for an empty body): new requests queue; the
                                    ones in the engine end with their partial output, give
                                    their KV back and wait, or stop where they are
    POST /continue_generation

A refusal carries both `success: false` (what SGLang clients check) and the error shape.
"""

from __future__ import annotations

import math

import msgspec
from aiohttp import web

from shoal.actors.writer_messages import PauseMode
from shoal.api.engine import Engine
from shoal.api.http.body import decode_body, json_response
from shoal.api.http.errors import ErrorBody, bad_request

DEFAULT_FLUSH_TIMEOUT_S = 30.0


class PauseRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    mode: PauseMode = "abort"  # SGLang's default: in-flight requests return at once


class Outcome(msgspec.Struct, frozen=True, omit_defaults=True):
    """The lifecycle routes' body on the wire: an UpdateResult or FlushResult (results.py) as
    the engine answered it, with the error's shape beside it when it failed."""

    success: bool
    message: str
    weight_version: str | None = None
    error: ErrorBody | None = None


class LifecycleRoutes:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def flush_cache(self, request: web.Request) -> web.Response:
        raw = request.query.get("timeout", str(DEFAULT_FLUSH_TIMEOUT_S))
        try:
            timeout_s = float(raw)
        except ValueError:
            timeout_s = math.nan
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise bad_request(
                f"timeout must be a number of seconds >= 0, got {raw!r}", param="timeout"
            )
        result = await self.engine.flush_cache(timeout_s)
        if result.success:
            return json_response(Outcome(True, result.message))
        return refusal(409, result.message, "timeout", "engine_busy")

    async def pause(self, request: web.Request) -> web.Response:
        body = await decode_body(request, PauseRequest, empty=PauseRequest())
        self.engine.pause_generation(body.mode)
        return json_response(Outcome(True, f"generation paused ({body.mode})"))

    async def resume(self, request: web.Request) -> web.Response:
        self.engine.continue_generation()
        return json_response(Outcome(True, "generation continues"))


def refusal(
    status: int, message: str, param: str, code: str, weight_version: str | None = None
) -> web.Response:
    error = ErrorBody(message, "invalid_request_error", param, code)
    return json_response(Outcome(False, message, weight_version, error), status=status)
