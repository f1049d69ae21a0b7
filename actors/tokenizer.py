"""The tokenizer actor: the front door and the back door of every request.

In: applies the chat template, encodes, validates against the context and vocabulary,
gives unseeded requests a seed, admits them to the scheduler. Out: detokenizes
incrementally, applies stop strings, feeds each caller's stream, and ends it with a reason.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from shoal.actors.detokenize import IncrementalDetokenizer
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import (
    Abort,
    Admit,
    Advance,
    CacheMsg,
    Deliver,
    ExecutorMsg,
    FlushCache,
    FlushWhenIdle,
    Gate,
    Generate,
    LoadWeights,
    Output,
    Outputs,
    Park,
    Pause,
    Released,
    SchedulerMsg,
    SetPaused,
    Shutdown,
    Snapshot,
    TokenizerMsg,
    UpdateWeights,
    WriteDone,
)
from shoal.actors.stops import StopMatcher
from shoal.actors.update_lock import UpdateLock
from shoal.api.stream import Completion, Delta, RequestStream, TokenLogprob, Usage


@dataclass
class Live:
    stream: RequestStream
    detok: IncrementalDetokenizer
    stops: StopMatcher
    num_prompt: int
    output_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    weight_version: int = 0


class Tokenizer:
    def __init__(
        self,
        tokenizer: Any,
        context_length: int,
        vocab_size: int,
        mailbox: Mailbox[TokenizerMsg],
        scheduler: Mailbox[SchedulerMsg],
        cache: Mailbox[CacheMsg],
        executor: Mailbox[ExecutorMsg],
        seed: int | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.mailbox = mailbox
        self.scheduler = scheduler
        self.cache = cache
        self.executor = executor
        self.rng = random.Random(seed)
        self.live: dict[str, Live] = {}
        self.lock = UpdateLock()
        self.paused = False
        self.writing: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while True:
            match await self.mailbox.get():
                case Generate() as gen:
                    if self.lock.writing:
                        self.lock.queued.append(gen)
                    else:
                        self.admit(gen)
                case Abort(rid=rid) as abort:
                    if rid in self.live:
                        self.scheduler.put(abort)
                    else:
                        self.abort_queued(rid, abort.message)
                case Outputs(items=items):
                    for item in items:
                        self.deliver(item)
                case Released(rids=rids):
                    self.lock.readers.difference_update(rids)
                case UpdateWeights() as update:
                    self.lock.writers.append(update)
                    if update.abort_all:
                        for rid in self.live:
                            self.scheduler.put(Abort(rid, "abort", "aborted for a weight update"))
                case Pause(paused=paused):
                    self.paused = paused
                    self.scheduler.put(SetPaused(paused))
                case WriteDone(error=error):
                    writer = self.lock.finish(error is None)
                    message = error or f"weights loaded from {writer.model_path}"
                    _answer(writer.reply, (error is None, message, self.lock.version))
                    for gen in self.lock.release_queue():
                        self.admit(gen)
                case Snapshot() | FlushWhenIdle() | Gate() | Advance() | Deliver() as control:
                    self.scheduler.put(control)
                case Shutdown():
                    if self.writing is not None:
                        self.writing.cancel()
                    return
            self.maybe_write()

    # ---- weight updates (the writer side of the lock) -------------------------------------

    def maybe_write(self) -> None:
        start = self.lock.next_writer(self.paused)
        if start is not None:
            writer, park = start
            self.writing = asyncio.create_task(self.write(writer, park))

    async def write(self, writer: UpdateWeights, park: bool) -> None:
        """Park (if paused), load, flush; report back through the mailbox."""
        loop = asyncio.get_running_loop()
        error: str | None = None
        try:
            if park:
                parked: asyncio.Future[Any] = loop.create_future()
                self.scheduler.put(Park(parked))
                await parked
            loaded: asyncio.Future[Any] = loop.create_future()
            self.executor.put(LoadWeights(writer.model_path, loaded))
            error = await loaded
            if error is None:
                flushed: asyncio.Future[Any] = loop.create_future()
                self.cache.put(FlushCache(flushed))
                error = await flushed
        finally:
            self.mailbox.put(WriteDone(error))

    def abort_queued(self, rid: str, message: str) -> None:
        for gen in self.lock.queued:
            if gen.rid == rid:
                self.lock.queued.remove(gen)
                usage = Usage(0, 0, 0)
                gen.stream.finish(Completion(rid, "", (), "abort", usage, None, message))
                return

    # ---- in --------------------------------------------------------------------------------

    def encode(self, gen: Generate) -> list[int]:
        if gen.input_ids is not None:
            ids = list(gen.input_ids)
        elif gen.messages is not None:
            if not gen.messages:
                raise ValueError("messages must not be empty")
            text = self.tokenizer.apply_chat_template(
                list(gen.messages), add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif gen.text is not None:
            ids = self.tokenizer.encode(gen.text)
        else:
            raise ValueError("one of prompt, input_ids or messages is required")
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids contain ids outside the vocabulary: {bad[:5]}")
        limit = self.context_length
        if len(ids) + gen.sampling.max_new_tokens > limit:
            raise ValueError(
                f"prompt of {len(ids)} tokens plus max_new_tokens "
                f"{gen.sampling.max_new_tokens} exceeds the context length {limit}"
            )
        return ids

    def admit(self, gen: Generate) -> None:
        if gen.rid in self.live or gen.rid in self.lock.readers:
            gen.stream.fail(ValueError(f"request id {gen.rid!r} is already in use"))
            return
        try:
            ids = self.encode(gen)
        except ValueError as exc:
            gen.stream.fail(exc)
            return
        sampling = gen.sampling
        seed = sampling.seed if sampling.seed is not None else self.rng.getrandbits(63)
        detok = IncrementalDetokenizer(self.tokenizer, ids, sampling.skip_special_tokens)
        live = Live(gen.stream, detok, StopMatcher(sampling.stop), len(ids))
        live.logprobs = [] if sampling.wants_logprobs else None
        live.weight_version = self.lock.version
        self.live[gen.rid] = live
        self.lock.readers.add(gen.rid)
        self.scheduler.put(Admit(gen.rid, tuple(ids), sampling, seed))

    # ---- out -------------------------------------------------------------------------------

    def deliver(self, item: Output) -> None:
        live = self.live.get(item.rid)
        if live is None:
            return  # its stream already ended on a stop string; late tokens are dropped
        if item.num_cached_tokens is not None:
            live.num_cached_tokens = item.num_cached_tokens
        live.output_ids.extend(item.token_ids)
        text = live.detok.push(item.token_ids) if item.token_ids else ""
        if item.finish in ("stop", "length"):
            text += live.detok.flush()
        emit, matched = live.stops.push(text) if text else ("", None)
        if matched is None and item.finish is not None:
            emit += live.stops.flush()
        if item.logprobs is not None and live.logprobs is not None:
            live.logprobs.extend(item.logprobs)
        if emit or item.token_ids:
            live.text.append(emit)
            live.stream.push(Delta(emit, item.token_ids, item.logprobs))
        if matched is not None:
            self.scheduler.put(Abort(item.rid, reason="stop"))
            self.end(item.rid, "stop", matched)
        elif item.finish is not None:
            self.end(item.rid, item.finish, item.matched_token, item.message)

    def end(self, rid: str, reason: str, matched: str | int | None, message: str = "") -> None:
        live = self.live.pop(rid)
        usage = Usage(live.num_prompt, len(live.output_ids), live.num_cached_tokens)
        logprobs = tuple(live.logprobs) if live.logprobs is not None else None
        completion = Completion(
            rid,
            "".join(live.text),
            tuple(live.output_ids),
            reason,
            usage,
            matched,
            message,
            logprobs,
            live.weight_version,
        )
        live.stream.finish(completion)

    def fail_all(self, error: BaseException) -> None:
        for live in self.live.values():
            live.stream.fail(error)
        self.live.clear()
        for gen in self.lock.queued:
            gen.stream.fail(error)
        self.lock.queued.clear()
        for writer in (self.lock.active, *self.lock.writers):
            if writer is not None:
                _answer(writer.reply, (False, str(error), self.lock.version))


def _answer(reply: asyncio.Future[Any], value: Any) -> None:
    if not reply.done():
        reply.set_result(value)
