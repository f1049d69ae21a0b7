"""One call in a thread of its own that ends with it: the start's torch work.

libgomp, torch's OpenMP on Linux, keeps a team of worker threads for every thread that has run a
parallel region, as long as that thread lives; while the process holds more such threads than
CPUs, every team's barriers sleep at once instead of spinning, and each of a step's ~240 kernel
calls then waits for its worker to be woken. On the 2-core AMD EPYC VM a one-row int8 forward on
a worker thread took 7.6-8.5 ms alone and 14.2-15.9 ms once the main thread had run one parallel
op (bench/README.md). So the start's loading, quantizing and KV pool zeros run here, in a thread
that exits and takes its team with it (asyncio.to_thread's workers live on, and the event loop's
thread lives for good), leaving the launch thread's team the only one."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


async def in_fresh_thread(func: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """func(*args, **kwargs) in a new thread, awaited; its exception is raised here."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # the awaiting task was cancelled
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = func(*args, **kwargs), None
        except BaseException as exc:
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=f"shoal-{func.__name__}", daemon=True).start()
    return await done
