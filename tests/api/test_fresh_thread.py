"""The start's torch work runs off the event loop's thread, in threads that end with it
(api/fresh_thread.py): a parallel op on a thread that lives on leaves libgomp a second team of
threads, and then every barrier of the CPU forward sleeps (a one-row int8 step 2x slower)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from engines import EngineFactory
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shoal.api import startup
from shoal.api.fresh_thread import in_fresh_thread

GRAIN = 32768  # at::internal::GRAIN_SIZE: an op on fewer elements never starts a parallel region
# 128 rows of a 4096-token context in pages of 16: a page table of 32,768 ids, one op's GRAIN
OPTIONS: dict[str, Any] = {"max_running_requests": 128, "context_length": 4096}


class LoopThreadOps(TorchDispatchMode):
    """The ops of GRAIN elements or more, views aside, that run on this thread (a dispatch
    mode is the thread's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if not func.is_view and max(sizes, default=0) >= GRAIN:
            self.seen.append(str(func))
        return out


async def test_a_start_and_its_steps_run_no_parallel_op_on_the_loop_thread(
    make_engine: EngineFactory,
) -> None:
    with LoopThreadOps() as ops:
        engine = await make_engine(**OPTIONS)
        await engine.generate(prompt="a few steps", max_new_tokens=4, ignore_eos=True).result()
    assert ops.seen == []


async def test_the_check_sees_a_build_on_the_loop_thread(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: the build run on the loop's thread shows (the page table's
    zeros, 128 x 256 ids)."""

    async def inline(func: Any, *args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    monkeypatch.setattr(startup, "in_fresh_thread", inline)
    with LoopThreadOps() as ops:
        await make_engine(**OPTIONS)
    assert "aten.zeros.default" in ops.seen


async def test_the_call_runs_in_a_thread_that_ends() -> None:
    threads: list[threading.Thread] = []

    def work(x: int, *, y: int) -> int:
        threads.append(threading.current_thread())
        return x + y

    assert await in_fresh_thread(work, 2, y=3) == 5
    assert threads[0] is not threading.main_thread()
    threads[0].join(timeout=5)
    assert not threads[0].is_alive()

    def fails() -> None:
        raise KeyError("the load's error")

    with pytest.raises(KeyError, match="the load's error"):
        await in_fresh_thread(fails)
