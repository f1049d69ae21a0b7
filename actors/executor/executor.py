"""The executor actor: owns the device (`DeviceState`) and two worker threads.

    mailbox ─Launch─▶ launch thread ── DeviceState.launch: table writes, forward, sampling,
                      (in launch order)  results start for the host ──▶ PendingStep
                                                                            │
    scheduler ◀─StepDone── event loop ◀── completion thread ── PendingStep.result (waits)
                                          (in launch order)

Neither thread is the event loop, so it never blocks. Each launch applies its table writes
before its forward, in one stream: a row written for batch N+1 is never seen by batch N
(docs/architecture.md, "Lifecycle laws", law 3, by execution order). On CUDA the launch
thread only queues work, so it prepares batch N+1 while the device still runs batch N; the
completion thread does the waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from shoal.actors.executor.device_state import DeviceState
from shoal.actors.executor.pending_step import PendingStep, StepResult
from shoal.actors.executor_messages import ExecutorMsg, Launch, LoadWeights, SetMemory
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import SchedulerMsg, Shutdown, StepDone
from shoal.actors.replies import answer, refuse
from shoal.actors.supervise import FaultInjector, fail_replies, serve
from shoal.results import InternalError, OperationRefused

log = logging.getLogger("shoal.executor")


class Executor:
    def __init__(
        self,
        device_state: DeviceState,
        mailbox: Mailbox[ExecutorMsg],
        scheduler: Mailbox[SchedulerMsg],
        graph_max_batch: int = 0,
        context_length: int = 0,
        faults: FaultInjector | None = None,
    ) -> None:
        self.state = device_state
        self.mailbox = mailbox
        self.scheduler = scheduler
        self.graph_max_batch = graph_max_batch  # 0: no CUDA graphs
        self.context_length = context_length
        self.faults = faults
        self.launcher = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="shoal-launch",
            initializer=torch.set_flush_denormal,  # denormals slow x86 math ~2x
            initargs=(True,),
        )
        self.completer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-results")
        self.running: set[Future[StepResult]] = set()

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            if self.graph_max_batch > 0:
                capture = partial(
                    self.state.capture_graphs, self.graph_max_batch, self.context_length
                )
                await asyncio.wrap_future(self.launcher.submit(capture))
            await serve("executor", self.mailbox, self.faults, self.handle, self.recover)
        finally:
            self.launcher.shutdown(wait=False, cancel_futures=True)
            self.completer.shutdown(wait=False, cancel_futures=True)
            self.state.shutdown()

    async def handle(self, msg: ExecutorMsg) -> None:
        match msg:
            case Launch() as launch:
                step: Future[StepResult] = Future()
                self.running.add(step)
                step.add_done_callback(self.running.discard)
                step.add_done_callback(partial(self._post, self.loop, launch.batch_id))
                self.launcher.submit(self._launch, self.completer, launch, step)
            case LoadWeights(source=source, reply=reply):
                loading = self.launcher.submit(self.state.load_weights, source)
                try:
                    await asyncio.wrap_future(loading)
                except OperationRefused as refusal:  # the checkpoint, not the executor
                    refuse(reply, refusal)
                else:
                    answer(reply, None)
            case SetMemory(release=release, tags=tags, reply=reply):
                await asyncio.wrap_future(
                    self.launcher.submit(self.state.set_memory, release, tags)
                )
                answer(reply, None)
            case Shutdown():
                # Let launched steps finish: they write into the KV pool.
                pending = [asyncio.wrap_future(f) for f in self.running]
                await asyncio.gather(*pending, return_exceptions=True)

    def recover(self, msg: ExecutorMsg, error: InternalError) -> None:
        """One message failed (actors/supervise.py): a launch that did not start fails as its
        step would (the scheduler ends the batch's requests); a load reports failure."""
        fail_replies(msg, error)
        if isinstance(msg, Launch):
            self.scheduler.put(StepDone(msg.batch_id, (), error=str(error)))

    def _launch(
        self, completer: ThreadPoolExecutor, launch: Launch, step: Future[StepResult]
    ) -> None:
        """Launch thread: queue the step, then hand its waiting to the completion thread
        (submitted from this one thread, so results are awaited in launch order)."""
        try:
            pending = self.state.launch(launch)
        except BaseException as exc:
            step.set_exception(exc)
            return
        completer.submit(_resolve, pending, step)

    def _post(
        self, loop: asyncio.AbstractEventLoop, batch_id: int, done: Future[StepResult]
    ) -> None:
        """Runs on a worker thread: hand the result to the event loop."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
            loop.call_soon_threadsafe(self._finished, batch_id, done)

    def _finished(self, batch_id: int, done: Future[StepResult]) -> None:
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            log.exception("forward of batch %d failed", batch_id, exc_info=error)
            # The log has the detail; requests are told only that the step failed.
            self.scheduler.put(StepDone(batch_id, (), error="internal error in the executor"))
        else:
            result = done.result()
            self.scheduler.put(
                StepDone(
                    batch_id,
                    result.next_tokens,
                    logprobs=result.logprobs,
                    prompt_logprobs=result.prompt_logprobs,
                    routed_experts=result.routed_experts,
                    row_errors=result.row_errors,
                    drafted=result.drafted,
                )
            )


def _resolve(pending: PendingStep, step: Future[StepResult]) -> None:
    """Completion thread: wait for the step's results to reach the host."""
    try:
        step.set_result(pending.result())
    except BaseException as exc:
        step.set_exception(exc)
