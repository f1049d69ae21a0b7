"""The routes RL loops call between rollouts (docs/architecture.md, "Weight updates, cache flush
and pause").

    POST /update_weights_from_disk  {"model_path", "abort_all_requests"?, "weight_version"? (a
                                    number, or a string of digits as slime sends it),
                                    "load_format"? (auto, safetensors), "flush_cache"? (true)}
                                    200 {"success": true, "message", "weight_version"}, or 400
                                    with success false and the reason (old weights still serve)
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

from shoal.actors.messages import PauseMode
from shoal.api.engine import Engine
from shoal.api.http.body import decode_body, json_response
from shoal.api.http.errors import ErrorBody, bad_request
from shoal.api.http.limits import HttpLimits, check_chars

DEFAULT_FLUSH_TIMEOUT_S = 30.0


LOAD_FORMATS = (None, "auto", "safetensors")  # a Hugging Face folder's safetensors


class UpdateWeightsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_path: str
    abort_all_requests: bool = False
    # SGLang's type is a string (slime sends str(step)); shoal numbers its weights, so a
    # string of digits is taken as its number and any other string refused
    weight_version: int | str | None = None
    load_format: str | None = None  # SGLang's: only what a folder of safetensors is
    flush_cache: bool | None = None  # SGLang's: true only, the prefix cache always goes

    def version(self) -> int | None:
        """The weight version asked for, as a number (a 400 for one that is not)."""
        given = self.weight_version
        if isinstance(given, str):
            if not given.isdigit() or not given.isascii() or len(given) > 18:
                why = f"weight_version must be an integer >= 0 or a string of digits, got {given!r}"
                raise bad_request(why, param="weight_version")
            return int(given)
        if given is not None and not 0 <= given < 2**63:
            raise bad_request("weight_version must be in [0, 2**63)", param="weight_version")
        return given

    def check_options(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise bad_request(
                f"load_format {self.load_format!r} is not supported: shoal loads a folder of "
                "safetensors (load_format auto or safetensors)",
                param="load_format",
            )
        if self.flush_cache is False:
            raise bad_request(
                "flush_cache false is not supported: the prefix cache is always flushed with "
                "new weights, so KV computed by the old weights never serves the new ones",
                param="flush_cache",
            )


class PauseRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    mode: PauseMode = "abort"  # SGLang's default: in-flight requests return at once


class Outcome(msgspec.Struct, frozen=True, omit_defaults=True):
    """The four routes' body on the wire: an UpdateResult or FlushResult (results.py) as the
    engine answered it, with the error's shape beside it when it failed."""

    success: bool
    message: str
    weight_version: int | None = None
    error: ErrorBody | None = None


class LifecycleRoutes:
    def __init__(self, engine: Engine, limits: HttpLimits | None = None) -> None:
        self.engine = engine
        self.limits = limits or HttpLimits()

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await decode_body(request, UpdateWeightsRequest)
        max_chars = self.limits.max_path_chars
        check_chars(len(body.model_path), max_chars, "model_path", "max_path_chars")
        if not body.model_path.strip():
            raise bad_request("model_path must not be empty", param="model_path")
        body.check_options()
        result = await self.engine.update_weights_from_disk(
            body.model_path, body.abort_all_requests, body.version()
        )
        if result.success:
            return json_response(Outcome(True, result.message, result.weight_version))
        return refusal(
            400, result.message, "model_path", "invalid_checkpoint", result.weight_version
        )

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
    status: int, message: str, param: str, code: str, weight_version: int | None = None
) -> web.Response:
    error = ErrorBody(message, "invalid_request_error", param, code)
    return json_response(Outcome(False, message, weight_version, error), status=status)
