"""A process group with a trainer, for weights pushed by broadcast (SGLang's
init_weights_update_group / update_weights_from_distributed / destroy_weights_update_group).

The group is built the way SGLang's `init_custom_process_group` builds it, so a trainer that
joins SGLang's joins ours: a rendezvous at tcp://address:port (the trainer, rank 0 there,
hosts the store), a PrefixStore named after the group, and a process group over it that is
not torch's default one (`init_process_group` would prefix its keys "default_pg" and never
meet). The engine is one process: its rank is `rank_offset`. Every call here blocks; the
caller runs them on a thread of their own (api/weight_groups.py), never the event loop
(sglang #4096), and every wait is bounded by the group's timeout.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    GroupName,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

BACKENDS = ("gloo", "nccl")


@dataclass
class JoinedGroup:
    name: str
    backend: str
    rank: int
    world_size: int
    timeout: datetime.timedelta
    device: torch.device  # where broadcasts are received: the CPU for gloo
    group: dist.ProcessGroup


def join_group(
    name: str,
    backend: str,
    address: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    device: torch.device,
) -> JoinedGroup:
    """Join the trainer's group as `rank` (raises RuntimeError or its subclasses, e.g. on
    a timeout when the trainer never comes)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    nccl = backend == "nccl"
    if nccl:  # this thread's device: NCCL binds the communicator to it (sglang #24284)
        torch.cuda.set_device(device)
    store, _, _ = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefixed = PrefixStore(name, store)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        prefixed,
        group_name=GroupName(name),
        timeout=timeout,
        device_id=device if nccl else None,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    where = torch.device("cpu") if backend == "gloo" else device
    return JoinedGroup(name, backend, rank, world_size, timeout, where, group)


def receive(
    joined: JoinedGroup,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    src_rank: int,
) -> list[tuple[str, torch.Tensor]]:
    """One broadcast from `src_rank` a tensor, in order, each into a new tensor of its dtype
    and shape (raises RuntimeError when the sender dies or the timeout passes)."""
    if joined.backend == "nccl":
        torch.cuda.set_device(joined.device)
    out = []
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=dtype, device=joined.device)
        options = dist.BroadcastOptions()
        options.rootRank = src_rank
        options.rootTensor = 0
        options.timeout = joined.timeout
        joined.group.broadcast([tensor], options).wait(joined.timeout)
        out.append((name, tensor))
    return out


def leave_group(joined: JoinedGroup) -> None:
    """Destroy the group (its peers see it gone)."""
    dist.destroy_process_group(joined.group)
