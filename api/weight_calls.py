"""The Engine's weight updates (docs/architecture.md, "Weight updates, cache flush and pause";
README, "RL rollouts"): from a checkpoint folder, from tensors in this process, and from a
trainer's process group. Each is one writer of the update lock: new requests wait, in-flight
ones finish first (or are aborted with abort_all_requests, or stay parked while paused), the
new weights are validated whole and committed in every pipeline stage or not at all (refused:
the old weights serve on, success False and why), then the prefix cache is flushed and the
version moves (to the one asked for, or the next).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shoal.actors.replies import ask
from shoal.actors.writer_messages import DiskWeights, TensorWeights, UpdateWeights, WeightSource
from shoal.api.weight_groups import GroupResult, WeightGroups, WeightSyncError
from shoal.results import InternalError, UpdateResult

if TYPE_CHECKING:
    from shoal.actors.wiring import Actors

DEFAULT_GROUP = "weight_update_group"  # SGLang's
DISK_FORMATS = (None, "auto", "safetensors")  # what a Hugging Face folder holds
TENSOR_FORMATS = (None, "direct")  # named tensors as they are (not SGLang's flattened buckets)
MAX_VERSION_CHARS = 256


class WeightCalls:
    """Mixed into Engine: what it needs of it is `actors`, `weight_version` and `groups`."""

    if TYPE_CHECKING:

        @property
        def actors(self) -> Actors: ...

        @property
        def weight_version(self) -> str: ...

        @property
        def groups(self) -> WeightGroups: ...

    async def update_weights_from_disk(
        self,
        model_path: str | Path,
        abort_all_requests: bool = False,
        weight_version: str | int | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> UpdateResult:
        """Load a same-architecture checkpoint folder (load_format None, "auto" or
        "safetensors"). A bad checkpoint leaves the old weights serving: success False and
        the reason."""
        if load_format not in DISK_FORMATS:
            return self._refused(
                f"load_format {load_format!r} is not supported: shoal loads a folder of "
                "safetensors (load_format auto or safetensors)"
            )
        source = DiskWeights(str(model_path))
        return await self._update(source, abort_all_requests, weight_version, flush_cache)

    async def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | int | None = None,
        abort_all_requests: bool = False,
    ) -> UpdateResult:
        """Serve these tensors, by Hugging Face name, on any device and in any float dtype
        (cast to the model's): any subset of the model's (a trainer's bucket), the others
        keep their values. Nothing is serialized; the tensors are copied, so the caller may
        reuse them. A name the model lacks, a wrong shape, a non-float dtype or a value not
        finite: success False, the old weights serve on."""
        if load_format not in TENSOR_FORMATS:
            return self._refused(
                f"load_format {load_format!r} is not supported: pass the tensors by name "
                "(load_format null or direct)"
            )
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        source = TensorWeights(tuple((str(name), tensor) for name, tensor in items))
        return await self._update(source, abort_all_requests, weight_version, flush_cache)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP,
        backend: str | None = None,
        timeout_s: float = 300.0,
    ) -> GroupResult:
        """Join a trainer's process group (torch.distributed, as SGLang builds it) as rank
        `rank_offset` of `world_size`; backend gloo (the default on the CPU) or nccl (the
        default on CUDA). The trainer hosts the rendezvous at master_address:master_port.
        Every wait on the group, this join too, is bounded by timeout_s."""
        chosen = backend or ("nccl" if self.groups.device.type == "cuda" else "gloo")
        join = self.groups.join(
            group_name, chosen, master_address, master_port, rank_offset, world_size, timeout_s
        )
        try:
            await join
        except WeightSyncError as exc:
            return GroupResult(False, str(exc))
        return GroupResult(True, f"joined the weight update group {group_name!r} ({chosen})")

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = DEFAULT_GROUP,
        flush_cache: bool = True,
        weight_version: str | int | None = None,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        src_rank: int = 0,
    ) -> UpdateResult:
        """Receive these tensors by broadcast from the trainer (rank `src_rank` of the group,
        0 as SGLang assumes unless told), then serve them as `update_weights_from_tensor`
        does. The update commits only once every tensor arrived and fits; a description that
        does not fit the model, a trainer that dies or a timeout: success False, the old
        weights serve on, and the group is closed (the trainer joins again)."""
        if load_format not in TENSOR_FORMATS:
            return self._refused(f"load_format {load_format!r} is not supported (null or direct)")
        try:
            received = await self.groups.receive(group_name, names, dtypes, shapes, src_rank)
        except WeightSyncError as exc:
            return self._refused(str(exc))
        source = TensorWeights(tuple(received), origin=f"the group {group_name!r}")
        return await self._update(source, abort_all_requests, weight_version, flush_cache)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> GroupResult:
        """Leave the group (success False if none of that name is open)."""
        try:
            await self.groups.leave(group_name)
        except WeightSyncError as exc:
            return GroupResult(False, str(exc))
        return GroupResult(True, f"left the weight update group {group_name!r}")

    async def _update(
        self,
        source: WeightSource,
        abort_all_requests: bool,
        weight_version: str | int | None,
        flush_cache: bool,
    ) -> UpdateResult:
        """One writer through the update lock. flush_cache false is taken and answered: the
        prefix cache is flushed all the same (KV computed by the old weights never serves the
        new ones), which SGLang's RL callers do anyway before they push (pause, flush)."""
        version = None if weight_version is None else str(weight_version)
        if version is not None and not 0 < len(version) <= MAX_VERSION_CHARS:
            return self._refused(f"weight_version must be 1 to {MAX_VERSION_CHARS} characters")
        update = partial(UpdateWeights, source, abort_all_requests, version)
        try:
            result = await ask(self.actors.tokenizer_box, update)
        except InternalError as exc:
            return self._refused(str(exc))
        if result.success and not flush_cache:
            note = " (flush_cache false: the prefix cache was flushed all the same)"
            return UpdateResult(True, result.message + note, result.weight_version)
        return result

    def _refused(self, why: str) -> UpdateResult:
        return UpdateResult(False, why, self.weight_version)
