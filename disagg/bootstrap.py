"""The bootstrap handshake over HTTP: the prefill server listens, the decode server asks.

    POST   /shoal/pd/rooms/{room}   RoomRequest -> RoomResult   (long: answered once the
                                    room's KV is written, or failed; disagg/wire.py)
    DELETE /shoal/pd/rooms/{room}   -> CancelResult             (answered once no write for
                                    the room can still land)
    GET    /health

The server only parses and hands each call to its owner (the prefill side's transfer actor,
through `RoomHandlers`); a decode server whose connection drops while it waits is reported
through `gone`. The client returns what happened as a value: a RoomResult, or `Unreachable`
saying whether the peer is surely stopped (refused or reset: nothing of it can still write)
or only silent (a timeout: it may still write, so the room must be cancelled first).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import web

from shoal.disagg.wire import CancelResult, RoomRequest, RoomResult

log = logging.getLogger("shoal.disagg")
ROOMS = "/shoal/pd/rooms/"


@dataclass(frozen=True)
class RoomHandlers:
    register: Callable[[int, RoomRequest], Awaitable[RoomResult]]
    cancel: Callable[[int, str], Awaitable[None]]
    gone: Callable[[int], None]


class BootstrapServer:
    def __init__(self, handlers: RoomHandlers, host: str, port: int) -> None:
        self.handlers = handlers
        self.host, self.port = host, port
        self.runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Listen; the port actually bound (port 0 asks the OS for a free one)."""
        app = web.Application()
        app.router.add_post(ROOMS + "{room}", self._register)
        app.router.add_delete(ROOMS + "{room}", self._cancel)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
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
        try:
            body = msgspec.json.decode(await request.read(), type=RoomRequest)
        except msgspec.DecodeError as exc:
            return web.json_response({"error": f"bad room request: {exc}"}, status=400)
        try:
            result = await self.handlers.register(room, body)
        except asyncio.CancelledError:
            self.handlers.gone(room)  # the decode server went away while it waited
            raise
        return web.Response(body=msgspec.json.encode(result), content_type="application/json")

    async def _cancel(self, request: web.Request) -> web.Response:
        room = _room(request)
        await self.handlers.cancel(room, request.query.get("cause", "cancelled by the peer"))
        return web.Response(
            body=msgspec.json.encode(CancelResult(True)), content_type="application/json"
        )


def _room(request: web.Request) -> int:
    try:
        return int(request.match_info["room"])
    except ValueError as exc:
        raise web.HTTPBadRequest(text="room must be an integer") from exc


@dataclass(frozen=True)
class Unreachable:
    """The peer did not answer. `stopped`: refused or reset, so nothing of it can still write
    into our pages; else it may be alive and must be cancelled before they are reused."""

    why: str
    stopped: bool


async def ask_room(
    session: aiohttp.ClientSession,
    base_url: str,
    room: int,
    request: RoomRequest,
    timeout_s: float,
) -> RoomResult | Unreachable:
    url = f"{base_url}{ROOMS}{room}"
    try:
        async with session.post(
            url,
            data=msgspec.json.encode(request),
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            body = await response.read()
            if response.status != 200:
                return Unreachable(f"the prefill server answered {response.status}", True)
            return msgspec.json.decode(body, type=RoomResult)
    except TimeoutError:
        return Unreachable(f"no KV from the prefill server within {timeout_s:g}s", False)
    except (aiohttp.ClientConnectionError, msgspec.DecodeError) as exc:
        return Unreachable(f"the prefill server at {base_url} is unreachable: {exc}", True)


async def cancel_room(
    session: aiohttp.ClientSession, base_url: str, room: int, cause: str, timeout_s: float
) -> Unreachable | None:
    """None once the peer confirmed the room is stopped."""
    url = f"{base_url}{ROOMS}{room}"
    try:
        async with session.delete(
            url, params={"cause": cause}, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            await response.read()
            if response.status == 200:
                return None
            return Unreachable(f"the prefill server answered {response.status}", False)
    except TimeoutError:
        return Unreachable("the prefill server did not confirm the cancel", False)
    except aiohttp.ClientConnectionError as exc:
        return Unreachable(f"the prefill server is unreachable: {exc}", True)
