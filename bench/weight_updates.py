"""How fast new weights land: a weight update of the whole model from disk, from tensors in
this process, and from a trainer process over a gloo group on 127.0.0.1 (bench/
weight_trainer.py), each timed from the call to its answer with the engine idle (the update's
validation, staging in the serving layout, commit and cache flush included).

    python bench/weight_updates.py                    # the bundled SmolLM2, 3 runs of each
    python bench/weight_updates.py --model DIR --runs 5 --out bench/weight_updates.jsonl

    weight_update source=<disk|tensor|distributed> bytes=<B> runs=<n> seconds_median=<s>
        gb_per_s=<B / s / 1e9> setup=<device-dtype-linear> machine=<desc>

`bytes` is the checkpoint's tensors as stored (float32 for SmolLM2's converted folder): what
the source hands over.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from bench_format import dtype_name, emit, machine
from safetensors.torch import load_file

from shoal import Engine
from shoal.results import UpdateResult

TRAINER = Path(__file__).parent / "weight_trainer.py"


def checkpoint(folder: Path) -> list[tuple[str, torch.Tensor]]:
    named: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        named.update(load_file(file))
    return sorted(named.items())


async def timed(runs: int, update: Callable[[], Awaitable[UpdateResult]]) -> list[float]:
    seconds = []
    for _ in range(runs):
        began = time.perf_counter()
        result = await update()
        seconds.append(time.perf_counter() - began)
        assert result.success, result.message
    return seconds


async def distributed(engine: Engine, folder: Path, named: list[Any], runs: int) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    command = [sys.executable, str(TRAINER), str(port), str(folder), "push", str(runs)]
    trainer = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert trainer.stdin is not None and trainer.stdout is not None
    try:
        joined = await engine.init_weights_update_group("127.0.0.1", port, 1, 2, timeout_s=120)
        assert joined.success, joined.message
        names = [name for name, _ in named]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
        shapes = [list(t.shape) for _, t in named]
        seconds = []
        for run in range(runs):
            if run:
                trainer.stdin.write("next\n")
                trainer.stdin.flush()
            began = time.perf_counter()
            result = await engine.update_weights_from_distributed(names, dtypes, shapes)
            seconds.append(time.perf_counter() - began)
            assert result.success, result.message
            await asyncio.to_thread(trainer.stdout.readline)  # "sent N"
        await engine.destroy_weights_update_group()
        return seconds
    finally:
        trainer.stdin.close()
        trainer.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: SmolLM2)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    asyncio.run(measure(parser.parse_args(argv)))
    return 0


async def measure(args: argparse.Namespace) -> None:
    async with Engine(args.model) as engine:
        assert engine.loaded is not None and engine.resolved is not None
        folder = engine.loaded.path
        named = checkpoint(folder)
        size = sum(t.numel() * t.element_size() for _, t in named)
        r = engine.resolved
        setup = f"{r.device.type}-{dtype_name(r.dtype)}-{r.linear_kind}"
        sources: dict[str, Callable[[], Awaitable[list[float]]]] = {
            "disk": lambda: timed(args.runs, lambda: engine.update_weights_from_disk(folder)),
            "tensor": lambda: timed(args.runs, lambda: engine.update_weights_from_tensor(named)),
            "distributed": lambda: distributed(engine, folder, named, args.runs),
        }
        for source, run in sources.items():
            seconds = await run()
            median = statistics.median(seconds)
            line = {
                "source": source,
                "bytes": size,
                "runs": args.runs,
                "seconds_median": round(median, 3),
                "seconds": ",".join(f"{s:.3f}" for s in seconds),
                "gb_per_s": round(size / median / 1e9, 3),
                "setup": setup,
                "machine": machine(),
            }
            emit("weight_update", line, args.out)


if __name__ == "__main__":
    sys.exit(main())
