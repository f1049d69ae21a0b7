"""The model-update reader/writer lock, owned by the tokenizer actor (docs/architecture.md,
"Lifecycle laws", law 2).

    reader   one per admitted request, from admission until the scheduler reports that the
             cache manager released everything it held (not merely its last token sent)
    writer   one weight update at a time, in arrival order; while any writer waits or works,
             new requests queue here and are admitted when the last writer is done

So when a writer starts, no request holds a row, a page or a place in any batch (unless the
engine is paused, where the scheduler parks them first), and the flush after the load
cannot fail.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import (
    CacheMsg,
    ExecutorMsg,
    FlushCache,
    Generate,
    LoadWeights,
    Park,
    SchedulerMsg,
    UpdateWeights,
)


@dataclass
class UpdateLock:
    readers: set[str] = field(default_factory=set)
    writers: deque[UpdateWeights] = field(default_factory=deque)
    active: UpdateWeights | None = None
    queued: deque[Generate] = field(default_factory=deque)
    version: int = 0

    @property
    def writing(self) -> bool:
        """A writer waits or works: new requests must queue."""
        return self.active is not None or bool(self.writers)

    def next_writer(self, paused: bool) -> tuple[UpdateWeights, bool] | None:
        """The writer to start now and whether it must park paused requests first."""
        if self.active is not None or not self.writers:
            return None
        if self.readers and not paused:
            return None
        self.active = self.writers.popleft()
        return self.active, bool(self.readers)

    def finish(self, success: bool) -> UpdateWeights:
        writer = self.active
        assert writer is not None
        self.active = None
        if success:
            self.version = (
                writer.weight_version if writer.weight_version is not None else (self.version + 1)
            )
        return writer

    def release_queue(self) -> list[Generate]:
        """Requests that waited for the writers, once none is left."""
        if self.writing:
            return []
        out = list(self.queued)
        self.queued.clear()
        return out


async def write_weights(
    writer: UpdateWeights,
    park: bool,
    scheduler: Mailbox[SchedulerMsg],
    executor: Mailbox[ExecutorMsg],
    cache: Mailbox[CacheMsg],
) -> str | None:
    """The writer's work: park paused requests (if asked), load, flush. None, or why not."""
    loop = asyncio.get_running_loop()
    if park:
        parked: asyncio.Future[None] = loop.create_future()
        scheduler.put(Park(parked))
        await parked
    loaded: asyncio.Future[str | None] = loop.create_future()
    executor.put(LoadWeights(writer.model_path, loaded))
    error = await loaded
    if error is None:
        flushed: asyncio.Future[str | None] = loop.create_future()
        cache.put(FlushCache(flushed))
        error = await flushed
    return error
