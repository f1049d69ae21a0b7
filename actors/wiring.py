"""Builds the four actors, connects their mailboxes, starts them, and supervises them.

An actor survives the failure of one message (actors/supervise.py). If an actor ends anyway
while the engine is running (a failure that leaves shared state unknown), the engine is dead:
every open request ends with EngineDeadError, the remaining actors are stopped, and the
reason callers see names the actor, not the exception. Nothing hangs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from shoal.actors.cache_manager.cache_manager import CacheManager
from shoal.actors.device_build import Built
from shoal.actors.disagg_wiring import build_transfer
from shoal.actors.executor.executor import Executor
from shoal.actors.executor.stages import StageMonitor
from shoal.actors.executor_messages import ExecutorMsg
from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import CacheMsg, Generate, SchedulerMsg, Shutdown, TokenizerMsg
from shoal.actors.scheduler.pacing import FreeRun
from shoal.actors.scheduler.planner import Planner
from shoal.actors.scheduler.request import PlannerConfig
from shoal.actors.scheduler.scheduler import Scheduler
from shoal.actors.scheduler.speculation import SpecConfig
from shoal.actors.supervise import FaultInjector
from shoal.actors.tokenizer.tokenizer import Tokenizer
from shoal.actors.transfer_messages import TransferMsg
from shoal.cache.kv import KVCache
from shoal.config import EngineOptions
from shoal.disagg.backend import LocalFabric
from shoal.models.load import LoadedModel
from shoal.resolve_options import Resolved
from shoal.results import EngineDeadError

log = logging.getLogger("shoal")


@dataclass
class Actors:
    tokenizer_box: Mailbox[TokenizerMsg]
    scheduler_box: Mailbox[SchedulerMsg]
    cache_box: Mailbox[CacheMsg]
    executor_box: Mailbox[ExecutorMsg]
    tokenizer: Tokenizer
    stages: StageMonitor  # microbatches in each pipeline stage (one stage: the executor)
    transfer_box: Mailbox[TransferMsg] | None = None  # disaggregation's transfer actor
    # the serving weights' identity (loading/identity.py), current after updates
    weights_digest: Callable[[], str] = lambda: ""
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    stopping: bool = False
    dead_reason: str | None = None

    async def stop(self) -> None:
        """Ask every actor to finish, then wait for them."""
        self.stopping = True
        boxes: list[Mailbox[Any]] = [
            self.tokenizer_box, self.scheduler_box, self.cache_box, self.executor_box,
        ]  # fmt: skip
        if self.transfer_box is not None:
            boxes.append(self.transfer_box)
        for box in boxes:
            box.put(Shutdown())
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        self._fail_open("the engine was shut down")

    def _fail_open(self, reason: str) -> None:
        error = EngineDeadError(reason)
        self.tokenizer.fail_all(error)
        for msg in self.tokenizer_box.drain():
            if isinstance(msg, Generate):
                msg.stream.fail(error)

    def _on_exit(
        self, name: str, on_death: Callable[[str], None], task: asyncio.Task[None]
    ) -> None:
        if self.stopping:
            return
        error = None if task.cancelled() else task.exception()
        # What callers and /health are told; the log keeps the exception.
        reason = (
            f"the engine stopped after an internal failure in the {name}"
            if error is not None
            else f"the engine stopped: the {name} ended unexpectedly"
        )
        log.error("%s", reason, exc_info=error)
        self.dead_reason = reason
        self.stopping = True
        for other in self.tasks.values():
            other.cancel()
        self._fail_open(reason)
        on_death(reason)


def spec_config(options: EngineOptions) -> SpecConfig | None:
    """Speculative decoding's settings (actors/scheduler/speculation.py), None when off."""
    if options.speculative_algorithm is None:
        return None
    return SpecConfig(
        options.speculative_num_draft_tokens,
        options.speculative_ngram_min_match_window_size,
        options.speculative_ngram_max_match_window_size,
        options.speculative_max_running,
    )


def max_inflight(options: EngineOptions) -> int:
    """Batches launched ahead of their results: with pipeline stages, one a stage and
    `pipeline_depth` more."""
    if options.pipeline_stages > 1:
        return options.pipeline_stages + options.pipeline_depth
    return options.max_inflight


def start_actors(
    loaded: LoadedModel,
    options: EngineOptions,
    resolved: Resolved,
    built: Built,
    on_death: Callable[[str], None],
    faults: FaultInjector | None = None,
    fabric: LocalFabric | None = None,
    peer_key: str | None = None,
) -> Actors:
    """`peer_key`: the key of disaggregation's bootstrap calls (disagg_wiring.py)."""
    layout = resolved.cache
    config = loaded.config
    tokenizer_box: Mailbox[TokenizerMsg] = Mailbox("tokenizer")
    scheduler_box: Mailbox[SchedulerMsg] = Mailbox("scheduler")
    cache_box: Mailbox[CacheMsg] = Mailbox("cache")
    executor_box: Mailbox[ExecutorMsg] = Mailbox("executor")

    kv = KVCache(
        num_pages=layout.num_pages,
        page_size=layout.page_size,
        num_rows=layout.num_rows,
        max_pages_per_row=layout.max_pages_per_row,
        window=config.kv_window,
    )
    stages, grammars, device_state = built.stages, built.grammars, built.device_state
    planner = Planner(
        PlannerConfig(
            max_running=layout.num_rows,
            chunk_size=options.chunk_size,
            max_batch_tokens=max(options.max_batch_tokens, layout.num_rows),
            max_mixed_prefill_tokens=resolved.mixed_prefill_tokens,
            eos_token_ids=config.eos_token_ids,
            prefix_cache=options.prefix_cache,
            page_size=layout.page_size,
            stages=len(stages),
            disaggregation=options.disaggregation_mode,
            speculative=spec_config(options),
        ),
        kv_window=config.kv_window,
    )
    tokenizer = Tokenizer(
        loaded.tokenizer,
        resolved.context_length,
        config.vocab_size,
        tokenizer_box,
        scheduler_box,
        cache_box,
        executor_box,
        options.seed,
        options.max_sessions,
        faults,
        options.max_sessions_per_client,
        grammars,
        options.grammar_compile_timeout_s,
    )
    actors = Actors(
        tokenizer_box, scheduler_box, cache_box, executor_box, tokenizer, device_state.monitor
    )
    actors.weights_digest = lambda: device_state.weights_digest
    runs = {}
    if options.disaggregation_mode != "null":
        transfer, actors.transfer_box = build_transfer(
            options,
            stages,
            layout.page_size,
            scheduler_box,
            lambda: tokenizer.weight_version,
            actors.weights_digest,
            fabric,
            faults,
            peer_key,
        )
        runs["transfer"] = transfer.run()
    runs |= {
        "tokenizer": tokenizer.run(),
        "scheduler": Scheduler(
            planner,
            max_inflight(options),
            scheduler_box,
            cache_box,
            executor_box,
            tokenizer_box,
            FreeRun(),  # the tests' Pace orders may make it a Stepper (pacing.py)
            faults,
            actors.transfer_box,
        ).run(),
        "cache manager": CacheManager(
            kv, cache_box, scheduler_box, options.strict_integrity, faults
        ).run(),
        "executor": Executor(
            device_state,
            executor_box,
            scheduler_box,
            graph_max_batch=resolved.cuda_graph_max_batch,
            context_length=resolved.context_length,
            faults=faults,
        ).run(),
    }
    for name, coro in runs.items():
        task = asyncio.create_task(coro, name=f"shoal-{name}")
        task.add_done_callback(partial(actors._on_exit, name, on_death))
        actors.tasks[name] = task
    return actors
