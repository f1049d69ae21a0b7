"""The model-update reader/writer lock of the tokenizer actor (docs/architecture.md,
"Lifecycle laws", law 2, and "Weight updates, cache flush and pause").

    reader   one per admitted request, from admission until the scheduler reports that the
             cache manager released everything it held (not merely its last token sent)
    writer   one weight update at a time, in arrival order; while any writer waits or works,
             new requests queue here and are admitted when the last writer is done
    pause    the engine's pause as the caller asked it; a writer may start while paused
             requests hold KV (it parks them first), and then a resume waits for it

So when a writer starts, no request holds a row, a page or a place in any batch (unless the
engine is paused, where the scheduler parks them first), and the flush after the load
cannot fail; and requests parked by a writer run again only after its load and flush, so none
holds pages or reads KV of the old weights when the flush lands.

The lock owns its sets and is asked; it sends nothing. Its owner turns the answers into
messages:

    if lock.defer(gen): ...             # queued behind a writer
    lock.enter(rid) / lock.leave(rids)  # a reader from admission until Released
    lock.request(update)                # a writer joins the line
    start = lock.next_writer()          # (writer, park) to run now, or None
    writer = lock.done(success)         # it finished: version bumped on success
    if lock.may_resume(): ...           # the scheduler may run unpaused
    for gen in lock.release_queue(): ...
"""

from __future__ import annotations

from collections import deque

from shoal.actors.messages import Generate
from shoal.actors.writer_messages import ChangeMemory, MemoryTag, UpdateWeights, Writer


class UpdateLock:
    def __init__(self) -> None:
        self._readers: set[str] = set()
        self._writers: deque[Writer] = deque()  # waiting, in arrival order
        self._active: Writer | None = None  # at work: parking, loading, flushing
        self._queued: deque[Generate] = deque()  # arrived while a writer waits or works
        self._paused = False
        self._version = "0"
        self._released: set[MemoryTag] = set()  # by ChangeMemory writers, until resumed

    @property
    def version(self) -> str:
        """The weight version serving now: a reader admitted now reports it."""
        return self._version

    @property
    def released(self) -> frozenset[MemoryTag]:
        """The memory released now (none: the engine can run)."""
        return frozenset(self._released)

    @property
    def writing(self) -> bool:
        """A writer waits or works, or memory is released: new requests must queue."""
        return self._active is not None or bool(self._writers) or bool(self._released)

    # ---- readers ---------------------------------------------------------------------------

    def defer(self, gen: Generate) -> bool:
        """Queue a new request behind the writers if any waits or works; whether it did."""
        if not self.writing:
            assert not self._queued, "requests queued with no writer left to wait for"
            return False
        self._queued.append(gen)
        return True

    def enter(self, rid: str) -> None:
        """An admitted request becomes a reader."""
        assert rid not in self._readers, rid
        self._readers.add(rid)

    def leave(self, rids: tuple[str, ...]) -> None:
        """These requests hold nothing anywhere any more (Released)."""
        self._readers.difference_update(rids)

    def is_reader(self, rid: str) -> bool:
        return rid in self._readers

    def take_queued(self, rid: str) -> Generate | None:
        """Take a request out of the queue (aborted or failed before its admission)."""
        for gen in self._queued:
            if gen.rid == rid:
                self._queued.remove(gen)
                return gen
        return None

    def release_queue(self) -> list[Generate]:
        """Requests that waited for the writers, once none is left; they leave the lock."""
        if self.writing:
            return []
        out = list(self._queued)
        self._queued.clear()
        return out

    # ---- writers ---------------------------------------------------------------------------

    def request(self, update: Writer) -> None:
        """A weight update (or a memory change) joins the line of writers."""
        self._writers.append(update)

    def withdraw(self, update: Writer) -> None:
        """A writer that failed to join (its message failed) leaves the line, if in it."""
        if update in self._writers:
            self._writers.remove(update)

    def next_writer(self) -> tuple[Writer, bool] | None:
        """The writer to start now, and whether it must park paused requests first: the next
        in line once no reader is left, or at once while paused or released (the readers are
        parked: the scheduler runs again only once nothing is released, `may_resume`)."""
        if self._active is not None or not self._writers:
            return None
        if self._readers and not (self._paused or self._released):
            return None  # running readers: it waits (while released, every reader is parked)
        self._active = self._writers.popleft()
        return self._active, bool(self._readers)

    def done(self, success: bool) -> Writer | None:
        """The writer at work finished (None if none was); on success the version moves to
        the one it asked for, or the next (`next_version`), or the memory is released or
        back."""
        writer = self._active
        if writer is None:
            return None
        self._active = None
        if success and isinstance(writer, UpdateWeights):
            asked = writer.weight_version
            self._version = asked if asked is not None else next_version(self._version)
        elif isinstance(writer, ChangeMemory) and writer.release:
            # a failed release may have freed part of it: counted released until a resume
            self._released.update(writer.tags)
        elif isinstance(writer, ChangeMemory) and success:
            self._released.difference_update(writer.tags)
        return writer

    # ---- pause -----------------------------------------------------------------------------

    def set_paused(self, paused: bool) -> None:
        """The caller paused or resumed the engine."""
        self._paused = paused

    def may_resume(self) -> bool:
        """The scheduler may run unpaused now: no pause is asked, no writer is at work and no
        memory is released. A writer at work may have parked the requests it found; they stay
        parked until its load and flush are done
        (test_continue_during_a_paused_update_waits_for_the_new_weights), or, after a release,
        until the memory is back."""
        return not self._paused and self._active is None and not self._released

    # ---- the end ---------------------------------------------------------------------------

    def abandon(self) -> tuple[list[Generate], list[Writer]]:
        """The engine stops: every queued request and every writer, at work or waiting, leave
        the lock for their owner to fail."""
        queued = list(self._queued)
        writers = [w for w in (self._active, *self._writers) if w is not None]
        self._queued.clear()
        self._writers.clear()
        self._active = None
        return queued, writers


def next_version(version: str) -> str:
    """The version an update that names none moves to: the next number after a number ("3"
    then "4"); a name ("rl-step-7") stays, as SGLang keeps it."""
    if version.isascii() and version.isdigit():
        return str(int(version) + 1)
    return version
