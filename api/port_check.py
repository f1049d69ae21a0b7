"""`serve` checks that it can listen where it was asked before it loads the model, so a second
server on a busy port fails in a second rather than after the start-up."""

from __future__ import annotations

import asyncio
import os


async def check_can_listen(host: str, port: int) -> None:
    """ValueError (one line) when `host`:`port` cannot be bound now: in use, an address this
    machine does not have, a name that does not resolve, a port it may not open.

    It binds as aiohttp's TCPSite will (loop.create_server, the same addresses and options) and
    closes at once, rather than keeping the socket for the server: the server module keeps its
    own way of listening, and a process that takes the port in the seconds of the start-up
    still fails the start when the server binds, as it did before. Port 0 always succeeds."""
    if port == 0:
        return
    loop = asyncio.get_running_loop()
    try:
        server = await loop.create_server(asyncio.Protocol, host, port)
    except OSError as exc:  # asyncio's strerror names the address again: the errno's alone
        code = exc.errno or 0  # a getaddrinfo error's is negative
        reason = os.strerror(code) if code > 0 else (exc.strerror or str(exc))
        raise ValueError(f"cannot listen on {host}:{port}: {reason.lower()}") from exc
    server.close()
    await server.wait_closed()
