"""A trainer process that pushes a checkpoint's weights to an engine by broadcast, as SGLang's
RL trainers do (slime's update_weight_from_distributed.py, AReaL's fsdp_engine.py): it hosts
the rendezvous as rank 0 of a group it builds the way SGLang's `init_custom_process_group`
does (written here from that recipe, not imported from shoal), then broadcasts each tensor.
The weight-push tests (tests/engine/test_weight_push.py) and bench/weight_updates.py run it.

    python weight_trainer.py PORT FOLDER MODE [REPEATS [GROUP]]

MODE: "push" broadcasts every tensor of FOLDER (sorted by name), REPEATS times (1), each after
a line on stdin but the first, and waits for one more line before it leaves; "die" broadcasts
half of them, then exits at once (a trainer that dies mid-update); "silent" joins and
broadcasts nothing (a trainer that never sends). It prints "joined" once the group is up and
"sent N" after each round of broadcasts.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import (
    Backend,
    GroupName,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)


def tensors(folder: Path) -> list[tuple[str, torch.Tensor]]:
    named: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        named.update(load_file(file))
    return sorted(named.items())


def main() -> None:
    port, folder, mode = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    name = sys.argv[5] if len(sys.argv) > 5 else "weight_update_group"  # SGLang's default
    timeout = datetime.timedelta(seconds=60)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world, rank, [], Backend("gloo"), PrefixStore(name, store), GroupName(name), timeout=timeout
    )
    _world.pg_group_ranks[group] = {0: 0, 1: 1}
    print("joined", flush=True)
    named = tensors(folder)
    if mode == "die":
        named = named[: len(named) // 2]
    elif mode == "silent":
        named = []
    for round_ in range(repeats):
        if round_:
            sys.stdin.readline()
        for _, tensor in named:
            dist.broadcast(tensor.contiguous(), src=0, group=group)
        print(f"sent {len(named)}", flush=True)
    if mode == "die":
        os._exit(1)
    sys.stdin.readline()  # the test says when to go: the group stays up until then


if __name__ == "__main__":
    main()
