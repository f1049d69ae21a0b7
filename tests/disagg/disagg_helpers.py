"""What the disaggregation tests share: a free port on 127.0.0.1, and a wait for an engine's
transfer gauges (`Engine.transfer_counts`) to reach given counts.
"""

from __future__ import annotations

import asyncio
import socket

from shoal import Engine

NEW_TOKENS = 10
WAIT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for_counts(engine: Engine, **want: int) -> None:
    for _ in range(int(WAIT_S / 0.005)):
        counts = await engine.transfer_counts()
        if all(counts[state] == n for state, n in want.items()):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"transfer counts never reached {want}: {counts}")
