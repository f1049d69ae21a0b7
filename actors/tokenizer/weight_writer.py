"""A weight update's work, run by the tokenizer actor as a task of its own once the update
lock (actors/tokenizer/update_lock.py) lets its writer start: park paused requests (if asked), load,
flush. Whatever happens, it ends by posting WriteDone to the tokenizer's mailbox, where the
lock learns that its writer is done.
"""

from __future__ import annotations

import asyncio

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import (
    CacheMsg,
    ExecutorMsg,
    FlushCache,
    LoadWeights,
    Park,
    SchedulerMsg,
    TokenizerMsg,
    UpdateWeights,
    WriteDone,
)
from shoal.results import InternalError


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


class WeightWriter:
    """Runs one writer at a time (the lock starts at most one) and reports its end."""

    def __init__(
        self,
        done: Mailbox[TokenizerMsg],
        scheduler: Mailbox[SchedulerMsg],
        executor: Mailbox[ExecutorMsg],
        cache: Mailbox[CacheMsg],
    ) -> None:
        self.done = done
        self.scheduler = scheduler
        self.executor = executor
        self.cache = cache
        self.task: asyncio.Task[None] | None = None

    def start(self, writer: UpdateWeights, park: bool) -> None:
        self.task = asyncio.create_task(self.write(writer, park))

    async def write(self, writer: UpdateWeights, park: bool) -> None:
        """Run the writer's work; report back through the mailbox whatever happens."""
        error: str | None = "the weight update was interrupted"
        try:
            error = await write_weights(writer, park, self.scheduler, self.executor, self.cache)
        except InternalError as exc:  # a step of it failed (see actors/supervise.py)
            error = str(exc)
        finally:
            self.done.put(WriteDone(error))

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
