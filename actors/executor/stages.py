"""Pipeline stages: the model's layers split across executor stages, microbatches passed from
stage to stage in launch order.

    launch thread ── stage 0: table writes, embed, layers [0, a) ──▶ queue 1
    stage 1 thread ── layers [a, b) ──▶ queue 2 ── ... ──▶ last stage thread: layers [.., L),
    final norm, head, sampling, results to the host ──▶ the step's future (PendingStep)

Each stage holds its part of the weights (layout.Part), the K/V of its layers (its own KVPool;
a page is the same page in every stage's pool), a copy of the request-slot table on its device
and its own stream. A stage takes microbatches one at a time, in the order they were launched
(one worker thread, FIFO), so every stage sees the same order and a later microbatch never
overtakes an earlier one.

Why no lifecycle operation can land among microbatches (docs/architecture.md, "Pipeline
stages"): the scheduler's planner counts a batch in flight from its launch until its result
has come back from the last stage (`Planner.batches`); idleness, flushes, weight updates,
releases of rows and pages and window trims are all decided from that count, so a microbatch
in any stage holds everything it reads. Microbatches hold disjoint requests
(`PlannerConfig.disjoint`): a decode's input is the token the last stage sampled for the same
request, which exists only once that request's previous microbatch has come back.

A stage that raises fails that microbatch (its future gets the exception: the step's
StepDone carries the error) and takes the next one; nothing waits forever.

`StageMonitor` counts the microbatches in each stage (for /get_server_info and /metrics) and
is the tests' seam: `hold(k)` stops stage k before its next microbatch until `release(k)`,
`fail_next(k)` makes stage k raise on its next one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from shoal.actors.executor.streams import StepStreams
from shoal.kernels.batch import AttentionBackend, BatchShape
from shoal.models.decoder import DecoderModel
from shoal.models.kv_pool import KVPool


@dataclass
class Stage:
    model: DecoderModel  # its part of the layers (model.part)
    kv: KVPool  # the K/V of exactly those layers
    attention: AttentionBackend
    streams: StepStreams


@dataclass
class Microbatch:
    """What the stages after the first need of a launched batch."""

    shape: BatchShape
    positions: torch.Tensor  # [T] on the first stage's device
    sample_index: torch.Tensor  # [S]
    context: Any  # what the last stage's `finish` needs (sampling rows, ...)


class StageFailed(RuntimeError):
    """A fault injected into a stage by the tests (`StageMonitor.fail_next`)."""


class StageMonitor:
    """Microbatches in each stage, and the tests' hold/fail seam (module doc)."""

    def __init__(self, num_stages: int) -> None:
        self.lock = threading.Condition()
        self.in_stage = [0] * num_stages
        self.held = [False] * num_stages
        self.failing = [False] * num_stages

    def enter(self, stage: int) -> None:
        with self.lock:
            self.in_stage[stage] += 1
            self.lock.notify_all()

    def leave(self, stage: int) -> None:
        with self.lock:
            self.in_stage[stage] -= 1
            self.lock.notify_all()

    def counts(self) -> tuple[int, ...]:
        with self.lock:
            return tuple(self.in_stage)

    def hold(self, stage: int) -> None:
        with self.lock:
            self.held[stage] = True

    def release(self, stage: int) -> None:
        with self.lock:
            self.held[stage] = False
            self.lock.notify_all()

    def fail_next(self, stage: int) -> None:
        with self.lock:
            self.failing[stage] = True

    def wait_until(self, ready: Callable[[tuple[int, ...]], bool], timeout: float) -> bool:
        """Block until `ready(counts)` (tests: "one microbatch sits in stage 2")."""
        with self.lock:
            return self.lock.wait_for(lambda: ready(tuple(self.in_stage)), timeout)

    def gate(self, stage: int) -> None:
        """Called by a stage before each microbatch: wait while held; raise if failing."""
        with self.lock:
            self.lock.wait_for(lambda: not self.held[stage])
            if self.failing[stage]:
                self.failing[stage] = False
                raise StageFailed(f"injected failure in pipeline stage {stage}")


class StagePipeline:
    """The stages after the first (stage 0 runs on the executor's launch thread)."""

    def __init__(
        self,
        stages: list[Stage],
        tables: list[torch.Tensor],
        monitor: StageMonitor,
        finish: Callable[[Stage, torch.Tensor, Microbatch], Any],
    ) -> None:
        self.stages = stages  # all of them, stage 0 first
        self.tables = tables  # each stage's request-slot table, on its device
        self.monitor = monitor
        self.finish = finish  # the last stage's: h -> the step's host result
        self.workers = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shoal-stage{k}")
            for k in range(1, len(stages))
        ]

    def submit(self, h: torch.Tensor, micro: Microbatch) -> Future[Any]:
        """Hand stage 0's output on; the future gets the last stage's result or the error."""
        future: Future[Any] = Future()
        self._pass(1, h, micro, future)
        return future

    def shutdown(self) -> None:
        """Take no more microbatches; those already queued still run and answer their
        futures (the completion thread waits on each), so no thread waits forever."""
        for worker in self.workers:
            worker.shutdown(wait=False, cancel_futures=False)

    def _pass(self, stage: int, h: torch.Tensor, micro: Microbatch, future: Future[Any]) -> None:
        self.monitor.enter(stage)
        try:
            self.workers[stage - 1].submit(self._run, stage, h, micro, future)
        except RuntimeError as exc:  # shut down (the engine stopped): answer, never drop
            self.monitor.leave(stage)
            future.set_exception(exc)

    def _run(self, k: int, h: torch.Tensor, micro: Microbatch, future: Future[Any]) -> None:
        stage = self.stages[k]
        last = k == len(self.stages) - 1
        try:
            self.monitor.gate(k)
            device = stage.model.device
            with stage.streams.computing():
                h = h.to(device)
                positions = micro.positions.to(device)
                attention = stage.attention.prepare(self.tables[k], micro.shape)
                h = stage.model.run_layers(
                    h, positions, attention, stage.kv, rows=micro.shape.kernel_rows()
                )
                result = self.finish(stage, h, micro) if last else None
            stage.streams.synchronize()  # h is whole before the next stage reads it
        except BaseException as exc:
            self.monitor.leave(k)
            future.set_exception(exc)
            return
        self.monitor.leave(k)
        if last:
            future.set_result(result)
        else:
            self._pass(k + 1, h, micro, future)


def split_layers(num_layers: int, stages: int, given: str | None) -> list[range]:
    """Each stage's layers: `given` ("10,20") or an even split (the earlier stages take one
    more when it does not divide). ValueError when they do not cover the model."""
    if given is not None:
        counts = [int(c) for c in given.split(",")]
        if any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise ValueError(
                f"stage_layers {given!r} must be positive and add up to the model's "
                f"{num_layers} layers"
            )
    else:
        if stages > num_layers:
            raise ValueError(f"pipeline_stages {stages} exceeds the model's {num_layers} layers")
        base, extra = divmod(num_layers, stages)
        counts = [base + (1 if k < extra else 0) for k in range(stages)]
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def stage_devices(stages: int, given: str | None, default: torch.device) -> list[torch.device]:
    """Each stage's device: `given` ("cuda:0,cuda:1"), else consecutive CUDA devices from the
    engine's (wrapping when there are fewer), else the engine's device for every stage."""
    if given is not None:
        return [torch.device(name.strip()) for name in given.split(",")]
    if default.type != "cuda":
        return [default] * stages
    count = torch.cuda.device_count()
    first = default.index or 0
    return [torch.device("cuda", (first + k) % count) for k in range(stages)]
