"""Request bodies in, response bodies out: msgspec typed structs, never hand-walked dicts.

    body = await decode_body(request, ChatCompletionRequest)   # ApiError 400 / 413 if bad
    return json_response(ChatCompletion(...))

Invalid UTF-8, a lone surrogate escape (`"\\ud800"`), malformed JSON and a value of the wrong
type are all answered 400 naming what is wrong; a body over the app's `client_max_size` is 413.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from shoal.api.http_errors import JSON, bad_request, from_validation

T = TypeVar("T")

_LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


async def decode_body(request: web.Request, kind: type[T]) -> T:
    raw = await request.read()  # raises HTTPRequestEntityTooLarge (413) past client_max_size
    return decode_bytes(raw, kind)


def decode_bytes(raw: bytes, kind: type[T]) -> T:
    if not raw.strip():
        raise bad_request("the request body is empty: send a JSON object")
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None
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
