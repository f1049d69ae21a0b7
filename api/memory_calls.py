"""The Engine's memory release and resume (SGLang's release_memory_occupation /
resume_memory_occupation; README, "RL rollouts"): an RL loop that trains on the same device
frees the KV cache and the weights while the trainer runs, and takes them back after.

Each is a writer of the update lock (actors/tokenizer/update_lock.py): it starts once no
request holds anything (in-flight ones finish first; paused ones are parked and give their
KV back), a release of the KV cache flushes the prefix cache first, and while anything is
released new requests wait in line and paused ones stay parked, until the resume that brings
everything back. On the CPU the KV pool's tensors and the serving weights are freed (the
weights are built again on resume from where they came: the last push's host copy, or the
checkpoint folder); on CUDA the same, and the allocator's cache is emptied.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, get_args

from shoal.actors.replies import ask
from shoal.actors.writer_messages import ChangeMemory, MemoryTag
from shoal.results import InternalError, UpdateResult

if TYPE_CHECKING:
    from shoal.actors.wiring import Actors
    from shoal.config import EngineOptions

TAGS: tuple[MemoryTag, ...] = get_args(MemoryTag)


class MemoryCalls:
    """Mixed into Engine: what it needs of it is `actors`, `options` and `weight_version`."""

    if TYPE_CHECKING:
        options: EngineOptions

        @property
        def actors(self) -> Actors: ...

        @property
        def weight_version(self) -> str: ...

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> UpdateResult:
        """Free the memory of `tags` ("kv_cache", "weights"; None: both) once no request
        holds anything. Requests sent meanwhile wait until it is resumed."""
        return await self._change(True, tags)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> UpdateResult:
        """Take the memory of `tags` back (None: both): the KV pool allocated again, the
        weights built again from where they came. Released memory not named stays released,
        and requests keep waiting for it."""
        return await self._change(False, tags)

    async def _change(self, release: bool, tags: Sequence[str] | None) -> UpdateResult:
        asked = TAGS if tags is None else tuple(dict.fromkeys(tags))
        wrong = [tag for tag in asked if tag not in TAGS]
        if wrong or not asked:
            why = f"tags must name {' or '.join(TAGS)} (null: both), got {list(tags or [])}"
            return UpdateResult(False, why, self.weight_version)
        if self.options.disaggregation_mode != "null":
            why = "a disaggregated server cannot release memory: its transfer engine holds the KV"
            return UpdateResult(False, why, self.weight_version)
        named: tuple[MemoryTag, ...] = tuple(tag for tag in TAGS if tag in asked)
        try:
            return await ask(self.actors.tokenizer_box, partial(ChangeMemory, release, named))
        except InternalError as exc:
            return UpdateResult(False, str(exc), self.weight_version)
