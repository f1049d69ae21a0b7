"""Writes to a client that reads at its own pace, bounded so that one that stops reading
holds nothing: every streamed write (an SSE event, a websocket message) must be taken by the
connection within `write_timeout_s`, or the connection is cut and StreamStalled raised.

    policy = stream_policy(request)                # the app's STREAM_POLICY, set by the Server
    await write_within(lambda: response.write(data), request, policy)

A write waits only when the connection's buffers are full (the kernel's socket buffer, then
aiohttp's 64 KiB), so a client that reads slowly but steadily is never cut: only one that takes
nothing for `write_timeout_s`. Cutting resets the connection: the transport is aborted and
the socket closed with SO_LINGER 0, so neither aiohttp nor the kernel keeps its unsent bytes
(a graceful close would wait for the client to read them, megabytes through the window of a
client that does not read: minutes, or forever) and the client sees a reset. It raises
StreamStalled, a ConnectionError, which the handler treats as any client that went away:
its job is left, so its engine requests are aborted (api/http/gateway.py). aiohttp, told the
connection is lost, also cancels the handler (Server runs it with handler_cancellation), which
is what ends a handler that was waiting on the engine rather than writing (a keep-alive's
write was the one cut). One warning line says which client was cut; never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

log = logging.getLogger("shoal.http")

DEFAULT_WRITE_TIMEOUT_S = 30.0
DEFAULT_KEEPALIVE_S = 15.0
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, drops what is queued


def _nothing() -> None:
    return None


@dataclass(frozen=True, kw_only=True)
class StreamPolicy:
    """How streams are written; the Server's options (stream_write_timeout_s,
    sse_keepalive_s) and its metrics' count of cut clients."""

    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S  # a write not taken by then: cut
    keepalive_s: float = DEFAULT_KEEPALIVE_S  # SSE: a comment after this long without one; 0: none
    dropped: Callable[[], None] = field(default=_nothing, compare=False)  # counts each cut


STREAM_POLICY = web.AppKey("stream_policy", StreamPolicy)  # set by the Server


def stream_policy(request: web.Request) -> StreamPolicy:
    return request.app.get(STREAM_POLICY) or StreamPolicy()


class StreamStalled(ConnectionResetError):
    """The client took nothing for write_timeout_s; its connection is cut."""


async def write_within(
    write: Callable[[], Awaitable[object]],
    request: web.BaseRequest,
    policy: StreamPolicy,
    timeout_s: float | None = None,
) -> None:
    """Run one write (`write()` makes its awaitable); cut the connection and raise
    StreamStalled if it is not done within policy.write_timeout_s (or timeout_s, if sooner:
    the shutdown's)."""
    bound_s = (
        policy.write_timeout_s if timeout_s is None else min(timeout_s, policy.write_timeout_s)
    )
    try:
        async with asyncio.timeout(bound_s):
            await write()
    except TimeoutError:
        cut(request, policy, bound_s)
        raise StreamStalled(
            f"the client read nothing for {bound_s:g}s (stream_write_timeout_s)"
        ) from None


def cut(request: web.BaseRequest, policy: StreamPolicy, waited_s: float) -> None:
    """Abort the connection at once (unsent bytes dropped), count it and say so."""
    transport = request.transport
    if transport is None or (transport.is_closing() and not _closing_with_data(transport)):
        return  # already gone: not a cut of ours
    sock = transport.get_extra_info("socket")
    if sock is not None:  # reset, not close: the kernel too drops the unsent bytes at once
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    transport.abort()
    policy.dropped()
    log.warning(
        "cut the stream of %s %s to %s: the client read nothing for %gs "
        "(stream_write_timeout_s); its requests are aborted",
        request.method,
        request.path,
        request.remote,
        waited_s,
    )


def _closing_with_data(transport: asyncio.BaseTransport) -> bool:
    """A transport closed gracefully (close(), not abort()) that still holds unsent bytes
    waits for the client to read them, forever if it never does: it must still be cut."""
    return isinstance(transport, asyncio.WriteTransport) and transport.get_write_buffer_size() > 0
