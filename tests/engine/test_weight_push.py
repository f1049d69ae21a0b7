"""Weights pushed in, not read from disk (api/weight_calls.py): from tensors in this process,
and broadcast by a trainer in another process over a gloo group (tests/support/
weight_trainer.py). Each lands whole or not at all: after a good push the engine answers as
one started on that checkpoint; after a refused or failed one (a wrong shape, a trainer that
dies mid-update, a timeout) the old weights serve on and the engine is idle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engines import EngineFactory
from processes import wait_for
from weight_pushes import Trainer, checkpoint, free_port, specs
from workload import prompt

from shoal import Engine
from shoal.models.load import load_model

PROMPTS = [prompt(9, seed) for seed in range(3)]


async def greedy(engine: Engine) -> list[list[int]]:
    outs = []
    for ids in PROMPTS:
        done = await engine.generate(
            input_ids=ids, max_new_tokens=8, temperature=0.0, ignore_eos=True
        ).result()
        outs.append(list(done.token_ids))
    return outs


@pytest.fixture
async def answers(
    make_engine: EngineFactory, tiny_folder: Path, other_folder: Path
) -> dict[Path, list[list[int]]]:
    """Greedy answers of engines started on each checkpoint."""
    out = {}
    for folder in (tiny_folder, other_folder):
        out[folder] = await greedy(await make_engine(load_model(folder, progress=False)))
    assert out[tiny_folder] != out[other_folder]
    return out


# ---- from tensors -------------------------------------------------------------------------


async def test_tensors_in_buckets_serve_the_other_checkpoint(
    make_engine: EngineFactory,
    tiny_folder: Path,
    other_folder: Path,
    answers: dict[Path, list[list[int]]],
) -> None:
    engine = await make_engine(page_size=4)
    assert await greedy(engine) == answers[tiny_folder]
    named = sorted(checkpoint(other_folder).items())
    half = len(named) // 2
    first = await engine.update_weights_from_tensor(named[:half], weight_version="step-1")
    assert first.success and first.weight_version == "step-1", first
    for _, tensor in named[:half]:
        tensor.zero_()  # the engine copied them: the caller may reuse its buffers
    second = await engine.update_weights_from_tensor(dict(named[half:]), flush_cache=False)
    assert second.success and second.weight_version == "step-1", second
    assert "flushed all the same" in second.message
    assert await greedy(engine) == answers[other_folder]
    # and back, in one push of float16 tensors on the CPU (cast to the model's dtype)
    back = {name: t.to(torch.float16) for name, t in checkpoint(tiny_folder).items()}
    again = await engine.update_weights_from_tensor(back, weight_version=7)
    assert again.success and again.weight_version == "7", again
    assert (await engine.cache_stats()).cached_tokens == 0  # flushed with each update


async def test_a_refused_push_leaves_the_old_weights_and_the_engine_idle(
    make_engine: EngineFactory,
    tiny_folder: Path,
    other_folder: Path,
    answers: dict[Path, list[list[int]]],
) -> None:
    engine = await make_engine(page_size=4)
    good = checkpoint(other_folder)
    name, tensor = sorted(good.items())[0]
    nan = tensor.clone()
    nan.view(-1)[0] = float("nan")
    wrong: list[tuple[dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]], str]] = [
        ({**good, name: tensor[:1]}, "has shape"),
        ({**good, "model.layers.99.mlp.up_proj.weight": tensor}, "not one of this model's"),
        ({**good, name: tensor.to(torch.int32)}, "not a floating-point tensor"),
        ({**good, name: nan}, "not finite"),
        ([(name, tensor), (name, tensor)], "given twice"),
        ({}, "no tensor"),
    ]
    for push, why in wrong:
        result = await engine.update_weights_from_tensor(push, weight_version="bad")
        assert not result.success and why in result.message, result
        assert result.weight_version == engine.weight_version == "0"
        snap = await engine.snapshot()
        assert snap.idle
        assert await greedy(engine) == answers[tiny_folder]
    refused = await engine.update_weights_from_tensor(good, load_format="flattened_bucket")
    assert not refused.success and "load_format" in refused.message


# ---- from a trainer's process group -------------------------------------------------------


@pytest.fixture
def trainers() -> Iterator[list[Trainer]]:
    started: list[Trainer] = []
    yield started
    for trainer in started:
        trainer.stop()


async def joined(engine: Engine, trainer: Trainer, timeout_s: float = 60.0) -> None:
    result = await engine.init_weights_update_group(
        "127.0.0.1", trainer.port, 1, 2, backend="gloo", timeout_s=timeout_s
    )
    assert result.success, result.message
    assert await asyncio.to_thread(trainer.line) == "joined"


async def test_a_trainer_pushes_the_other_checkpoint_by_broadcast(
    make_engine: EngineFactory,
    trainers: list[Trainer],
    tiny_folder: Path,
    other_folder: Path,
    answers: dict[Path, list[list[int]]],
) -> None:
    engine = await make_engine(page_size=4)
    trainer = Trainer(other_folder, "push")
    trainers.append(trainer)
    await joined(engine, trainer)
    again = await engine.init_weights_update_group("127.0.0.1", trainer.port, 1, 2)
    assert not again.success and "already open" in again.message
    names, dtypes, shapes = specs(other_folder)
    result = await engine.update_weights_from_distributed(
        names, dtypes, shapes, weight_version="2", flush_cache=True
    )
    assert result.success and result.weight_version == "2", result
    assert await asyncio.to_thread(trainer.line) == f"sent {len(names)}"
    assert await greedy(engine) == answers[other_folder]
    assert (await engine.destroy_weights_update_group()).success
    gone = await engine.destroy_weights_update_group()
    assert not gone.success and "no weight update group" in gone.message


async def test_a_trainer_that_dies_mid_update_leaves_the_old_weights(
    make_engine: EngineFactory,
    trainers: list[Trainer],
    tiny_folder: Path,
    other_folder: Path,
    answers: dict[Path, list[list[int]]],
) -> None:
    engine = await make_engine(page_size=4)
    trainer = Trainer(other_folder, "die")
    trainers.append(trainer)
    await joined(engine, trainer, timeout_s=30)
    result = await engine.update_weights_from_distributed(*specs(other_folder))
    assert not result.success and "the group was closed" in result.message, result
    assert result.weight_version == engine.weight_version == "0"
    assert (await engine.snapshot()).idle
    assert await greedy(engine) == answers[tiny_folder]
    closed = await engine.update_weights_from_distributed(*specs(other_folder))
    assert not closed.success and "no weight update group" in closed.message


async def test_a_wrong_shape_and_a_timeout_leave_the_old_weights(
    make_engine: EngineFactory,
    trainers: list[Trainer],
    tiny_folder: Path,
    other_folder: Path,
    answers: dict[Path, list[list[int]]],
) -> None:
    engine = await make_engine(page_size=4)
    names, dtypes, shapes = specs(other_folder)
    # a shape the model does not have: refused before anything is received
    trainer = Trainer(other_folder, "silent")
    trainers.append(trainer)
    await joined(engine, trainer)
    bad = [list(shape) for shape in shapes]
    bad[0][0] += 1
    result = await engine.update_weights_from_distributed(names, dtypes, bad)
    assert not result.success and "has shape" in result.message, result
    assert await greedy(engine) == answers[tiny_folder]
    # a trainer that joins and never sends: the receive gives up after the group's timeout
    trainer = Trainer(other_folder, "silent")
    trainers.append(trainer)
    await asyncio.to_thread(wait_for, trainer.listening, 60, "the trainer's store")
    await joined(engine, trainer, timeout_s=2)  # the trainer is up: 2 s is enough to join
    began = time.monotonic()
    result = await engine.update_weights_from_distributed(names, dtypes, shapes)
    assert not result.success and "the group was closed" in result.message, result
    assert time.monotonic() - began < 30
    assert result.weight_version == engine.weight_version == "0"
    assert (await engine.snapshot()).idle
    assert await greedy(engine) == answers[tiny_folder]


async def test_a_rendezvous_nobody_comes_to_times_out_off_the_event_loop(
    make_engine: EngineFactory, tiny_folder: Path, answers: dict[Path, list[list[int]]]
) -> None:
    engine = await make_engine(page_size=4)
    waiting = asyncio.create_task(
        engine.init_weights_update_group("127.0.0.1", free_port(), 1, 2, timeout_s=3)
    )
    assert await greedy(engine) == answers[tiny_folder]  # served while the join waits
    assert not waiting.done()
    result = await waiting
    assert not result.success and "could not join" in result.message, result
    for wrong, why in (
        ({"backend": "nccl"}, "needs a CUDA device"),
        ({"backend": "mpi"}, "backend must be one of"),
        ({"rank_offset": 2}, "rank_offset must be in"),
        ({"timeout_s": 0}, "timeout_s must be in"),
    ):
        args = {"rank_offset": 1, "timeout_s": 3.0, **wrong}
        refused = await engine.init_weights_update_group("127.0.0.1", 1, world_size=2, **args)
        assert not refused.success and why in refused.message, refused
