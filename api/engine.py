"""The asyncio facade: what programs that embed shoal use.

async with Engine() as engine:                      # the bundled SmolLM2
    async for delta in engine.generate("Hello", max_new_tokens=32):
        print(delta.text, end="")
    done = await engine.generate(messages=[{"role": "user", "content": "Hi"}]).result()

The Engine holds its life, requests, sessions, the lifecycle operations and read-only
introspection. Its start is api/startup.py, disaggregation's rooms api/rooms.py, and the
tests' hooks `engine.testing` api/testing.py; every question to an actor is one `ask`
(actors/replies.py).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, get_args

from shoal.actors.messages import (
    Abort,
    CacheStats,
    CheckIntegrity,
    EndSession,
    FlushWhenIdle,
    Generate,
    OpenSession,
    Snapshot,
)
from shoal.actors.replies import SchedulerSnapshot, TransferStats, ask
from shoal.actors.wiring import Actors
from shoal.actors.writer_messages import Pause, PauseMode
from shoal.api.memory_calls import MemoryCalls
from shoal.api.request_sampling import request_sampling
from shoal.api.rooms import Rooms
from shoal.api.sampling_wire import SAMPLING_FIELDS
from shoal.api.session import Session, session_bounds
from shoal.api.startup import StartHooks, start_engine
from shoal.api.testing import EngineTesting
from shoal.api.weight_calls import WeightCalls
from shoal.api.weight_groups import WeightGroups
from shoal.cache.stats import KVStats
from shoal.config import EngineOptions
from shoal.disagg.backend import LocalFabric
from shoal.disagg.bootstrap import BootstrapServer
from shoal.limits import check_prompt_size
from shoal.loading.hf_tokenizer import HFTokenizer
from shoal.models.load import LoadedModel
from shoal.params import Bootstrap, ChatTemplateArgs, SamplingParams
from shoal.resolve_options import Resolved
from shoal.results import (
    EngineDeadError,
    FlushResult,
    InternalError,
    OperationRefused,
    RequestError,
    RequestStream,
)


class Engine(WeightCalls, MemoryCalls):
    def __init__(
        self,
        model: str | Path | LoadedModel | None = None,
        *,
        fabric: LocalFabric | None = None,
        peer_key: str | None = None,
        **options: Any,
    ) -> None:
        """`fabric`: with disaggregation_transfer_backend "local", the engines that share one
        LocalFabric move KV between each other (disagg/backend.py). `peer_key`: with
        disaggregation, the key of the bootstrap calls between the servers (`serve` passes
        its --api-key): a prefill server's listener requires it, a decode server sends it."""
        self.options = EngineOptions(**options)
        self.options.validate()
        self.rooms = Rooms(self.options, lambda: self._actors, lambda: self.actors)
        self.peer_key = peer_key or None
        self.limits = self.options.input_limits()
        self._model = model
        self._actors: Actors | None = None
        self._ids = itertools.count()
        self._paused = False  # as the caller last asked: pause_generation / continue_generation
        self.loaded: LoadedModel | None = None
        self.resolved: Resolved | None = None
        self.attention = ""  # the attention backend in use once started: torch, triton or cpu
        self.dead_reason: str | None = None
        self.startup_s = 0.0
        self.testing = EngineTesting(lambda: self.actors)  # the tests' hooks, never production's
        self.fabric = fabric
        self.bootstrap: BootstrapServer | None = None  # a prefill server's endpoint
        self._start_cancel = threading.Event()  # cancel_start(): read by the start's threads
        self._groups: WeightGroups | None = None  # the trainers' weight update groups

    # ---- life ------------------------------------------------------------------------------

    async def start(self) -> Engine:
        hooks = StartHooks(
            self._on_death, self.testing.faults, self._start_cancel, self.fabric, self.peer_key
        )
        started = await start_engine(self._model, self.options, hooks)
        self.loaded, self.resolved = started.loaded, started.resolved
        self.attention, self.startup_s = started.attention, started.startup_s
        self._actors, self.bootstrap = started.actors, started.bootstrap
        self._groups = WeightGroups(started.loaded.config, started.resolved.device)
        return self

    def cancel_start(self) -> None:
        """Make a start in progress stop (from a signal handler or any thread): the conversion
        and the kernel build stop at their next check, within a second or two, and remove what
        they were writing, and start() raises StartCancelled. No effect once started."""
        self._start_cancel.set()

    async def close(self) -> None:
        if self._groups is not None:
            self._groups.close()
        if self._actors is not None:
            await self._actors.stop()
        if self.bootstrap is not None:
            await self.bootstrap.stop()

    async def __aenter__(self) -> Engine:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _on_death(self, reason: str) -> None:
        self.dead_reason = reason

    @property
    def actors(self) -> Actors:
        if self._actors is None:
            raise RuntimeError("the engine is not started: use `async with Engine(...)`")
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._actors.stopping:
            raise EngineDeadError("the engine is shut down")
        return self._actors

    @property
    def groups(self) -> WeightGroups:
        """The weight update groups joined with trainers (api/weight_groups.py)."""
        self.actors  # noqa: B018 - raises as every call on an engine not serving does
        assert self._groups is not None
        return self._groups

    @property
    def tokenizer(self) -> HFTokenizer:
        assert self.loaded is not None
        return self.loaded.tokenizer

    # ---- requests --------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        rid: str | None = None,
        session_id: str | None = None,
        bootstrap: Bootstrap | None = None,
        chat_template: ChatTemplateArgs | None = None,
        **sampling_fields: Any,
    ) -> RequestStream:
        """Start one request. Sampling is a SamplingParams or its fields as keywords (a field
        not given: its declared default).

        Validates the sampling here, once for every door (the HTTP routes, the websocket and
        the command line come through here): ValueError at once for a bad value (RequestError
        or LimitExceeded, `field` naming it); a prompt that does not fit the context surfaces
        as ValueError from the stream.

        `chat_template` (with messages): the tools the template shows the model and the
        template's variables (params.ChatTemplateArgs); not for a session turn yet.

        `bootstrap` (SGLang's bootstrap_host/port/room) makes it one half of a disaggregated
        request on a prefill or decode server (docs/disaggregation.md); elsewhere it is
        ignored.

        `max_new_tokens=RoomLeft(at_most)` (params.py): as many as the context leaves after
        the prompt, at most `at_most`; sized where the prompt is measured (the tokenizer
        actor), and refused from the stream if the prompt leaves no room.
        """
        unknown = set(sampling_fields) - set(SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"unknown sampling option(s): {sorted(unknown)}")
        if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
            raise ValueError("give exactly one of prompt, input_ids or messages")
        check_prompt_size(self.limits, prompt, messages)
        if chat_template is not None:
            if messages is None or session_id is not None:
                why = " needs messages, and is not supported for a session turn yet"
                raise RequestError(why, "chat_template_kwargs", named=True)
            chat_template.check()
        vocab_size = self.loaded.config.vocab_size if self.loaded else None
        context = self.resolved.context_length if self.resolved is not None else None
        sampling, room = request_sampling(
            sampling, sampling_fields, self.limits, vocab_size, context
        )
        if self.options.disaggregation_mode == "null":
            bootstrap = None
        if bootstrap is not None and session_id is not None:
            raise RequestError("a session turn cannot be disaggregated", "bootstrap_room")
        if bootstrap is not None and sampling.wants_prompt_logprobs:  # no server has them all
            why = " (prompt logprobs) is not supported for a disaggregated request"
            raise RequestError(why, "logprob_start_len", named=True)
        if sampling.return_routed_experts:
            self._check_routed_experts(bootstrap)
        self.rooms.check_peer(bootstrap)
        actors = self.actors
        rid = rid if rid is not None else f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        stream = RequestStream(rid, self.abort)
        ids = tuple(int(t) for t in input_ids) if input_ids is not None else None
        msgs = tuple(messages) if messages is not None else None
        gen = Generate(
            rid, prompt, ids, msgs, sampling, stream, session_id, bootstrap, room, chat_template
        )
        if bootstrap is not None:
            stream.on_end = partial(self.rooms.end, rid, bootstrap)
        actors.tokenizer_box.put(gen)
        return stream

    def _check_routed_experts(self, bootstrap: Bootstrap | None) -> None:
        """RequestError unless this engine can answer return_routed_experts: a mixture-of-
        experts model, one pipeline stage (each stage would hold a part of the recorder), not
        a disaggregated request (no server runs every position)."""
        why = None
        if self.loaded is not None and self.loaded.config.moe is None:
            why = " is not available: the model has no mixture-of-experts layers"
        elif self.options.pipeline_stages > 1:
            why = " is not supported with pipeline_stages > 1"
        elif bootstrap is not None:
            why = " is not supported for a disaggregated request"
        if why is not None:
            raise RequestError(why, "return_routed_experts", named=True)

    def abort(self, rid: str, message: str = "aborted by the caller") -> None:
        if self._actors is not None and not self._actors.stopping:
            self._actors.tokenizer_box.put(Abort(rid, "abort", message))

    def drop_room(self, bootstrap: Bootstrap, cause: str, refused: bool = True) -> None:
        """A door refused a disaggregated request before it reached the engine (a bad field):
        end its room on both servers with the cause (api/rooms.py)."""
        self.rooms.drop(bootstrap, cause, refused)

    # ---- sessions ---------------------------------------------------------------------------

    async def open_session(
        self,
        timeout_s: float | None = None,
        max_tokens: int | None = None,
        session_id: str | None = None,
        client: str | None = None,
    ) -> Session:
        """Open a streaming session; idle past timeout_s (at most max_session_timeout_s; not
        given: 600 s or that bound if lower) it is closed. max_tokens caps its whole history.
        `client` (the HTTP doors: the peer address) holds at most max_sessions_per_client.
        RequestError if it cannot be opened (a bad option, id in use, too many sessions: code
        "too_many_sessions")."""
        timeout_s = session_bounds(timeout_s, max_tokens, self.options.max_session_timeout_s)
        session_id = session_id or f"session-{uuid.uuid4().hex}"
        opening = partial(OpenSession, session_id, timeout_s, max_tokens, client=client)
        await ask(self.actors.tokenizer_box, opening)  # raises the refusal
        return Session(self, session_id)

    async def close_session(self, session_id: str) -> None:
        """Close a session (after its live turn ends). RequestError if it is not open."""
        closing = partial(EndSession, session_id, "close")
        await ask(self.actors.tokenizer_box, closing)  # RequestError, code "session_not_found"

    # ---- lifecycle operations (docs/architecture.md, "Weight updates, cache flush and pause")

    async def flush_cache(self, timeout_s: float = 30.0) -> FlushResult:
        """Empty the prefix cache once the engine is idle (docs/architecture.md, law 1),
        waiting up to timeout_s; if it does not become idle in time, refuse and change
        nothing."""
        flush = partial(FlushWhenIdle, next(self._ids), timeout_s)
        try:
            await ask(self.actors.tokenizer_box, flush)
        except OperationRefused as refusal:
            return FlushResult(False, str(refusal))
        except InternalError as exc:
            return FlushResult(False, f"not flushed: {exc}")
        return FlushResult(True, "prefix cache flushed")

    def pause_generation(self, mode: PauseMode = "in_place") -> None:
        """New requests queue until continue_generation; the ones in the engine, by `mode`
        (SGLang's): "in_place" stop being scheduled and keep their KV; "retract" give their
        KV back and wait, to prefill again when generation continues; "abort" end at once
        with what they generated, finish reason "abort" (an RL loop resubmits them, prompt
        and partial output, after a weight update). ValueError for another mode."""
        if mode not in get_args(PauseMode):
            modes = ", ".join(get_args(PauseMode))
            raise ValueError(f"mode must be one of {modes}, got {mode!r}")
        self.actors.tokenizer_box.put(Pause(True, mode))
        self._paused = True

    def continue_generation(self) -> None:
        self.actors.tokenizer_box.put(Pause(False))
        self._paused = False

    @property
    def paused(self) -> bool:
        """Whether generation is paused (by pause_generation, until continue_generation)."""
        return self._paused

    # ---- introspection ---------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self.actors.tokenizer.weight_version

    @property
    def weights_digest(self) -> str:
        """The serving weights' identity (loading/identity.py): what disaggregated
        servers compare; it survives restarts, unlike weight_version."""
        return self.actors.weights_digest()

    @property
    def bootstrap_port(self) -> int | None:
        """Where this prefill server's bootstrap endpoint listens (None: not a prefill
        server)."""
        return None if self.bootstrap is None else self.bootstrap.port

    async def snapshot(self) -> SchedulerSnapshot:
        """Where every request is: waiting / prefill / running / finishing, launched batches."""
        return await ask(self.actors.tokenizer_box, Snapshot)

    async def cache_stats(self) -> KVStats:
        return await ask(self.actors.cache_box, CacheStats)

    def stage_microbatches(self) -> tuple[int, ...]:
        """Microbatches in each pipeline stage now (one stage without `pipeline_stages`)."""
        return self.actors.stages.counts()

    async def transfer_stats(self) -> TransferStats:
        """Disaggregation's rooms in each state and the KV moved (actors/replies.py)."""
        return await self.rooms.stats()

    async def transfer_counts(self) -> dict[str, int]:
        """Disaggregation's rooms in each state ({} without disaggregation)."""
        return (await self.rooms.stats()).rooms

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until no request is anywhere in the engine (docs/architecture.md, law 1)."""
        deadline = time.monotonic() + timeout_s
        while not (await self.snapshot()).idle:
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not idle after {timeout_s}s")
            await asyncio.sleep(0.005)

    async def check_integrity(self) -> None:
        """Raise AssertionError if a page, row or lock reference leaked (engine idle)."""
        await self.wait_idle()
        try:
            await ask(self.actors.cache_box, CheckIntegrity)
        except OperationRefused as violation:
            raise AssertionError(str(violation)) from None
