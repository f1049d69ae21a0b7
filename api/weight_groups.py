"""The engine's weight-update groups with trainers, by name (loading/weight_group.py): joined,
received from and left on one thread of their own, so the event loop never blocks on a
rendezvous or a broadcast (sglang #4096) and the calls on the groups run in their order.

What a broadcast delivers is only tensors: the engine hands them to a weight update from
tensors (api/weight_calls.py), which validates and commits them whole or not at all. A receive
that fails (the trainer died, the timeout passed, the names did not fit the model) closes its
group, since the trainer's side of it can no longer be trusted to be in step: the trainer
joins again (`init_weights_update_group`) before the next push.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import msgspec
import torch

from shoal.loading.config import ModelConfig
from shoal.loading.weight_group import BACKENDS, JoinedGroup, join_group, leave_group, receive
from shoal.models.load import expected_weight_shapes

log = logging.getLogger("shoal.weights")

Spec = tuple[str, torch.dtype, tuple[int, ...]]
T = TypeVar("T")


class GroupResult(msgspec.Struct, frozen=True):
    """A group call's end (SGLang's {"success", "message"})."""

    success: bool
    message: str


class WeightSyncError(Exception):
    """A group call refused or failed; the message is for the caller."""


class WeightGroups:
    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.groups: dict[str, JoinedGroup] = {}
        self.joining: set[str] = set()
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-weight-sync")

    async def join(
        self,
        name: str,
        backend: str,
        address: str,
        port: int,
        rank_offset: int,
        world_size: int,
        timeout_s: float,
    ) -> None:
        """Join the trainer's group `name` as rank `rank_offset` (WeightSyncError: refused,
        or the rendezvous failed or timed out)."""
        if name in self.groups or name in self.joining:
            raise WeightSyncError(f"a weight update group {name!r} is already open")
        if backend not in BACKENDS:
            raise WeightSyncError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise WeightSyncError(
                f"backend nccl needs a CUDA device; this engine runs on "
                f"{self.device.type}: use gloo"
            )
        if not 0 <= rank_offset < world_size:
            raise WeightSyncError(
                f"rank_offset must be in [0, world_size), got {rank_offset} "
                f"with world_size {world_size}"
            )
        if not 0 < port < 65536:
            raise WeightSyncError(f"master_port must be in [1, 65535], got {port}")
        if not 0 < timeout_s <= 86400:
            raise WeightSyncError(f"timeout_s must be in (0, 86400], got {timeout_s}")
        joining = partial(
            join_group,
            name,
            backend,
            address,
            port,
            rank_offset,
            world_size,
            timeout_s,
            self.device,
        )
        self.joining.add(name)
        try:
            self.groups[name] = await self._run(joining)
        except Exception as exc:  # the rendezvous's errors: refused, reset, timed out
            log.warning("joining weight update group %r failed: %s", name, exc)
            raise WeightSyncError(
                f"could not join the group {name!r}: {_first_line(exc)}"
            ) from None
        finally:
            self.joining.discard(name)

    async def receive(
        self,
        name: str,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        src_rank: int,
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors the trainer broadcasts from `src_rank`, as described (WeightSyncError:
        the description does not fit the model, or a broadcast failed; the group is closed)."""
        joined = self.groups.get(name)
        if joined is None:
            raise WeightSyncError(f"no weight update group {name!r} is open")
        try:
            specs = check_specs(self.config, names, dtypes, shapes)
            if not 0 <= src_rank < joined.world_size or src_rank == joined.rank:
                raise WeightSyncError(
                    f"src_rank must be the trainer's rank in [0, {joined.world_size}), not "
                    f"this engine's ({joined.rank}), got {src_rank}"
                )
            return await self._run(partial(receive, joined, specs, src_rank))
        except WeightSyncError as exc:
            await self._close(name, str(exc))
            raise WeightSyncError(f"{exc}; the group {name!r} was closed") from None
        except Exception as exc:  # a broadcast: the trainer died, or the timeout passed
            why = f"receiving from the group {name!r} failed: {_first_line(exc)}"
            await self._close(name, why)
            raise WeightSyncError(f"{why}; the group was closed") from None

    async def leave(self, name: str) -> None:
        """Destroy the group `name` (WeightSyncError if none is open)."""
        if name not in self.groups:
            raise WeightSyncError(f"no weight update group {name!r} is open")
        await self._close(name, "destroyed")

    def close(self) -> None:
        """The engine stops: leave every group on the way out, without waiting."""
        for joined in self.groups.values():
            self.thread.submit(_quietly_leave, joined)
        self.groups.clear()
        self.thread.shutdown(wait=False)

    async def _close(self, name: str, why: str) -> None:
        joined = self.groups.pop(name, None)
        if joined is not None:
            log.info("weight update group %r closed: %s", name, why)
            await self._run(partial(_quietly_leave, joined))

    async def _run(self, call: partial[T]) -> T:
        return await asyncio.wrap_future(self.thread.submit(call))


def check_specs(
    config: ModelConfig, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> list[Spec]:
    """The broadcasts to receive, each a tensor of this model by name and shape, in a
    floating-point dtype (WeightSyncError naming the first that is not)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightSyncError(
            f"names, dtypes and shapes must be as long: {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    if not names:
        raise WeightSyncError("names must name at least one tensor")
    expected = expected_weight_shapes(config)
    if config.tie_word_embeddings and "model.embed_tokens.weight" in expected:
        expected = {**expected, "lm_head.weight": expected["model.embed_tokens.weight"]}
    specs: list[Spec] = []
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        if name not in expected:
            raise WeightSyncError(f"tensor {name!r} is not one of this model's")
        dtype = getattr(torch, dtype_name.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise WeightSyncError(f"tensor {name!r}: dtype {dtype_name!r} is not a float dtype")
        if tuple(shape) != expected[name]:
            raise WeightSyncError(
                f"tensor {name!r} has shape {tuple(shape)}, expected {expected[name]}"
            )
        specs.append((name, dtype, expected[name]))
    return specs


def _quietly_leave(joined: JoinedGroup) -> None:
    with contextlib.suppress(Exception):  # a broken group may fail to say goodbye
        leave_group(joined)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
