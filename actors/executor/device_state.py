"""What the executor keeps on the device, and a step from launch to host results.

`DeviceState.launch` runs on the executor's launch thread, strictly in launch order: it applies
the batch's table writes, then queues the forward and sampling (on CUDA, on the compute
stream; on CPU they run there and then) and starts copying the sampled tokens to the host.
`PendingStep.result` (pending_step.py, with the rows' bookkeeping across the two threads)
runs on the executor's completion thread, in the same order: it waits for the copy and returns
plain ints. With pipeline stages, stage 0 runs here and the rest on the stages' threads
(actors/executor/stages.py).

A steady step (plain rows decoding) costs the launch no per-row Python: its table writes are
one scatter (table_writes.py), its inputs one copy (step_inputs.py), its rows' sampling
parameters a gather of what their RowInit wrote (sampling_slots.py), its draw a few batched
operations (kernels/sampling_columns.py). Only tracked rows (penalties, row constraints, a
pending min_new_tokens mask) are touched one by one, here and in `PendingStep.result`.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shoal.actors.executor.draft_asks import DraftAsks, draft_asks
from shoal.actors.executor.pending_step import PendingStep, RowState, sampling_rows
from shoal.actors.executor.prompt_asks import PromptAsks, prompt_asks
from shoal.actors.executor.routed_asks import RoutedAsks, routed_asks
from shoal.actors.executor.sampling_slots import RowStart, SamplingSlots
from shoal.actors.executor.stages import Microbatch, Stage, StageMonitor, StagePipeline
from shoal.actors.executor.step_inputs import StepInputs, step_inputs
from shoal.actors.executor.step_logits import prompt_logprobs, step_logits
from shoal.actors.executor.streams import HostResult, StepStreams
from shoal.actors.executor.table_writes import write_tables
from shoal.actors.executor.weight_loads import ServingWeights
from shoal.actors.executor_messages import Launch
from shoal.actors.writer_messages import MemoryTag, WeightSource
from shoal.heap import trim_host_heap
from shoal.kernels.batch import AttentionBackend
from shoal.kernels.constraints import RowContext, advance_all, row_constraints
from shoal.kernels.device_copy import to_device
from shoal.kernels.grammars import Grammars
from shoal.kernels.logprob_gather import (
    LogprobColumns,
    listed_ids,
    logprob_columns,
)
from shoal.kernels.sampling import (
    edit_logits,
    has_penalty,
    masks_stop_tokens,
    sample,
)
from shoal.models.decoder import DecoderModel
from shoal.models.kv_pool import KVPool

if TYPE_CHECKING:
    from shoal.actors.executor.cuda_graphs import DecodeGraphs  # imports triton

log = logging.getLogger("shoal.executor")


class DeviceState:
    """Weights, KV pool, the device request-slot table, each row's last sampled token and its
    sampling state. Touched by the executor's launch thread (and row outputs by its
    completion thread, as above)."""

    def __init__(
        self,
        model: DecoderModel,
        kv: KVPool,
        attention: AttentionBackend,
        num_rows: int,
        max_pages_per_row: int,
        page_size: int,
        eos_token_ids: tuple[int, ...],
        later_stages: list[Stage] | None = None,
        streams: StepStreams | None = None,
        weights_digest: str = "",
        folder: Path | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        """`model` and `kv` are the whole model's, or pipeline stage 0's part with the later
        stages' in `later_stages` (actors/executor/stages.py). `weights_digest`: the loaded weights'
        identity (loading/identity.py), kept current by every update (read from the
        event loop by disaggregation's transfer actor: a str, replaced whole); `folder`: the
        checkpoint they were read from (weight_loads.py); `grammars`: what requests' grammars
        compile to (kernels/grammars.py), for their rows' constraints."""
        self.weights_digest = weights_digest
        self.grammars = grammars
        device = model.device
        self.model = model
        self.kv = kv
        self.attention = attention
        self.page_size = page_size
        self.eos_token_ids = eos_token_ids
        self.streams = streams or StepStreams(device)
        self.page_table = torch.zeros(num_rows, max_pages_per_row, dtype=torch.int64, device=device)
        self.last_token = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.counting = torch.arange(num_rows, dtype=torch.int64, device=device)
        self.rows: dict[int, RowState] = {}
        # rows whose request asks for its routed experts (routed_asks.py); empty: none records
        self.routed_rows: set[int] = set()
        # read only without pipeline stages
        self.slots = SamplingSlots(num_rows, model.config.vocab_size, device)
        self.arrived = threading.Condition()
        self.graphs: DecodeGraphs | None = None
        self.graph_args: tuple[int, int] | None = None  # what they were captured for
        later = later_stages or []
        self.later = later
        # The request-slot table on each stage's device (stages on one device share it).
        stage_tables = [self.page_table]
        for stage in later:
            other = stage.model.device
            stage_tables.append(self.page_table if other == device else self.page_table.to(other))
        self.tables = list({id(t): t for t in stage_tables}.values())  # each written once
        self.monitor = StageMonitor(1 + len(later))
        self.pipeline = None
        if later:
            first = Stage(model, kv, attention, self.streams)
            stages = [first, *later]
            self.pipeline = StagePipeline(stages, stage_tables, self.monitor, self._finish)
        self.models = [model, *(s.model for s in later)]
        self.serving = ServingWeights(self.models, self.streams, folder)
        for streams in [s.streams for s in later] + [self.streams]:
            streams.synchronize()  # weights, pool and tables were filled on the default stream

    def shutdown(self) -> None:
        """Stop the pipeline stages' threads (none without stages)."""
        if self.pipeline is not None:
            self.pipeline.shutdown()

    def capture_graphs(self, max_batch: int, context_length: int) -> None:
        """CUDA graphs of the decode forward for batches up to max_batch (CUDA only). If the
        capture fails, decode runs eagerly and the log says why."""
        from shoal.actors.executor.cuda_graphs import DecodeGraphs

        self.graph_args = (max_batch, context_length)
        began = time.perf_counter()
        try:
            with self.streams.computing():
                self.graphs = DecodeGraphs.capture(
                    self.model, self.kv, self.page_table, self.page_size, max_batch, context_length
                )
        except RuntimeError:
            log.exception("capturing CUDA graphs failed; decode runs without them")
            self.graphs = None
            return
        self.streams.synchronize()
        sizes = self.graphs.sizes
        took = time.perf_counter() - began
        log.info(
            "captured %d decode CUDA graphs (batch %d..%d) in %.1fs",
            len(sizes),
            sizes[0],
            sizes[-1],
            took,
        )

    def load_weights(self, source: WeightSource) -> None:
        """Serve new weights (weight_loads.py; OperationRefused: the old ones serve on), then
        the freed host memory (the weights as read, the replaced ones) goes back to the OS
        (heap.py): ten updates hold RSS where one leaves it."""
        try:
            self.weights_digest = self.serving.load(source)
        finally:
            trim_host_heap()  # after the load's frame, with its tensors, is gone

    def set_memory(self, release: bool, tags: tuple[MemoryTag, ...]) -> None:
        """Free the KV pools' or the weights' memory, or allocate and fill them again (the
        weights from where they came: weight_loads.py). Captured CUDA graphs read both, so a
        release drops them and the resume that brings everything back captures them again."""
        pools = [self.kv, *(stage.kv for stage in self.later)]
        if release:
            self.graphs = None
            for pool in pools if "kv_cache" in tags else []:
                pool.release()
            for model in self.models if "weights" in tags else []:
                model.release_weights()
            trim_host_heap()
            self.streams.empty_cache()
            return
        if "kv_cache" in tags:
            for pool in pools:
                pool.resume()
        if "weights" in tags and any(model.released for model in self.models):
            weights = self.serving.whole()
            for model in self.models:
                if model.released:
                    model.load(weights)
        released = any(p.released for p in pools) or any(m.released for m in self.models)
        if self.graph_args is not None and self.graphs is None and not released:
            self.capture_graphs(*self.graph_args)
        self.streams.synchronize()

    def launch(self, launch: Launch) -> PendingStep:
        with self.streams.computing():
            return self._launch(launch)

    def _launch(self, launch: Launch) -> PendingStep:
        write_tables(self.tables, launch.writes)  # before any stage reads this batch
        self._start_rows(launch)
        step = step_inputs(launch, self.last_token, self.counting)
        asks = prompt_asks(launch, self.rows, self.models[-1].device)
        routed = routed_asks(launch, self.rows, self.routed_rows, self.model.device)
        drafts = draft_asks(launch, self.models[-1].device)  # verified where the head runs
        if self.pipeline is not None:
            assert routed is None, "the engine refuses return_routed_experts over stages"
            return self._launch_stages(step, asks, drafts)
        self.monitor.gate(0)  # the tests' hold of stage 0 holds a one-stage engine too
        out = step_logits(
            self.model,
            self.attention,
            self.page_table,
            self.kv,
            self.graphs,
            step,
            asks,
            routed,
            drafts,
        )
        verifying = None if drafts is None else (drafts, out.verified)
        return self._sample(out.logits, step, asks, out.prompt, routed, out.experts, verifying)

    def _sample(
        self,
        logits: torch.Tensor,
        step: StepInputs,
        asks: PromptAsks | None,
        prompt: LogprobColumns | None,
        routed: RoutedAsks | None = None,
        experts: torch.Tensor | None = None,
        verifying: tuple[DraftAsks, torch.Tensor | None] | None = None,
    ) -> PendingStep:
        """Sample the step's rows from their columns (SamplingSlots); only tracked rows cost
        Python, each (their edits, their tokens' way back). `experts`: the `routed` places'
        ids (routed_asks.py), copied to the host after the rest; `verifying`: the step's
        speculating decodes and their drafts' logits (draft_asks.py), whose emitted tokens
        go last."""
        rows_host, rows = step.sample_rows_host, step.sample_rows
        tracked_at = self.slots.tracked_at(rows_host)
        states = [self.rows[int(rows_host[i])] for i in tracked_at]
        views = sampling_rows(states, self.arrived)  # waits for a penalized row's tokens
        edited = edit_logits(logits, views, tracked_at, self.eos_token_ids)
        next_tokens = self.slots.sample(edited, rows, rows_host)
        emitted = None
        if verifying is not None:
            drafts, both = verifying
            assert both is not None and not self.slots.tracked[drafts.rows_host].any()
            emitted = drafts.verify_slots(both, next_tokens, self.slots)
        self.last_token.index_copy_(0, rows, next_tokens)
        to_copy: tuple[torch.Tensor, ...] = (next_tokens,)
        want: list[tuple[int, int, int]] = []
        places = self.slots.logprobs_at(rows_host)
        if places:
            lists = [self.rows[int(rows_host[i])].sampling.token_ids_logprob for i, _ in places]
            want = [(i, k, len(ids)) for (i, k), ids in zip(places, lists, strict=True)]
            to_copy += _output_logprobs(logits, next_tokens, want, lists)
        if prompt is not None:
            to_copy += prompt
        if experts is not None:
            to_copy += (experts,)
        if emitted is not None:
            to_copy += (emitted,)
        host = self.streams.to_host(to_copy)
        drafts_asked = None if verifying is None else verifying[0]
        pending = PendingStep(
            states, host, want, self.arrived, tracked_at, asks, routed, drafts_asked
        )
        # last: a launch that raised above sampled nothing
        self.slots.advance(rows)
        if drafts_asked is not None:  # a speculating row drew 1 + k uniforms
            self.slots.advance(drafts_asked.rows, drafts_asked.lengths)
        for state, i in zip(states, tracked_at, strict=True):
            state.num_sampled += 1
            if not self._tracks(state):  # its min_new_tokens mask is over
                self.slots.untrack(int(rows_host[i]))
        return pending

    def _launch_stages(
        self, step: StepInputs, asks: PromptAsks | None, drafts: DraftAsks | None
    ) -> PendingStep:
        """Stage 0's part here (on the launch thread), the rest on the stages' threads. Every
        row is tracked here (`_tracks`): the last stage samples from the rows' views."""
        monitor = self.monitor
        monitor.enter(0)
        try:
            monitor.gate(0)
            attention = self.attention.prepare(self.page_table, step.shape)
            h = self.model.run_layers(
                self.model.embed(step.ids),
                step.positions,
                attention,
                self.kv,
                rows=step.shape.kernel_rows(),
            )
            self.streams.synchronize()  # h is whole before stage 1 reads it
        finally:
            monitor.leave(0)
        states = [self.rows[r] for r in step.sample_rows_host.tolist()]
        rows = sampling_rows(states, self.arrived)  # before num_sampled moves on: the seed's step
        want = [
            (i, s.sampling.top_logprobs, len(s.sampling.token_ids_logprob))
            for i, s in enumerate(states)
            if s.sampling.wants_logprobs
        ]
        context = (states, rows, step.sample_rows, want, asks, drafts)
        micro = Microbatch(step.shape, step.positions, step.sample_index, context)
        assert self.pipeline is not None
        future = self.pipeline.submit(h, micro)
        pending = PendingStep(states, future, want, self.arrived, prompt=asks, drafts=drafts)
        for state in states:  # last: a launch that raised above sampled nothing
            state.num_sampled += 1
        if drafts is not None:  # a speculating row drew 1 + k uniforms (draft_asks.py)
            for place, k in zip(drafts.sample_at_host, drafts.lengths_host, strict=True):
                states[place].num_sampled += k
        return pending

    def _finish(self, stage: Stage, h: torch.Tensor, micro: Microbatch) -> HostResult:
        """The last stage's end: norm, head, sampling, the row's last token (on stage 0's
        device, where the next decode reads it) and the copy to the host."""
        states, rows, rows_t, want, asks, drafts = micro.context
        device = stage.model.device
        sample_index = micro.sample_index.to(device)
        if drafts is None:
            logits = stage.model.head(h, sample_index)
        else:
            both = stage.model.head(h, torch.cat((drafts.places, sample_index)), len(sample_index))
            logits = both[len(drafts.places) :]
        next_tokens = sample(logits, rows, self.eos_token_ids)
        emitted = None
        if drafts is not None:
            emitted = drafts.verify_views(both, next_tokens, rows)
        if states:
            self.last_token[rows_t] = next_tokens.to(self.last_token.device)
        to_copy: tuple[torch.Tensor, ...] = (next_tokens,)
        if want:
            lists = [states[i].sampling.token_ids_logprob for i, _, _ in want]
            to_copy += _output_logprobs(logits, next_tokens, want, lists)
        if asks is not None:
            to_copy += prompt_logprobs(stage.model, h, asks)
        if emitted is not None:
            to_copy += (emitted,)
        return stage.streams.to_host(to_copy)

    def _start_rows(self, launch: Launch) -> None:
        """A sequence's first chunk (re)initializes its row (a retracted row with its tokens
        so far)."""
        starts: list[RowStart] = []
        for seq in launch.seqs:
            init = seq.init
            if init is None:
                continue
            outputs = list(init.output_ids)
            context = RowContext(self.models[-1].device, self.grammars)
            constraints = row_constraints(init.sampling, context)
            advance_all(constraints, outputs)  # a retracted row's tokens so far (allowed then)
            state = RowState(
                init.sampling, init.seed, init.prompt_ids, outputs, len(outputs), constraints
            )
            self.rows[seq.row] = state
            if init.sampling.return_routed_experts:
                self.routed_rows.add(seq.row)
            else:
                self.routed_rows.discard(seq.row)
            starts.append(
                RowStart(seq.row, init.sampling, init.seed, len(outputs), self._tracks(state))
            )
        self.slots.start(starts)

    def _tracks(self, state: RowState) -> bool:
        """Whether the host keeps the row's count and tokens (pending_step.py's doc)."""
        return (
            self.pipeline is not None
            or bool(state.constraints)
            or has_penalty(state.sampling)
            or masks_stop_tokens(state.sampling, state.num_sampled, self.eos_token_ids)
        )


def _output_logprobs(
    logits: torch.Tensor,
    next_tokens: torch.Tensor,
    want: list[tuple[int, int, int]],
    lists: list[tuple[int, ...]],
) -> LogprobColumns:
    """The sampled tokens' logprobs of the rows that asked (`want`: place, top k, number
    listed; `lists`: their token_ids_logprob)."""
    device = logits.device
    index = to_device([i for i, _, _ in want], torch.int64, device)
    top_k = max(k for _, k, _ in want)
    return logprob_columns(logits[index], next_tokens[index], top_k, listed_ids(lists, device))
