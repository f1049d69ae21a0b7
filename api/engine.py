"""The asyncio facade: what programs that embed shoal use.

async with Engine() as engine:                      # the bundled SmolLM2
    async for delta in engine.generate("Hello", max_new_tokens=32):
        print(delta.text, end="")
    done = await engine.generate(messages=[{"role": "user", "content": "Hi"}]).result()
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
import torch

from shoal.actors.messages import Abort, CacheStats, CheckIntegrity, Generate, Snapshot
from shoal.actors.wiring import Actors, start_actors
from shoal.api.stream import EngineDeadError, RequestStream
from shoal.config import DTYPES, EngineOptions, Resolved, resolve
from shoal.kernels.loader import LoadedModel, load_model
from shoal.params import SamplingParams

SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)


class Engine:
    def __init__(self, model: str | Path | LoadedModel | None = None, **options: Any) -> None:
        self.options = EngineOptions(**options)
        self.options.validate()
        self._model = model
        self._actors: Actors | None = None
        self._ids = itertools.count()
        self.loaded: LoadedModel | None = None
        self.resolved: Resolved | None = None
        self.dead_reason: str | None = None
        self.startup_s = 0.0

    # ---- life ------------------------------------------------------------------------------

    async def start(self) -> Engine:
        began = time.perf_counter()
        if self.options.num_threads:
            torch.set_num_threads(self.options.num_threads)
        if isinstance(self._model, LoadedModel):
            loaded = self._model
        else:
            dtype = DTYPES[self.options.dtype]
            loaded = await asyncio.to_thread(load_model, self._model, dtype=dtype)
        self.loaded = loaded
        self.resolved = resolve(self.options, loaded.config.max_position_embeddings)
        self._actors = start_actors(loaded, self.options, self.resolved, self._on_death)
        self.startup_s = time.perf_counter() - began
        return self

    async def close(self) -> None:
        if self._actors is not None:
            await self._actors.stop()

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
        **sampling_fields: Any,
    ) -> RequestStream:
        """Start one request. Sampling is a SamplingParams or its fields as keywords.

        Raises ValueError at once for bad sampling values; a prompt that does not fit the
        context surfaces as ValueError from the stream.
        """
        unknown = set(sampling_fields) - SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"unknown sampling option(s): {sorted(unknown)}")
        if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
            raise ValueError("give exactly one of prompt, input_ids or messages")
        if sampling is None:
            sampling = _sampling_from(sampling_fields)
        elif sampling_fields:
            sampling = msgspec.structs.replace(sampling, **sampling_fields)
        sampling.validate(self.loaded.config.vocab_size if self.loaded else None)
        actors = self.actors
        rid = rid if rid is not None else f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        stream = RequestStream(rid, self.abort)
        ids = tuple(int(t) for t in input_ids) if input_ids is not None else None
        msgs = tuple(messages) if messages is not None else None
        actors.tokenizer_box.put(Generate(rid, prompt, ids, msgs, sampling, stream))
        return stream

    def abort(self, rid: str, message: str = "aborted by the caller") -> None:
        if self._actors is not None and not self._actors.stopping:
            self._actors.tokenizer_box.put(Abort(rid, "abort", message))

    # ---- introspection ---------------------------------------------------------------------

    async def snapshot(self) -> dict[str, Any]:
        """Where every request is: waiting / prefill / running / finishing, launched batches."""
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.actors.scheduler_box.put(Snapshot(reply))
        result: dict[str, Any] = await reply
        return result

    async def cache_stats(self) -> dict[str, int]:
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.actors.cache_box.put(CacheStats(reply))
        result: dict[str, int] = await reply
        return result

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until no request is anywhere in the engine (DESIGN law 1)."""
        deadline = time.monotonic() + timeout_s
        while not (await self.snapshot())["idle"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not idle after {timeout_s}s")
            await asyncio.sleep(0.005)

    async def check_integrity(self) -> None:
        """Raise AssertionError if a page, row or lock reference leaked (engine idle)."""
        await self.wait_idle()
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.actors.cache_box.put(CheckIntegrity(reply))
        error = await reply
        if error is not None:
            raise AssertionError(error)


def _sampling_from(fields: dict[str, Any]) -> SamplingParams:
    if isinstance(fields.get("stop"), str):
        fields = {**fields, "stop": (fields["stop"],)}
    try:
        return msgspec.convert(fields, SamplingParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid sampling option: {exc}") from None
