"""Every HTTP error shoal answers has one shape, OpenAI's::

    {"error": {"message": "temperature must be in [0, 2], got 3.0",
               "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}}

`ApiError` carries it from wherever a handler finds the problem to the error middleware, which
also turns aiohttp's own errors (404, 405, 413) and any bug into this shape. Bad input is a 4xx,
never a 5xx: clients (the openai package among them) retry 5xx answers.

What the engine refuses arrives as a RequestError (a LimitExceeded is one) carrying a `code`, a
`field` and a `detail`: `refused` answers it with the status of its code (STATUS_OF, 400 for the
rest), the code itself, and the field in the door's name (`FieldNames`: each door's names of the
engine's fields), in the message too when the message names it (RequestError.spoken). No
status or field is read from message text, and no message is rewritten.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler

from shoal.results import Completion, EngineDeadError, InternalError, RequestError

log = logging.getLogger("shoal.http")

JSON = "application/json"
# What a client learns of a bug: never the exception, a path or a trace (the log has them).
INTERNAL = "internal error: the server log has the detail"
# What the metrics count for a request whose client went away before its answer was written
# (nginx's "client closed request"); the client never sees it.
CLIENT_GONE = 499


_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
_CODES = {
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_exceeded",
    CLIENT_GONE: "client_closed_request",
    500: "internal_error",
    503: "service_unavailable",
}

# Retry-After (seconds) on answers a client should retry later: saturated, or not serving.
RETRY_AFTER_S = {429: 1, 503: 5}

# Fields every door names as the engine does (SGLang's disaggregation fields).
BOOTSTRAP_FIELDS = {name: name for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}

# The status of each refusal's code (results.ErrorCode) that is not a plain 400.
STATUS_OF: dict[str, int] = {
    "session_not_found": 404,
    "session_busy": 409,
    "too_many_sessions": 429,
}


@dataclass(frozen=True)
class FieldNames:
    """A door's names of the engine's fields (a RequestError's `field`): its prompt's (the
    body's field that carried it: "messages", "prompt[1]", "input_ids"), its session's
    ("session_params.id"), and its sampling fields' as the body sent them ("max_tokens",
    "sampling_params.top_p": api/sampling_wire.py, wire_names). The request id and SGLang's
    disaggregation fields every door names as the engine does; any other field of a request
    is a part of its prompt."""

    prompt: str = "prompt"
    session: str = "session_id"
    sampling: Mapping[str, str] = field(default_factory=dict)

    def of(self, engine_field: str | None) -> str | None:
        if engine_field is None:
            return None
        if engine_field == "rid" or engine_field in BOOTSTRAP_FIELDS:
            return engine_field
        if engine_field == "session_id":
            return self.session
        return self.sampling.get(engine_field, self.prompt)


class ErrorBody(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(msgspec.Struct, frozen=True):
    error: ErrorBody


class ApiError(Exception):
    """An answer other than 2xx, raised from anywhere under a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _CODES.get(status, "invalid_value")
        self.headers = dict(headers or {})  # sent with the answer (a 405's Allow)

    @property
    def body(self) -> ErrorEnvelope:
        kind = _TYPES.get(self.status, "invalid_request_error")
        return ErrorEnvelope(ErrorBody(self.message, kind, self.param, self.code))

    def response(self) -> web.Response:
        headers = dict(self.headers)
        retry_after_s = RETRY_AFTER_S.get(self.status)
        if retry_after_s is not None:
            headers["Retry-After"] = str(retry_after_s)
        return web.Response(
            status=self.status,
            body=msgspec.json.encode(self.body),
            content_type=JSON,
            headers=headers or None,
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


_PATH = re.compile(r" - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`$")
_FIELD = re.compile(r"(missing required|unknown) field `(?P<field>[^`]+)`")


def from_validation(exc: msgspec.ValidationError) -> ApiError:
    """msgspec says "Expected `int`, got `str` - at `$.n`": answer 400 with param "n" (and
    "... - at `key` in `$.logit_bias`": param "logit_bias", of one of its keys)."""
    text = str(exc)
    match = _PATH.search(text)
    path = match["path"].lstrip(".") if match else ""
    message = text[: match.start()] if match else text
    if match and match["key"]:
        message += " for a key"
    field = _FIELD.search(message)
    if field is not None:
        path = f"{path}.{field['field']}" if path else field["field"]
    where = f" at {path!r}" if path else ""
    return bad_request(f"invalid request body{where}: {message}", path or None)


def refused(exc: RequestError, param: str | None) -> ApiError:
    """The answer to what the engine refused: the status of its code, the code, `param` (the
    field in the door's name) and its message, spoken in that name."""
    return ApiError(STATUS_OF.get(exc.code, 400), exc.spoken(param), param=param, code=exc.code)


def from_engine(exc: BaseException, names: FieldNames) -> ApiError:
    """Map what an engine request can raise onto 4xx / 503 / 500; a refused request's field
    is spoken as the door names it (`names`)."""
    if isinstance(exc, EngineDeadError):
        return ApiError(503, f"the engine is not serving: {exc}")
    if isinstance(exc, InternalError):  # its message names the part, never the exception
        return ApiError(500, f"{exc}; the server log has the detail")
    if isinstance(exc, RequestError):
        return refused(exc, names.of(exc.field))
    if isinstance(exc, ValueError):  # a refusal without a code: Engine.generate's own checks
        return bad_request(str(exc), names.prompt)
    log.error("request failed", exc_info=exc)
    return ApiError(500, INTERNAL)


def from_http_exception(exc: web.HTTPException, path: str) -> ApiError:
    status = exc.status
    if status == 404:
        return ApiError(404, f"no route {path!r}: see GET /v1/models, POST /v1/chat/completions")
    if status == 405:  # Allow lists the methods the route takes (RFC 9110 says it must)
        methods = exc.headers.get("Allow")
        takes = f" (it takes {methods})" if methods else ""
        allow = {"Allow": methods} if methods is not None else None
        return ApiError(405, f"method not allowed on {path!r}{takes}", headers=allow)
    if status == 413:
        return ApiError(413, f"request body too large: {exc.text or exc.reason}")
    return ApiError(status, exc.text or exc.reason or f"HTTP {status}")


def check_finished(completion: Completion, draining: bool) -> None:
    """Raise why a request that ended did not finish, as the answer's error: 500 for a failure
    of the server's; 400 for the caller's mistake found late (a disaggregated request the other
    server refused, code "peer_refused"); 503 for an abort by the shutdown."""
    if completion.finish_reason == "error":
        if completion.code is not None:
            raise ApiError(400, completion.message, code=completion.code)
        raise ApiError(500, f"generation failed: {completion.message}")
    if completion.finish_reason == "abort" and draining:
        raise ApiError(503, "the server is shutting down")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The outermost middleware: every failure leaves in the one error shape."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return from_http_exception(exc, request.path).response()
    except ConnectionError as exc:
        transport = request.transport
        if transport is not None and not transport.is_closing():  # not this client's
            log.exception("unhandled error on %s %s", request.method, request.path)
            return ApiError(500, INTERNAL).response()
        # The client is gone (a reset right after the last event, say): nobody to answer and
        # nothing wrong. Re-raised, aiohttp would log it as an error with a traceback; this
        # answer's write fails on the closed transport, which aiohttp takes quietly.
        log.debug("%s %s: the client went away (%s)", request.method, request.path, exc)
        return ApiError(CLIENT_GONE, "the client closed the connection").response()
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, INTERNAL).response()
