"""One round of bench/speculative.py: its requests timed token by token, its rates, and at N
streams where speculation may run apart from where it may not.

A step speculates only while at most `speculative_max_running` (M) requests run, so a round of
N > M streams runs the same code with speculation on and off until its (N - M)-th request ends
(the head) and may differ only after it (the tail). The head's rate on over off is then the
machine's noise alone, and the tail's is what speculation did where it ran.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from speculative_prompts import WORKLOADS


@dataclass
class Round:
    rate: float  # all output tokens over the round's wall time
    decode_rate: float  # tokens after each request's first over the time after their median first
    tokens: int
    each: list[float] = field(default_factory=list)  # one stream: each request's own rate
    head_rate: float | None = None  # N > M streams: tokens over time while more than M run
    tail_rate: float | None = None  # .. and once at most M run


async def timed(run: Any) -> list[tuple[float, int]]:
    """A request read to its end: when each of its deltas came, and its tokens."""
    stamps: list[tuple[float, int]] = []
    async for delta in run:
        if delta.token_ids:
            stamps.append((time.perf_counter(), len(delta.token_ids)))
    return stamps


def split(
    done: list[list[tuple[float, int]]], started: float, ended: float, max_running: int
) -> tuple[float, float] | None:
    """The head's and the tail's rates of a wave of requests started together, the tail from
    the moment at most `max_running` of them are left (None: never more ran)."""
    if len(done) <= max_running:
        return None
    ends = sorted(stamps[-1][0] if stamps else started for stamps in done)
    turn = ends[len(done) - max_running - 1]  # the (N - M)-th request's end
    head = sum(n for stamps in done for at, n in stamps if at <= turn)
    tail = sum(n for stamps in done for at, n in stamps if at > turn)
    return head / max(turn - started, 1e-9), tail / max(ended - turn, 1e-9)


async def one_round(
    engine: Any, workload: str, streams: int, prompts: int, max_tokens: int, max_running: int
) -> Round:
    """One stream: the workload's first `prompts` prompts one after another, their times
    summed; N streams: N requests at once, prompt i % (its prompts)."""
    waves = [[i] for i in range(prompts)] if streams == 1 else [list(range(streams))]
    messages = WORKLOADS[workload]
    wall = after_first = 0.0
    tokens = later = 0
    each: list[float] = []
    parts = None
    for wave in waves:
        started = time.perf_counter()
        runs = [
            engine.generate(messages=messages(i), max_new_tokens=max_tokens, temperature=0.0)
            for i in wave
        ]
        done = await asyncio.gather(*(timed(r) for r in runs))
        ended = time.perf_counter()
        wave_tokens = sum(n for stamps in done for _, n in stamps)
        wall += ended - started
        after_first += ended - median(stamps[0][0] if stamps else ended for stamps in done)
        tokens += wave_tokens
        later += wave_tokens - len(wave)
        if streams == 1:
            each.append(wave_tokens / (ended - started))
        else:
            parts = split(done, started, ended, max_running)
    head, tail = parts if parts is not None else (None, None)
    return Round(tokens / wall, later / max(after_first, 1e-9), tokens, each, head, tail)
