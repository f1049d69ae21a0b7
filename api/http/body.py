"""Request bodies in, response bodies out: msgspec typed structs, never hand-walked dicts.

    body = await decode_body(request, ChatCompletionRequest)   # ApiError 400 / 413 if bad
    return json_response(ChatCompletion(...))

Invalid UTF-8, a lone surrogate escape (`"\\ud800"`), malformed JSON and a value of the wrong
type are all answered 400 naming what is wrong; a body over the app's `client_max_size` is 413.
A body nesting arrays and objects deeper than the app's MAX_JSON_DEPTH (ServerOptions
.max_json_depth) is answered 400 code "json_too_deep" before it is decoded (json_depth.py).
A body that has not fully arrived within the app's BODY_TIMEOUT_S (ServerOptions.body_timeout_s)
is answered 408.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from shoal.api.http.errors import JSON, ApiError, bad_request, from_validation
from shoal.api.http.json_depth import DEFAULT_MAX_JSON_DEPTH, nests_deeper

T = TypeVar("T")

_LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
MAX_JSON_DEPTH = web.AppKey("max_json_depth", int)  # set by the Server from its options
BODY_TIMEOUT_S = web.AppKey("body_timeout_s", float)  # set by the Server from its options
DEFAULT_BODY_TIMEOUT_S = 30.0


async def decode_body(request: web.Request, kind: type[T], empty: T | None = None) -> T:
    """The body as `kind`; `empty`: what no body (or a blank one) means, else a 400."""
    timeout_s = request.app.get(BODY_TIMEOUT_S, DEFAULT_BODY_TIMEOUT_S)
    try:
        async with asyncio.timeout(timeout_s):  # a trickled body must not hold the handler
            raw = await request.read()  # HTTPRequestEntityTooLarge (413) past client_max_size
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {timeout_s:g}s (body_timeout_s)"
        ) from None
    if empty is not None and not raw.strip():
        return empty
    return decode_bytes(raw, kind, request.app.get(MAX_JSON_DEPTH, DEFAULT_MAX_JSON_DEPTH))


def decode_bytes(raw: bytes, kind: type[T], max_json_depth: int = DEFAULT_MAX_JSON_DEPTH) -> T:
    if not raw.strip():
        raise bad_request("the request body is empty: send a JSON object")
    if nests_deeper(raw, max_json_depth):
        raise too_deep("the request body", max_json_depth)
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None
    except RecursionError:  # not reached past the depth check; never a 500 if it is
        raise too_deep("the request body", max_json_depth) from None
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8: {exc.reason}") from None
    except msgspec.DecodeError as exc:
        where = _lone_surrogate_at(raw) if _LONE_SURROGATE.search(raw) else None
        if where is not None:
            raise bad_request(
                f"{where or 'the request body'} has a lone UTF-16 surrogate escape (\\ud800 to "
                "\\udfff without its pair): strings must be valid Unicode",
                where or None,
            ) from None
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def too_deep(what: str, max_json_depth: int) -> ApiError:
    return bad_request(
        f"{what} nests arrays and objects deeper than the limit of {max_json_depth} levels "
        "(max_json_depth)",
        None,
        "json_too_deep",
    )


def _lone_surrogate_at(raw: bytes) -> str | None:
    """Where the first lone surrogate is ("messages[0].content"), if that is all that is wrong.

    msgspec refuses lone surrogates outright; the standard library keeps them, which lets us
    name the field for the error message (only on this error path).
    """
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None
    return _find_surrogate(parsed, "")


def _find_surrogate(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        return path if any(0xD800 <= ord(ch) <= 0xDFFF for ch in value) else None
    items: Any = ()
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    for where, item in items:
        found = _find_surrogate(item, where)
        if found is not None:
            return found
    return None


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(payload), content_type=JSON)


def encode(payload: Any) -> bytes:
    return msgspec.json.encode(payload)
