"""The executor actor: owns the device — weights, KV pool, the device request-slot table,
each row's last sampled token and sampling state.

Launches run strictly in launch order on one worker (a thread on CPU, so the event loop
never blocks). Each launch first applies its table writes, then runs its forward: a row
written for batch N+1 is never seen by batch N (law 3 by execution order).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import (
    ExecutorMsg,
    Launch,
    LoadWeights,
    SchedulerMsg,
    Shutdown,
    StepDone,
)
from shoal.api.stream import TokenLogprob
from shoal.kernels.attention import build_metadata
from shoal.kernels.config import ModelConfig
from shoal.kernels.loader import load_weights, read_model_config, resolve_model_folder
from shoal.kernels.model import KVPool, LlamaModel
from shoal.kernels.sampling import SamplingRow, compute_logprobs, sample
from shoal.params import SamplingParams

log = logging.getLogger("shoal.executor")

StepResult = tuple[tuple[int, ...], tuple[TokenLogprob | None, ...]]


@dataclass
class RowState:
    sampling: SamplingParams
    seed: int
    prompt_ids: tuple[int, ...]
    output_ids: list[int]


class DeviceState:
    """Everything the forward reads or writes; touched only by the worker."""

    def __init__(
        self,
        model: LlamaModel,
        kv: KVPool,
        num_rows: int,
        max_pages_per_row: int,
        page_size: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        device = model.device
        self.model = model
        self.kv = kv
        self.page_size = page_size
        self.eos_token_ids = eos_token_ids
        self.page_table = torch.zeros(num_rows, max_pages_per_row, dtype=torch.int64, device=device)
        self.last_token = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.rows: dict[int, RowState] = {}

    def load_weights(self, model_path: str) -> str | None:
        """Swap in a same-architecture checkpoint; None, or why it was refused (old weights
        stay). Runs on the worker, so it is ordered with every forward."""
        config = self.model.config
        try:
            folder = resolve_model_folder(model_path, progress=False)
            other = read_model_config(folder)
            if _shape_of(other) != _shape_of(config):
                return (
                    f"checkpoint {model_path} has a different architecture: "
                    f"{_shape_of(other)} instead of {_shape_of(config)}"
                )
            weights = load_weights(folder, config, dtype=self.model.dtype)
            self.model.load(weights)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            return f"could not load {model_path}: {exc}"
        return None

    def step(self, launch: Launch) -> StepResult:
        device = self.model.device
        for w in launch.writes:
            pages = torch.tensor(w.pages, dtype=torch.int64, device=device)
            self.page_table[w.row, w.start : w.start + len(w.pages)] = pages
        input_ids: list[int] = []
        positions: list[int] = []
        decode_at: list[int] = []
        decode_rows: list[int] = []
        sample_index: list[int] = []
        sample_rows: list[int] = []
        for seq in launch.seqs:
            if seq.init is not None:
                init = seq.init
                state = RowState(init.sampling, init.seed, init.prompt_ids, list(init.output_ids))
                self.rows[seq.row] = state
            if seq.input_ids is None:
                decode_at.append(len(input_ids))
                decode_rows.append(seq.row)
                input_ids.append(0)
            else:
                input_ids.extend(seq.input_ids)
            positions.extend(range(seq.start, seq.start + seq.num_tokens))
            if seq.sample:
                sample_index.append(len(input_ids) - 1)
                sample_rows.append(seq.row)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
        if decode_at:
            at = torch.tensor(decode_at, dtype=torch.int64, device=device)
            ids[at] = self.last_token[torch.tensor(decode_rows, device=device)]
        rows = torch.tensor([s.row for s in launch.seqs], dtype=torch.int64, device=device)
        meta = build_metadata(
            self.page_table[rows],
            [s.start for s in launch.seqs],
            [s.num_tokens for s in launch.seqs],
            self.page_size,
        )
        pos = torch.tensor(positions, dtype=torch.int64, device=device)
        where = torch.tensor(sample_index, dtype=torch.int64, device=device)
        logits = self.model.forward(ids, pos, meta, self.kv, where)
        states = [self.rows[r] for r in sample_rows]
        sampling_rows = [
            SamplingRow(s.sampling, s.seed, s.prompt_ids, s.output_ids) for s in states
        ]
        next_tokens = sample(logits, sampling_rows, self.eos_token_ids)
        if sample_rows:
            self.last_token[torch.tensor(sample_rows, device=device)] = next_tokens
        host = tuple(int(t) for t in next_tokens.tolist())
        for state, token in zip(states, host, strict=True):
            state.output_ids.append(token)
        return host, self.logprobs(logits, next_tokens, states, host)

    @staticmethod
    def logprobs(
        logits: torch.Tensor,
        next_tokens: torch.Tensor,
        states: list[RowState],
        host: tuple[int, ...],
    ) -> tuple[TokenLogprob | None, ...]:
        """Raw logprobs for the rows that asked for them; () when none did."""
        want = [i for i, state in enumerate(states) if state.sampling.wants_logprobs]
        if not want:
            return ()
        index = torch.tensor(want, device=logits.device)
        top_k = max(states[i].sampling.top_logprobs for i in want)
        chosen, values, ids = compute_logprobs(logits[index], next_tokens[index], top_k)
        out: list[TokenLogprob | None] = [None] * len(states)
        for j, i in enumerate(want):
            k = states[i].sampling.top_logprobs
            top = tuple(zip(ids[j, :k].tolist(), values[j, :k].tolist(), strict=True))
            out[i] = TokenLogprob(host[i], float(chosen[j]), top)
        return tuple(out)


def _shape_of(config: ModelConfig) -> dict[str, int | bool]:
    names = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "tie_word_embeddings",
        "attention_bias",
    )
    return {name: getattr(config, name) for name in names}


class Executor:
    def __init__(
        self,
        device_state: DeviceState,
        mailbox: Mailbox[ExecutorMsg],
        scheduler: Mailbox[SchedulerMsg],
    ) -> None:
        self.state = device_state
        self.mailbox = mailbox
        self.scheduler = scheduler

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        worker = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="shoal-forward",
            initializer=torch.set_flush_denormal,  # denormals slow x86 math ~2x
            initargs=(True,),
        )
        running: set[Future[StepResult]] = set()
        try:
            while True:
                match await self.mailbox.get():
                    case Launch() as launch:
                        done = worker.submit(self.state.step, launch)
                        running.add(done)
                        done.add_done_callback(running.discard)
                        done.add_done_callback(partial(self._post, loop, launch.batch_id))
                    case LoadWeights(model_path=model_path, reply=reply):
                        loading = worker.submit(self.state.load_weights, model_path)
                        error = await asyncio.wrap_future(loading)
                        if not reply.done():
                            reply.set_result(error)
                    case Shutdown():
                        # Let launched forwards finish: they write into the KV pool.
                        pending = [asyncio.wrap_future(f) for f in running]
                        await asyncio.gather(*pending, return_exceptions=True)
                        return
        finally:
            worker.shutdown(wait=False, cancel_futures=True)

    def _post(
        self, loop: asyncio.AbstractEventLoop, batch_id: int, done: Future[StepResult]
    ) -> None:
        """Runs on the worker thread: hand the result to the event loop."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
            loop.call_soon_threadsafe(self._finished, batch_id, done)

    def _finished(self, batch_id: int, done: Future[StepResult]) -> None:
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            log.exception("forward of batch %d failed", batch_id, exc_info=error)
            self.scheduler.put(StepDone(batch_id, (), error=repr(error)))
        else:
            tokens, logprobs = done.result()
            self.scheduler.put(StepDone(batch_id, tokens, logprobs=logprobs))
