"""The lifecycle writers' messages (docs/architecture.md, "Weight updates, cache flush and
pause"): what a weight update loads (`WeightSource`), the update and the memory change that are
the update lock's writers (`Writer`, actors/tokenizer/update_lock.py), the pause, and the end
of a writer's work. They go into the tokenizer's mailbox (`TokenizerMsg`, messages.py).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Literal

import msgspec

from shoal.results import InternalError, OperationRefused, UpdateResult

if TYPE_CHECKING:
    import torch


class DiskWeights(msgspec.Struct, frozen=True, tag=True):
    """New weights from a checkpoint folder (or a file in one): the whole set."""

    model_path: str

    def describe(self) -> str:
        return f"from {self.model_path}"


class TensorWeights(msgspec.Struct, frozen=True, tag=True):
    """New weights from tensors in this process, by Hugging Face name: any subset of the
    model's (the rest keep their values). Held, never encoded: a mailbox passes objects."""

    named: tuple[tuple[str, torch.Tensor], ...]
    origin: str = "tensors"  # what the answer names: "tensors", "the group 'g'"

    def describe(self) -> str:
        return f"from {self.origin} ({len(self.named)} tensors)"


WeightSource = DiskWeights | TensorWeights


class UpdateWeights(msgspec.Struct, frozen=True, tag=True):
    """Take the writer lock, load the new weights, flush the prefix cache, move the version."""

    source: WeightSource
    abort_all: bool
    weight_version: str | None
    reply: asyncio.Future[UpdateResult]  # success False: why, and the old weights serve on


MemoryTag = Literal["kv_cache", "weights"]


class ChangeMemory(msgspec.Struct, frozen=True, tag=True):
    """Release the memory of `tags` (release True) or take it back, as a writer of the update
    lock: it starts once no request holds anything, and while anything is released new
    requests wait and paused ones stay parked (actors/tokenizer/update_lock.py)."""

    release: bool
    tags: tuple[MemoryTag, ...]
    reply: asyncio.Future[UpdateResult]

    def describe(self) -> str:
        return f"{'released' if self.release else 'resumed'} {', '.join(self.tags)}"


Writer = UpdateWeights | ChangeMemory


PauseMode = Literal["abort", "retract", "in_place"]


class Pause(msgspec.Struct, frozen=True, tag=True):
    """Pause or continue generation. Pausing, `mode` says what becomes of the requests
    already in the engine (SGLang's modes): "in_place" they stop where they are and keep
    their KV; "retract" they give their KV back and wait, to prefill again on continue;
    "abort" they end at once with what they generated (finish reason "abort")."""

    paused: bool
    mode: PauseMode = "in_place"


class WriteDone(msgspec.Struct, frozen=True, tag=True):
    """The writer's work finished (posted by the tokenizer's own write task): `failure` None,
    or the refusal or internal error that stopped it."""

    failure: OperationRefused | InternalError | None
