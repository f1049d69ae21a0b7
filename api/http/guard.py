"""What a request must show before any handler runs: its host, its origin, its content type,
its key.

A web page the operator opens must not be able to drive the server through the operator's
browser (a cross-site form POST to /pause_generation, a fetch() to /flush_cache). Browsers
mark such requests with `Origin` (every POST, every CORS fetch, every websocket upgrade) and
can only send them without a CORS preflight (which shoal never grants) when the body is a form
or text. And a page whose name was re-pointed at this server (DNS rebinding) is same-origin
with itself, so the Host header it sends must first be one this server is reached by. So, in
this order (middlewares, after the draining check):

    host     Host not an IP literal, localhost, the bound name or in --allowed-hosts ("*": any;
             absent: allowed) -> 403 (api/http/hosts.py), on every route, /health and the
             websocket upgrade among them
    origin   Origin present and not the server's own (scheme://host:port of the Host header,
             default ports filled in) nor in --allowed-origins ("*": any)      -> 403
             Origin absent and `Sec-Fetch-Site: cross-site`, unless "*" is allowed -> 403
             Origin absent otherwise (curl, SDKs, same-origin navigation)      -> allowed
    key      a route whose access is "admin" (route_table.py; a POST not declared otherwise),
             with an admin key set: `Authorization: Bearer <admin key>`, else 401 (403 for
             the plain API key); other routes but "open" ones (and unknown paths) with an API
             key set: the API key or the admin key, else 401
    type     a request other than GET / HEAD / OPTIONS that has a body must name
             Content-Type: application/json (parameters allowed)           -> else 415
             one without a body must not name a form or text type (what an HTML form
             sends: application/x-www-form-urlencoded, multipart/form-data, text/*) -> 415;
             no Content-Type, or another (aiohttp's client labels an empty POST
             application/octet-stream), passes: POST /pause_generation needs no body

All four answer before the handler reads the body, so a refused /update_weights_from_disk
says nothing about its path.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from yarl import URL

from shoal.api.http.errors import ApiError
from shoal.api.http.hosts import HostCheck
from shoal.api.http.routing import Route, access_by_path

ANY_ORIGIN = "*"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # never carry a body shoal reads
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data", "text/")


def origin_of(text: str) -> str | None:
    """'HTTP://Example.com' -> 'http://example.com:80'; None unless scheme://host[:port]."""
    try:
        url = URL(text.strip())
    except ValueError:
        return None
    if not url.absolute or url.user or url.password or url.query_string or url.fragment:
        return None
    if url.path not in ("", "/") or not url.host:
        return None
    port = "" if url.port is None else f":{url.port}"
    return f"{url.scheme.lower()}://{url.host.lower()}{port}"


def parse_origins(entries: Iterable[str]) -> frozenset[str]:
    """--allowed-origins entries, normalised: "*", "null" or an origin; ValueError otherwise."""
    allowed = set()
    for entry in entries:
        text = entry.strip()
        if text in (ANY_ORIGIN, "null"):
            allowed.add(text)
            continue
        origin = origin_of(text)
        if origin is None:
            raise ValueError(f"allowed origin {entry!r} is not '*', 'null' or scheme://host[:port]")
        allowed.add(origin)
    return frozenset(allowed)


class Guard:
    def __init__(
        self,
        api_key: str | None,
        admin_api_key: str | None,
        allowed_origins: Iterable[str],
        hosts: HostCheck,
        routes: Sequence[Route],
    ) -> None:
        self.access = access_by_path(routes)  # an unknown path: "key"
        self.api_key = api_key or None
        self.admin_api_key = admin_api_key or None
        self.allowed_origins = parse_origins(allowed_origins)
        self.hosts = hosts

    def middlewares(self) -> list[Middleware]:
        return [self.known_host, self.same_origin, self.authorize, self.json_only]

    @web.middleware
    async def known_host(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Host")  # not request.host: that falls back to our own name
        if not self.hosts.allows(given):
            assert given is not None
            raise ApiError(
                403,
                f"Host {given[:200]!r} is not a name this server is reached by (a guard against "
                "DNS rebinding): start the server with --allowed-hosts to serve it under that "
                "name",
                code="host_not_allowed",
            )
        return await handler(request)

    @web.middleware
    async def same_origin(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if ANY_ORIGIN not in self.allowed_origins:
            given = request.headers.get("Origin")
            if given is None:
                if request.headers.get("Sec-Fetch-Site", "").lower() == "cross-site":
                    raise ApiError(403, "cross-site request refused (Sec-Fetch-Site: cross-site)")
            elif not self._allowed(given, request):
                raise ApiError(
                    403,
                    f"Origin {given[:200]!r} is not this server's: "
                    "start the server with --allowed-origins to allow it",
                    code="origin_not_allowed",
                )
        return await handler(request)

    def _allowed(self, given: str, request: web.Request) -> bool:
        origin = origin_of(given)
        if origin is None:  # "null" (a sandboxed frame, a file), or garbage
            return given.strip() in self.allowed_origins
        own = origin_of(f"{request.scheme}://{request.host}")
        return origin == own or origin in self.allowed_origins

    @web.middleware
    async def authorize(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        access = self.access.get(_route(request), "key")
        given = request.headers.get("Authorization", "")
        if self.admin_api_key and access == "admin":
            if not _bearer(given, self.admin_api_key):
                if self.api_key and _bearer(given, self.api_key):
                    raise ApiError(403, "this route needs the admin key, not the API key")
                raise ApiError(
                    401, "missing or wrong admin key: send Authorization: Bearer <admin key>"
                )
        elif self.api_key and access != "open":
            admin = self.admin_api_key
            if not (_bearer(given, self.api_key) or (admin and _bearer(given, admin))):
                raise ApiError(
                    401, "missing or wrong API key: send the header Authorization: Bearer <key>"
                )
        return await handler(request)

    @web.middleware
    async def json_only(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        named = request.headers.get("Content-Type")
        if request.method not in SAFE_METHODS:
            media_type = (named or "").split(";", 1)[0].strip().lower()
            if media_type != "application/json" and (
                request.body_exists or media_type.startswith(FORM_TYPES)
            ):
                shown = f"got {named[:100]!r}" if named is not None else "got none"
                raise ApiError(
                    415,
                    f"send a JSON body with the header Content-Type: application/json ({shown})",
                    code="unsupported_media_type",
                )
        return await handler(request)


def _route(request: web.Request) -> str:
    """The matched route's path ('/flush_cache'), whatever spelling of it the client sent."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


def _bearer(given: str, key: str) -> bool:
    return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())
