"""SGLang's disaggregation fields on a generation request (docs/disaggregation.md): what its
router adds to the body it sends both the prefill and the decode server.

    "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 4120...
    (lists, one per generation, for a batch)

`bootstraps` turns them into one `Bootstrap` per engine request; `RoomRefusals` is the
middleware that ends the rooms of a generation request (a route the table says `generates`,
route_table.py) the server refuses before it reaches the engine (a 4xx), so the decode server
hears why at once instead of waiting out its timeout.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec
from aiohttp import web

from shoal.api.engine import Engine
from shoal.api.http.errors import ApiError, bad_request
from shoal.api.http.routing import Route
from shoal.params import Bootstrap

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's, when the router was given none (null)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RoomFields(msgspec.Struct, kw_only=True):
    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int | None] | None = None


def bootstraps(fields: RoomFields | None, count: int) -> list[Bootstrap | None]:
    """One Bootstrap (or None) per engine request of this body; 400 when the lists do not
    give one per generation."""
    if fields is None or fields.bootstrap_room is None:
        return [None] * count
    rooms = _per_request(fields.bootstrap_room, count, "bootstrap_room")
    hosts = _per_request(fields.bootstrap_host, count, "bootstrap_host")
    ports = _per_request(fields.bootstrap_port, count, "bootstrap_port")
    out: list[Bootstrap | None] = []
    for room, host, port in zip(rooms, hosts, ports, strict=True):
        if room is None:
            out.append(None)
            continue
        if not 0 <= room < 2**63:
            raise bad_request(f"bootstrap_room must be in [0, 2**63), got {room}", "bootstrap_room")
        if not host:
            raise bad_request("bootstrap_room needs a bootstrap_host", "bootstrap_host")
        port = DEFAULT_BOOTSTRAP_PORT if port is None else port
        if not 0 < port < 65536:
            raise bad_request(f"bootstrap_port must be a port, got {port}", "bootstrap_port")
        out.append(Bootstrap(host, port, room))
    return out


def _per_request(value: Any, count: int, name: str) -> list[Any]:
    if not isinstance(value, list):
        if count > 1 and name == "bootstrap_room":
            raise bad_request(
                f"{count} generations need {count} bootstrap rooms (a list), got one", name
            )
        return [value] * count
    if len(value) != count:
        raise bad_request(f"{name} has {len(value)} entries for {count} generations", name)
    return value


class RoomRefusals:
    """Inside the error middleware: a generation request refused with an error status ends
    the rooms its body named, with the refusal as the cause."""

    def __init__(self, engine: Engine, routes: Iterable[Route]) -> None:
        self.engine = engine
        self.generations = {(r.method, r.path) for r in routes if r.generates}

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            if (request.method, request.path) in self.generations:
                cause = f"the server refused the request ({exc.status}): {exc.message}"
                await self._drop(request, cause, refused=exc.status < 500)
            raise

    async def _drop(self, request: web.Request, cause: str, refused: bool) -> None:
        if self.engine.options.disaggregation_mode == "null":
            return
        try:
            fields = msgspec.json.decode(await request.read(), type=RoomFields)
            found = bootstraps(fields, _count(fields))
        except (msgspec.DecodeError, ApiError, web.HTTPException):
            return
        for bootstrap in found:
            if bootstrap is not None:
                self.engine.drop_room(bootstrap, cause, refused)


def _count(fields: RoomFields) -> int:
    rooms = fields.bootstrap_room
    return len(rooms) if isinstance(rooms, list) else 1
