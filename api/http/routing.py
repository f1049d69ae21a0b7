"""What a route is, declared once (api/http/route_table.py holds every one), and the readers
of its facts: the app (`add_routes`), the guard (`Access`: `access_by_path`), /openapi.json
(openapi.py) and the disaggregation fields (bootstrap_fields.RoomRefusals: `generates`).

    Route("POST", "/v1/chat/completions", OpenAIRoutes.chat, "Chat completion (OpenAI)",
          ok(Body(ChatCompletion), Body(ChatCompletionChunk, SSE)),
          request=ChatCompletionRequest, access="key", generates=True)

A route's access is "open" (no key), "key" (the API key when one is set) or "admin" (the
admin key when one is set). Not declared, it follows the method: a route that can change the
engine's state (POST, PUT, PATCH, DELETE) needs the admin key, any other the API key. So a new
state-changing route is admin-guarded unless its declaration says otherwise.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

from shoal.api.http.errors import JSON

Access = Literal["open", "key", "admin"]
STRICTNESS: Mapping[Access, int] = {"open": 0, "key": 1, "admin": 2}
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SSE = "text/event-stream"
TEXT = "text/plain"
# A route class's method, unbound (OpenAIRoutes.chat): the server binds it to its instance.
Handler = Callable[[Any, web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Body:
    """A response body: its msgspec type (None: no schema, e.g. metrics text) and media type.
    For SSE the type is each event's JSON payload. Several bodies of one media type under
    one status are alternatives."""

    type: Any
    media_type: str = JSON


@dataclass(frozen=True)
class Query:
    name: str
    schema: Mapping[str, Any]
    description: str


def ok(*bodies: Body) -> Mapping[str, tuple[Body, ...]]:
    return {"200": bodies}


@dataclass(frozen=True, kw_only=True)
class Route:
    """One route's facts. `request` and the response bodies are the msgspec types its handler
    decodes and encodes (openapi.py turns them into schemas, so the document cannot drift from
    the wire); `example` is a request body that works (a test decodes it as `request`)."""

    method: str  # as HTTP spells it: "GET", "POST"
    path: str
    handler: Handler
    summary: str
    responses: Mapping[str, tuple[Body, ...]]  # status ("200", "101") -> its bodies
    request: Any = None  # the JSON body's type; None: no body
    body_optional: bool = False  # no body (or an empty one) is the type's defaults
    access: Access | None = None  # None: the method's default (see the module)
    generates: bool = False  # a generation request: a refusal ends its disaggregation rooms
    example: Any = None
    query: tuple[Query, ...] = ()
    description: str = ""
    tags: tuple[str, ...] = ()

    @property
    def needs(self) -> Access:
        """The key the route needs (when that key is set)."""
        if self.access is not None:
            return self.access
        return "admin" if self.method in STATE_CHANGING else "key"


def add_routes(app: web.Application, routes: Iterable[Route], owners: Iterable[object]) -> None:
    """Serve each route with its handler bound to the owner whose class defines it (a GET
    answers HEAD too, as aiohttp's own `web.get`)."""
    owners = list(owners)
    for route in routes:
        bound = _bind(route.handler, owners)
        if route.method == "GET":
            app.router.add_get(route.path, bound)
        else:
            app.router.add_route(route.method, route.path, bound)


def _bind(handler: Handler, owners: list[object]) -> Callable[[web.Request], Awaitable[Any]]:
    """The owner's method of the handler's name, looked up now (as `owner.method` would be:
    a test's patch of the class is honoured), on the owner of the class that defines it."""
    where = (handler.__module__, handler.__qualname__.rsplit(".", 1)[0])
    for owner in owners:
        kind = type(owner)
        if (kind.__module__, kind.__qualname__) == where:
            bound: Callable[[web.Request], Awaitable[Any]] = getattr(owner, handler.__name__)
            return bound
    raise ValueError(f"no route class given to the server defines {handler.__qualname__}")


def access_by_path(routes: Iterable[Route]) -> dict[str, Access]:
    """Each path's access, the strictest of its routes' (the guard answers before the method
    is matched: a GET of an admin route's path needs the admin key too)."""
    out: dict[str, Access] = {}
    for route in routes:
        known = out.get(route.path)
        if known is None or STRICTNESS[route.needs] > STRICTNESS[known]:
            out[route.path] = route.needs
    return out
