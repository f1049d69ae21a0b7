"""The rules of a prefill server's bootstrap listener (disagg/bootstrap.py), made here so that
it refuses as the main HTTP app does: the same error shape and middleware (errors.py), the same
body decoding and limits (body.py: size, JSON depth, the body's time to arrive, types), the
same header limits, and the server's key.

    rules = listener_rules(key)      # Engine.start hands them to its BootstrapServer

With a key (serve's --api-key), every route but GET /health needs `Authorization: Bearer
<key>`: the decode server sends its own --api-key, so a pair shares one key. Any request
that carries `Origin` is refused (403): only a decode server calls the listener, never a web
page, so a page cannot drive it through a browser even where no key is set.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from shoal.api.http.body import decode_body
from shoal.api.http.errors import ApiError, error_middleware
from shoal.disagg.bootstrap import ListenerRules
from shoal.disagg.wire import RoomRequest

# The main app's defaults (ServerOptions): a RoomRequest is far below them.
MAX_BODY_BYTES = 32 * 2**20
HEADER_TIMEOUT_S = 60.0
MAX_HEADER_BYTES = 8190
MAX_HEADERS = 128
OPEN_PATHS = frozenset({"/health"})


def listener_rules(key: str | None) -> ListenerRules:
    """The listener's rules; `key`: the Bearer key every route but /health needs (None or
    empty: none)."""
    return ListenerRules(
        middlewares=(error_middleware, _guard(key or None)),
        read_room=_read_room,
        max_body_bytes=MAX_BODY_BYTES,
        header_timeout_s=HEADER_TIMEOUT_S,
        max_header_bytes=MAX_HEADER_BYTES,
        max_headers=MAX_HEADERS,
    )


async def _read_room(request: web.Request) -> RoomRequest:
    return await decode_body(request, RoomRequest)


def _guard(key: str | None) -> Middleware:
    expected = None if key is None else f"Bearer {key}".encode()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if "Origin" in request.headers:
            raise ApiError(403, "the bootstrap endpoint answers decode servers, not web pages")
        if expected is not None and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode(errors="surrogateescape")
            if not hmac.compare_digest(given, expected):
                raise ApiError(
                    401,
                    "missing or wrong key: a decode server sends its --api-key as "
                    "Authorization: Bearer <key>; give both servers the same one",
                )
        return await handler(request)

    return guard
