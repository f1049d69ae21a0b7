"""The asyncio facade: what programs that embed shoal use.

async with Engine() as engine:                      # the bundled SmolLM2
    async for delta in engine.generate("Hello", max_new_tokens=32):
        print(delta.text, end="")
    done = await engine.generate(messages=[{"role": "user", "content": "Hi"}]).result()
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
from typing import Any

import msgspec
import torch

from shoal.actors.disagg_wiring import room_handlers
from shoal.actors.executor.stages import StageMonitor
from shoal.actors.messages import (
    Abort,
    Advance,
    Bootstrap,
    CacheStats,
    CheckIntegrity,
    Deliver,
    EndSession,
    FlushWhenIdle,
    Gate,
    Generate,
    OpenSession,
    Pause,
    Snapshot,
    UpdateWeights,
)
from shoal.actors.replies import SchedulerSnapshot, TransferStats, UpdateOutcome
from shoal.actors.supervise import FaultInjector
from shoal.actors.transfer_messages import DropRoom, TransferCountsAsk
from shoal.actors.wiring import Actors, cpu_kernels, start_actors
from shoal.api.http.bootstrap_listener import listener_rules
from shoal.api.sampling_wire import SAMPLING_FIELDS, sampling_from
from shoal.api.session import Session
from shoal.cache.stats import KVStats
from shoal.config import (
    DEFAULT_SESSION_TIMEOUT_S,
    EngineOptions,
    Resolved,
    resolve,
    resolve_device,
)
from shoal.disagg.backend import LocalFabric
from shoal.disagg.bootstrap import BootstrapServer
from shoal.disagg.peers import PrefillPeers
from shoal.heap import trim_host_heap
from shoal.kernels.cache_files import raise_if_cancelled
from shoal.limits import check_prompt_size
from shoal.loading.loader import LoadedModel, default_cache_dir, load_model
from shoal.memory import DeviceMemory, measure_device_memory
from shoal.params import SamplingParams
from shoal.results import EngineDeadError, InternalError, RequestError, RequestStream


class UpdateResult(msgspec.Struct, frozen=True):
    success: bool
    message: str
    weight_version: int


class FlushResult(msgspec.Struct, frozen=True):
    success: bool
    message: str


class Engine:
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
        self.prefill_peers = PrefillPeers.parse(self.options.disaggregation_prefill_peers)
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
        self.faults = FaultInjector()  # tests arm it to fail one message (actors/supervise.py)
        self.fabric = fabric
        self.bootstrap: BootstrapServer | None = None  # a prefill server's endpoint
        self._start_cancel = threading.Event()  # cancel_start(): read by the start's threads

    # ---- life ------------------------------------------------------------------------------

    async def start(self) -> Engine:
        began = time.perf_counter()
        if self.options.num_threads:
            torch.set_num_threads(self.options.num_threads)
        if isinstance(self._model, LoadedModel):
            loaded = self._model
        else:
            _, dtype = resolve_device(self.options)
            loaded = await asyncio.to_thread(
                load_model, self._model, dtype=dtype, cancel=self._start_cancel
            )
        self.loaded = loaded
        self.resolved = resolve(
            self.options,
            loaded.config.max_position_embeddings,
            self._device_memory(loaded),
            has_experts=loaded.config.moe is not None,
        )
        kernels = await asyncio.to_thread(  # the CPU kernels may compile: off the loop
            cpu_kernels,
            self.resolved,
            default_cache_dir(),
            self.options.attention,
            self._start_cancel,
        )
        raise_if_cancelled(self._start_cancel)  # nothing is running yet: nothing to stop
        fell_back = self.resolved.attention == "cpu" and kernels is None
        self.attention = "torch" if fell_back else self.resolved.attention
        self._actors = start_actors(
            loaded,
            self.options,
            self.resolved,
            kernels,
            self._on_death,
            self.faults,
            self.fabric,
            self.peer_key,
        )
        if self.options.disaggregation_mode == "prefill":
            assert self._actors.transfer_box is not None
            self.bootstrap = BootstrapServer(
                room_handlers(self._actors.transfer_box),
                self.options.disaggregation_bootstrap_host,
                self.options.disaggregation_bootstrap_port,
                listener_rules(self.peer_key),  # the HTTP app's limits, errors and key
            )
            try:
                await self.bootstrap.start()
            except OSError as exc:
                await self._actors.stop()
                raise ValueError(f"the bootstrap endpoint could not listen: {exc}") from exc
        if loaded is not self._model:
            loaded.weights.clear()  # the model holds its own copies; a caller's stay whole
            trim_host_heap()  # the read copies are freed: give their pages back (heap.py)
        self.startup_s = time.perf_counter() - began
        return self

    def cancel_start(self) -> None:
        """Make a start in progress stop (from a signal handler or any thread): the conversion
        and the kernel build stop at their next check, within a second or two, and remove what
        they were writing, and start() raises StartCancelled. No effect once started."""
        self._start_cancel.set()

    def _device_memory(self, loaded: LoadedModel) -> DeviceMemory | None:
        """What sizes the KV pool on CUDA when kv_cache_tokens is unset (memory.py); None
        otherwise."""
        device, dtype = resolve_device(self.options)
        if device.type != "cuda" or self.options.kv_cache_tokens is not None:
            return None
        num_weights = sum(t.numel() for t in loaded.weights.values())
        return measure_device_memory(loaded.config, self.options, num_weights, dtype, device)

    async def close(self) -> None:
        if self._actors is not None:
            await self._actors.stop()
        if self.bootstrap is not None:
            await self.bootstrap.stop()

    @property
    def bootstrap_port(self) -> int | None:
        """Where this prefill server's bootstrap endpoint listens (None: not a prefill
        server)."""
        return None if self.bootstrap is None else self.bootstrap.port

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
    def tokenizer(self) -> Any:
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
        **sampling_fields: Any,
    ) -> RequestStream:
        """Start one request. Sampling is a SamplingParams or its fields as keywords (a field
        not given: its declared default).

        Validates the sampling here, once for every door (the HTTP routes, the websocket and
        the command line come through here): ValueError at once for a bad value (RequestError
        or LimitExceeded, `field` naming it); a prompt that does not fit the context surfaces
        as ValueError from the stream.

        `bootstrap` (SGLang's bootstrap_host/port/room) makes it one half of a disaggregated
        request on a prefill or decode server (docs/disaggregation.md); elsewhere it is
        ignored.
        """
        unknown = set(sampling_fields) - set(SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"unknown sampling option(s): {sorted(unknown)}")
        if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
            raise ValueError("give exactly one of prompt, input_ids or messages")
        check_prompt_size(self.limits, prompt, messages)
        if sampling is None or sampling_fields:
            given = {} if sampling is None else msgspec.structs.asdict(sampling)
            sampling = sampling_from({**given, **sampling_fields})
        sampling.validate(self.loaded.config.vocab_size if self.loaded else None, self.limits)
        if self.options.disaggregation_mode == "null":
            bootstrap = None
        if bootstrap is not None and session_id is not None:
            raise RequestError("a session turn cannot be disaggregated", "bootstrap_room")
        self._check_peer(bootstrap)
        actors = self.actors
        rid = rid if rid is not None else f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        stream = RequestStream(rid, self.abort)
        ids = tuple(int(t) for t in input_ids) if input_ids is not None else None
        msgs = tuple(messages) if messages is not None else None
        gen = Generate(rid, prompt, ids, msgs, sampling, stream, session_id, bootstrap)
        if bootstrap is not None:
            stream.on_end = partial(self._end_room, rid, bootstrap)
        actors.tokenizer_box.put(gen)
        return stream

    def _end_room(self, rid: str, bootstrap: Bootstrap, cause: str | None, refused: bool) -> None:
        """A disaggregated request ended: if not well, its room ends on both servers with the
        cause, wherever the request was (even refused before it was admitted)."""
        actors = self._actors
        if cause is not None and actors is not None and actors.transfer_box is not None:
            actors.transfer_box.put(DropRoom(rid, bootstrap, cause, refused))

    def drop_room(self, bootstrap: Bootstrap, cause: str, refused: bool = True) -> None:
        """A door refused a disaggregated request before it reached the engine (a bad field):
        end its room on both servers with the cause (a decode server tells only a listed
        prefill server)."""
        try:
            self._check_peer(bootstrap)
        except RequestError:
            return
        self._end_room("", bootstrap, cause, refused)

    def _check_peer(self, bootstrap: Bootstrap | None) -> None:
        """A decode server contacts only the prefill servers of its own configuration
        (disaggregation_prefill_peers), never one a client names: RequestError naming the
        field, before anything is reserved."""
        if bootstrap is None or self.options.disaggregation_mode != "decode":
            return
        refusal = self.prefill_peers.refusal(bootstrap.host, bootstrap.port)
        if refusal is not None:
            field, why = refusal
            raise RequestError(why, field)

    @property
    def weights_digest(self) -> str:
        """The serving weights' identity (loading/identity.py): what disaggregated
        servers compare; it survives restarts, unlike weight_version."""
        return self.actors.weights_digest()

    async def transfer_counts(self) -> dict[str, int]:
        """Disaggregation's rooms in each state ({} without disaggregation)."""
        return (await self.transfer_stats()).rooms

    async def transfer_stats(self) -> TransferStats:
        """Disaggregation's rooms in each state and the KV moved (actors/replies.py)."""
        box = self.actors.transfer_box
        if box is None:
            return TransferStats({})
        reply: asyncio.Future[TransferStats] = self._future()
        box.put(TransferCountsAsk(reply))
        return await reply

    def abort(self, rid: str, message: str = "aborted by the caller") -> None:
        if self._actors is not None and not self._actors.stopping:
            self._actors.tokenizer_box.put(Abort(rid, "abort", message))

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
        bound_s = self.options.max_session_timeout_s
        timeout_s = min(DEFAULT_SESSION_TIMEOUT_S, bound_s) if timeout_s is None else timeout_s
        if not 0 < timeout_s <= bound_s:
            raise RequestError(
                f"timeout_s must be in (0, {bound_s:g}] (max_session_timeout_s), got {timeout_s:g}",
                "timeout_s",
            )
        if max_tokens is not None and max_tokens < 2:
            raise RequestError(f"max_tokens must be >= 2, got {max_tokens}", "max_tokens")
        session_id = session_id or f"session-{uuid.uuid4().hex}"
        reply: asyncio.Future[None] = self._future()
        opening = OpenSession(session_id, timeout_s, max_tokens, reply, client)
        self.actors.tokenizer_box.put(opening)
        await reply  # raises the refusal
        return Session(self, session_id)

    async def close_session(self, session_id: str) -> None:
        """Close a session (after its live turn ends). RequestError if it is not open."""
        reply: asyncio.Future[None] = self._future()
        self.actors.tokenizer_box.put(EndSession(session_id, "close", reply))
        await reply  # raises RequestError, code "session_not_found"

    # ---- lifecycle operations (docs/architecture.md, "Weight updates, cache flush and pause")

    async def update_weights_from_disk(
        self,
        model_path: str | Path,
        abort_all_requests: bool = False,
        weight_version: int | None = None,
    ) -> UpdateResult:
        """Load a same-architecture checkpoint under the writer lock, then flush the prefix
        cache. New requests wait meanwhile; in-flight ones finish first (or are aborted with
        abort_all_requests; or, while paused, are parked and continue on the new weights).
        A bad checkpoint leaves the old weights serving: success False and the reason."""
        reply: asyncio.Future[UpdateOutcome] = self._future()
        self.actors.tokenizer_box.put(
            UpdateWeights(str(model_path), abort_all_requests, weight_version, reply)
        )
        try:
            success, message, version = await reply
        except InternalError as exc:
            return UpdateResult(False, str(exc), self.weight_version)
        return UpdateResult(success, message, version)

    async def flush_cache(self, timeout_s: float = 30.0) -> FlushResult:
        """Empty the prefix cache once the engine is idle (docs/architecture.md, law 1),
        waiting up to timeout_s; if it does not become idle in time, refuse and change
        nothing."""
        reply: asyncio.Future[str | None] = self._future()
        self.actors.tokenizer_box.put(FlushWhenIdle(next(self._ids), timeout_s, reply))
        try:
            error = await reply
        except InternalError as exc:
            return FlushResult(False, f"not flushed: {exc}")
        return FlushResult(error is None, error or "prefix cache flushed")

    def pause_generation(self) -> None:
        """New requests queue; running ones stop being scheduled and keep their KV."""
        self.actors.tokenizer_box.put(Pause(True))
        self._paused = True

    def continue_generation(self) -> None:
        self.actors.tokenizer_box.put(Pause(False))
        self._paused = False

    @property
    def paused(self) -> bool:
        """Whether generation is paused (by pause_generation, until continue_generation)."""
        return self._paused

    @property
    def weight_version(self) -> int:
        return self.actors.tokenizer.weight_version

    # ---- stepping, for deterministic tests ------------------------------------------------

    @property
    def stages(self) -> StageMonitor:
        """The pipeline stages' microbatch counts, and the tests' seam to hold a stage or fail
        its next microbatch (actors/executor/stages.py); one stage without `pipeline_stages`."""
        return self.actors.stages

    def hold(self) -> None:
        """Stop the scheduler between steps: nothing is planned or processed until
        `advance()` / `deliver()`; `release()` lets it run freely again."""
        self.actors.tokenizer_box.put(Gate(True))

    def release(self) -> None:
        self.actors.tokenizer_box.put(Gate(False))

    async def advance(self) -> int | None:
        """Plan and launch one step; the launched batch id, or None if nothing to launch."""
        reply: asyncio.Future[int | None] = self._future()
        self.actors.tokenizer_box.put(Advance(reply))
        return await reply

    async def deliver(self) -> int:
        """Process the oldest launched batch's result (waiting for it); its batch id."""
        reply: asyncio.Future[int] = self._future()
        self.actors.tokenizer_box.put(Deliver(reply))
        return await reply

    def _future(self) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().create_future()

    # ---- introspection ---------------------------------------------------------------------

    async def snapshot(self) -> SchedulerSnapshot:
        """Where every request is: waiting / prefill / running / finishing, launched batches."""
        reply: asyncio.Future[SchedulerSnapshot] = self._future()
        self.actors.tokenizer_box.put(Snapshot(reply))
        return await reply

    async def cache_stats(self) -> KVStats:
        reply: asyncio.Future[KVStats] = self._future()
        self.actors.cache_box.put(CacheStats(reply))
        return await reply

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
        reply: asyncio.Future[str | None] = self._future()
        self.actors.cache_box.put(CheckIntegrity(reply))
        error = await reply
        if error is not None:
            raise AssertionError(error)
