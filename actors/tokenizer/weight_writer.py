"""A writer's work (a weight update, or a memory release or resume), run by the tokenizer
actor as a task of its own once the update lock (actors/tokenizer/update_lock.py) lets it
start: park paused requests (if asked), load, flush. Whatever happens, it ends by posting
WriteDone to the tokenizer's mailbox, where the lock learns that its writer is done: with no
failure, or the typed one that stopped it (refused weights, a flush that found the books
broken, a step that failed).
"""

from __future__ import annotations

import asyncio
from functools import partial

from shoal.actors.executor_messages import ExecutorMsg, LoadWeights, SetMemory
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import CacheMsg, FlushCache, Park, SchedulerMsg, TokenizerMsg
from shoal.actors.replies import ask
from shoal.actors.writer_messages import UpdateWeights, WriteDone, Writer
from shoal.results import InternalError, OperationRefused


async def write_weights(
    writer: Writer,
    park: bool,
    scheduler: Mailbox[SchedulerMsg],
    executor: Mailbox[ExecutorMsg],
    cache: Mailbox[CacheMsg],
) -> None:
    """The writer's work: park paused requests (if asked), then load and flush; or flush
    (a release of the KV cache: nothing cached may outlive its pages) and change the
    memory. Raises what stopped it: OperationRefused (the weights, or the books after the
    flush) or InternalError."""
    if park:
        await ask(scheduler, Park)
    if isinstance(writer, UpdateWeights):
        await ask(executor, partial(LoadWeights, writer.source))
        await ask(cache, FlushCache)
        return
    if writer.release and "kv_cache" in writer.tags:
        await ask(cache, FlushCache)
    await ask(executor, partial(SetMemory, writer.release, writer.tags))


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

    def start(self, writer: Writer, park: bool) -> None:
        self.task = asyncio.create_task(self.write(writer, park))

    async def write(self, writer: Writer, park: bool) -> None:
        """Run the writer's work; report back through the mailbox whatever happens."""
        failure: OperationRefused | InternalError | None = InternalError(
            "the weight update was interrupted"
        )
        try:
            await write_weights(writer, park, self.scheduler, self.executor, self.cache)
            failure = None
        except (OperationRefused, InternalError) as exc:  # refused, or a step of it failed
            failure = exc
        finally:
            self.done.put(WriteDone(failure))

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
