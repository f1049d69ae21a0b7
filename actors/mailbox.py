"""A typed mailbox: the only way into an actor."""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

M = TypeVar("M")


class Mailbox(Generic[M]):
    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: asyncio.Queue[M] = asyncio.Queue()

    def put(self, msg: M) -> None:
        self._queue.put_nowait(msg)

    async def get(self) -> M:
        return await self._queue.get()

    def empty(self) -> bool:
        return self._queue.empty()

    def drain(self) -> list[M]:
        """Take every message still queued (used only when the engine dies)."""
        items = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items
