"""One steady decode window of bench/host_cost.py: B requests decoding together, the host's
CPU time per thread over `steps` launches, prefill excluded.

    start B requests (seeded random prompts of clean ids, ignore_eos, long max_new_tokens)
    wait until every one has streamed `warm_tokens` tokens: all admitted, all decoding
    clocks -> `steps` more launches (host_cost_fake.StepCounter) -> clocks
    abort all, wait until idle, flush the prefix cache (the next window starts clean)

What each clock counts (CPU time of the bench's own process, per native thread, read with
`pthread_getcpuclockid`, nanoseconds, from the event loop at the window's two edges):

- loop: the main thread, which runs the event loop: the tokenizer actor (detokenizing, stream
  pushes), the scheduler, the cache manager, the executor actor's mailbox, and the callers'
  stream readers (this file's `read`, one a request: what any caller of Engine.generate runs).
- launch: the executor's launch thread(s) ("shoal-launch"): table writes, inputs, sampling,
  the graph path's buffers; minus the trivial forward's own CPU time (`forward`, reported
  apart: it stands for device work).
- completion: the executor's completion thread(s) ("shoal-results"): results to host ints.
- other: the process's CPU time (all threads, ended ones too) minus the three above: torch's
  intra-op threads, the tokenizer actor's encode worker, anything else.
- total: the process's CPU time minus the trivial forward's.

A window's steps must all be decodes of exactly B rows (StepCounter.off); if any is not (a
request ended early, a retraction), the window raises rather than report a mixed figure.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from host_cost_fake import FakeDevice, StepCounter, TrivialForward

from shoal.params import SamplingParams

PROMPT_TOKENS = 16
SLACK_TOKENS = 64  # max_new_tokens beyond the window: early starters' lead, steps in flight
TIMEOUT_S = 600.0
THREAD_ROLES = (("launch", "shoal-launch"), ("completion", "shoal-results"))


@dataclass(frozen=True)
class Clocks:
    wall_s: float
    process_ns: int
    thread_ns: dict[str, int]  # loop, launch, completion: summed over the role's threads
    forward_ns: int
    launched: int
    off: int


@dataclass(frozen=True)
class Window:
    """One window's figures: per step, CPU in microseconds and wall in milliseconds."""

    batch: int
    steps: int
    step_ms: float
    cpu_us: dict[str, float]  # loop, launch, completion, other, total, forward
    device_busy: float  # device time / wall time (0 without --device-ms)


def thread_cpu_ns() -> dict[str, int]:
    totals = {"loop": 0, "launch": 0, "completion": 0}
    main = threading.main_thread()
    for thread in threading.enumerate():
        role = "loop" if thread is main else None
        for name, prefix in THREAD_ROLES:
            if thread.name.startswith(prefix):
                role = name
        if role is None or thread.ident is None:
            continue
        try:
            totals[role] += time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
        except (OSError, ProcessLookupError):  # ended meanwhile: an idle pool worker
            continue
    return totals


def clocks(forward: TrivialForward, counter: StepCounter) -> Clocks:
    return Clocks(
        time.perf_counter(),
        time.process_time_ns(),
        thread_cpu_ns(),
        forward.forward_ns,
        counter.launched,
        counter.off,
    )


def sampling_params(kind: str, max_new_tokens: int, seed: int) -> SamplingParams:
    """greedy, or sampled: temperature 0.7, top-p 0.9, a seed a request."""
    if kind == "greedy":
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=0.7, top_p=0.9, seed=seed, ignore_eos=True
    )


async def measure(
    engine: Any,
    forward: TrivialForward,
    counter: StepCounter,
    batch: int,
    steps: int,
    sampling: str,
    warm_tokens: int,
    seed: int,
    clean: list[int],
) -> Window:
    assert threading.current_thread() is threading.main_thread(), "the loop's clock: main"
    loop = asyncio.get_running_loop()
    rng = random.Random(f"{seed}-{batch}-{sampling}")
    max_new = warm_tokens + steps + SLACK_TOKENS
    streams = [
        engine.generate(
            input_ids=[rng.choice(clean) for _ in range(PROMPT_TOKENS)],
            sampling=sampling_params(sampling, max_new, seed + i),
        )
        for i in range(batch)
    ]
    warm = asyncio.Event()
    waiting = [batch]

    async def read(stream: Any) -> int:
        tokens, warmed = 0, False
        async for delta in stream:
            tokens += len(delta.token_ids)
            if not warmed and tokens >= warm_tokens:
                warmed, waiting[0] = True, waiting[0] - 1
                if waiting[0] == 0:
                    warm.set()
        return tokens

    readers = [asyncio.create_task(read(s)) for s in streams]
    await asyncio.wait_for(warm.wait(), TIMEOUT_S)
    done = asyncio.Event()
    counter.arm(steps, batch, lambda: loop.call_soon_threadsafe(done.set))
    before = clocks(forward, counter)
    await asyncio.wait_for(done.wait(), TIMEOUT_S)
    after = clocks(forward, counter)
    for stream in streams:
        engine.abort(stream.rid)
    received = await asyncio.gather(*readers)
    await engine.wait_idle()
    flushed = await engine.flush_cache()
    assert flushed.success, flushed.message
    if after.off != before.off or max(received) >= max_new:
        raise RuntimeError(
            f"batch {batch}: {after.off - before.off} of the window's steps were not decodes "
            f"of all {batch} requests (max tokens streamed {max(received)} of {max_new})"
        )
    return window_of(before, after, batch, forward.fake)


def window_of(before: Clocks, after: Clocks, batch: int, fake: FakeDevice) -> Window:
    steps = after.launched - before.launched
    wall = after.wall_s - before.wall_s
    ns = {k: after.thread_ns[k] - before.thread_ns[k] for k in before.thread_ns}
    forward_ns = after.forward_ns - before.forward_ns
    process_ns = after.process_ns - before.process_ns
    cpu_ns = {
        "loop": ns["loop"],
        "launch": ns["launch"] - forward_ns,
        "completion": ns["completion"],
        "other": process_ns - sum(ns.values()),
        "total": process_ns - forward_ns,
        "forward": forward_ns,
    }
    busy = fake.busy_s(before.wall_s, after.wall_s, steps) / wall
    return Window(
        batch,
        steps,
        wall / steps * 1e3,
        {k: v / steps / 1e3 for k, v in cpu_ns.items()},
        busy,
    )
