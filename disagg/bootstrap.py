"""The bootstrap handshake over HTTP: the prefill server listens, the decode server asks.

    POST   /shoal/pd/rooms/{room}   RoomRequest -> RoomResult   (long: answered once the
                                    room's KV is written, or failed; disagg/wire.py)
    DELETE /shoal/pd/rooms/{room}   -> CancelResult             (answered once no write for
                                    the room can still land)
    GET    /health

The server only parses and hands each call to its owner (the prefill side's transfer actor,
through `RoomHandlers`); a decode server whose connection drops while it waits is reported
through `gone`. What the listener refuses, it refuses as the main HTTP app does: `ListenerRules`,
handed in by the api side (api/http/bootstrap_listener.py), bring that app's error middleware
and shape, its body limits and its key (with a key set, every route but /health needs
`Authorization: Bearer <key>`; the decode side sends it). A body that is no decode server's
(`RoomRequest.problem`) or a room number out of range is a 400 before any room opens.

The client returns what happened as a value: a RoomResult, or `Unreachable` saying whether
the peer is surely stopped (refused or reset: nothing of it can still write; or it refused the
call before any room opened) or only silent (a timeout: it may still write, so the room must
be cancelled first). Every call it makes is bounded by its timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

from shoal.disagg.wire import CancelResult, RoomRequest, RoomResult

log = logging.getLogger("shoal.disagg")
ROOMS = "/shoal/pd/rooms/"
MAX_CAUSE_CHARS = 1000  # of a cancel's cause, as it is passed on


@dataclass(frozen=True)
class RoomHandlers:
    register: Callable[[int, RoomRequest], Awaitable[RoomResult]]
    cancel: Callable[[int, str], Awaitable[None]]
    gone: Callable[[int], None]


@dataclass(frozen=True)
class ListenerRules:
    """How the listener refuses, as the main HTTP app does (built by the api side):
    `middlewares`, outermost first, answer whatever a handler raises in the app's error
    shape and check the key; `read_room` reads and decodes a RoomRequest body within the
    app's limits (raising what the middlewares answer); the rest bound the connection."""

    middlewares: tuple[Middleware, ...]
    read_room: Callable[[web.Request], Awaitable[RoomRequest]]
    max_body_bytes: int
    header_timeout_s: float
    max_header_bytes: int
    max_headers: int


class BootstrapServer:
    def __init__(self, handlers: RoomHandlers, host: str, port: int, rules: ListenerRules) -> None:
        self.handlers = handlers
        self.host, self.port = host, port
        self.rules = rules
        self.runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Listen; the port actually bound (port 0 asks the OS for a free one)."""
        rules = self.rules
        app = web.Application(
            client_max_size=rules.max_body_bytes, middlewares=list(rules.middlewares)
        )
        app.router.add_post(ROOMS + "{room}", self._register)
        app.router.add_delete(ROOMS + "{room}", self._cancel)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=rules.header_timeout_s,
            max_line_size=rules.max_header_bytes,
            max_field_size=rules.max_header_bytes,
            max_headers=rules.max_headers,
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _register(self, request: web.Request) -> web.Response:
        room = _room(request)
        body = await self.rules.read_room(request)
        problem = body.problem()
        if problem is not None:
            raise web.HTTPBadRequest(text=f"not a decode server's room request: {problem}")
        try:
            result = await self.handlers.register(room, body)
        except asyncio.CancelledError:
            self.handlers.gone(room)  # the decode server went away while it waited
            raise
        return web.Response(body=msgspec.json.encode(result), content_type="application/json")

    async def _cancel(self, request: web.Request) -> web.Response:
        room = _room(request)
        cause = request.query.get("cause", "cancelled by the peer")[:MAX_CAUSE_CHARS]
        await self.handlers.cancel(room, cause)
        return web.Response(
            body=msgspec.json.encode(CancelResult(True)), content_type="application/json"
        )


def _room(request: web.Request) -> int:
    text = request.match_info["room"]
    if not (text.isascii() and text.isdigit() and len(text) <= 19 and int(text) < 2**63):
        raise web.HTTPBadRequest(text="the room must be an integer in [0, 2**63)")
    return int(text)


@dataclass(frozen=True)
class Unreachable:
    """The peer did not answer. `stopped`: refused or reset, so nothing of it can still write
    into our pages; else it may be alive and must be cancelled before they are reused."""

    why: str
    stopped: bool


def key_headers(key: str | None) -> dict[str, str]:
    """What every call to a prefill server's listener carries: its key, when one is set."""
    return {} if key is None else {"Authorization": f"Bearer {key}"}


async def ask_room(
    session: aiohttp.ClientSession,
    base_url: str,
    room: int,
    request: RoomRequest,
    timeout_s: float,
    key: str | None = None,
) -> RoomResult | Unreachable:
    url = f"{base_url}{ROOMS}{room}"
    try:
        async with session.post(
            url,
            data=msgspec.json.encode(request),
            headers={"Content-Type": "application/json", **key_headers(key)},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            body = await response.read()
            if response.status != 200:  # refused before a room opened: nothing will write
                return Unreachable(_refusal(response.status, body), True)
            return msgspec.json.decode(body, type=RoomResult)
    except TimeoutError:
        return Unreachable(f"no KV from the prefill server within {timeout_s:g}s", False)
    except (aiohttp.ClientConnectionError, msgspec.DecodeError) as exc:
        return Unreachable(f"the prefill server at {base_url} is unreachable: {exc}", True)


async def cancel_room(
    session: aiohttp.ClientSession,
    base_url: str,
    room: int,
    cause: str,
    timeout_s: float,
    key: str | None = None,
) -> Unreachable | None:
    """None once the peer confirmed the room is stopped."""
    url = f"{base_url}{ROOMS}{room}"
    try:
        async with session.delete(
            url,
            params={"cause": cause[:MAX_CAUSE_CHARS]},
            headers=key_headers(key),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            body = await response.read()
            if response.status == 200:
                return None
            return Unreachable(_refusal(response.status, body), False)
    except TimeoutError:
        return Unreachable("the prefill server did not confirm the cancel", False)
    except aiohttp.ClientConnectionError as exc:
        return Unreachable(f"the prefill server is unreachable: {exc}", True)


class _ErrorBody(msgspec.Struct):
    message: str = ""


class _ErrorEnvelope(msgspec.Struct):
    error: _ErrorBody


def _refusal(status: int, body: bytes) -> str:
    """The listener's answer other than 200, for the decode server's caller and log."""
    try:
        message = msgspec.json.decode(body, type=_ErrorEnvelope).error.message
    except msgspec.DecodeError:
        message = ""
    hint = ": give both servers the same --api-key" if status == 401 else ""
    said = f" ({message[:300]})" if message else ""
    return f"the prefill server's bootstrap endpoint answered {status}{said}{hint}"
