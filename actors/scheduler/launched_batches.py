"""The batches the scheduler launched, from forming each to taking its result back (plain
Python, no asyncio, no torch).

A batch is in `by_id` from its `Launch` until its `StepDone` is processed, so its members'
counters go up in `form` and down in `result` or `forget`, and nowhere else::

    Req.inflight   launched batches that read the request's row: it is released only at 0
                   (docs/architecture.md, law 3)
    Req.pending    tokens sampled on the device but not yet received: a request never
                   decodes past max_new_tokens (`wants_decode`)

`form` takes decodes first (one token each, the input left to the device: the row's last
sampled token), then prompt chunks up to `chunk_size` each within the step's prefill budget;
a row's first chunk carries its `RowInit`, and the launch carries every table write the plans
made since the last launch. `result` appends each sampling member's token, decides its finish
(`finish_reason`) and discards a token sampled for a request that finished meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from shoal.actors.executor_messages import Launch, RowInit, RowWriteMsg, SeqChunk
from shoal.actors.messages import Output, StepDone
from shoal.actors.scheduler import planner_transfers as transfers
from shoal.actors.scheduler.request import Phase, PlannerConfig, Req, finish_reason
from shoal.actors.scheduler.request_table import Outbox


class Member(NamedTuple):
    """One sequence of a launched batch."""

    rid: str
    samples: bool
    end: int  # its KV is written up to this position once the batch completes
    start: int  # its first query's position: it reads keys from start - kv_window + 1 on


def wants_decode(req: Req, config: PlannerConfig) -> bool:
    """Whether a running request has another token to decode now."""
    if req.phase is not Phase.RUNNING or (config.disjoint and req.inflight):
        return False
    if req.role == "send":
        return False  # a prefill server's request ends at its first token
    return req.num_outputs + req.pending < req.sampling.max_new_tokens


@dataclass
class LaunchedBatches:
    config: PlannerConfig
    outbox: Outbox
    by_id: dict[int, list[Member]] = field(default_factory=dict)  # launched, result pending
    next_batch_id: int = 0
    pending_writes: list[RowWriteMsg] = field(default_factory=list)  # for the next launch

    def form(self, holding: Iterable[Req], extended: set[str]) -> Launch | None:
        """The batch a plan allows: decodes of the `extended` requests, then prompt chunks
        (None if empty). Those left out keep their extension for the next batch."""
        config = self.config
        seqs: list[SeqChunk] = []
        members: list[Member] = []
        by_order = sorted(holding, key=lambda r: r.order)
        decodes = [r for r in by_order if r.rid in extended and wants_decode(r, config)]
        if config.disjoint:  # a share of the running requests, so every stage has one
            running = sum(r.phase is Phase.RUNNING for r in by_order)
            decodes = decodes[: -(-running // config.stages)]
        for req in decodes:
            assert req.row is not None
            assert req.num_launched == len(req.tokens) + req.pending - 1
            seqs.append(SeqChunk(req.row, req.num_launched, 1, None, True))
            req.num_launched += 1
            members.append(Member(req.rid, True, req.num_launched, req.num_launched - 1))
            req.pending += 1
            req.inflight += 1
        budget = config.prefill_budget(len(seqs))
        for req in by_order:
            if req.phase is not Phase.PREFILL or budget <= 0:
                continue
            if config.disjoint and req.inflight:
                continue  # its previous chunk is still in the stages
            assert req.row is not None
            start = req.num_launched
            n = min(len(req.tokens) - start, config.chunk_size, budget)
            sample = start + n == len(req.tokens)
            init = None
            if req.needs_init:
                prompt, outputs = req.tokens[: req.num_prompt], req.tokens[req.num_prompt :]
                init = RowInit(req.sampling, req.seed, tuple(prompt), tuple(outputs))
                req.needs_init = False
            seqs.append(
                SeqChunk(req.row, start, n, tuple(req.tokens[start : start + n]), sample, init)
            )
            members.append(Member(req.rid, sample, start + n, start))
            budget -= n
            req.num_launched += n
            req.inflight += 1
            if sample:
                req.pending += 1
                req.phase = Phase.RUNNING
        if not seqs:
            return None
        batch_id = self.next_batch_id
        self.next_batch_id += 1
        self.by_id[batch_id] = members
        writes, self.pending_writes = tuple(self.pending_writes), []
        return Launch(batch_id, writes, tuple(seqs))

    def result(self, done: StepDone, reqs: Mapping[str, Req]) -> list[Output]:
        """A batch's tokens came back: one output per sampling member still going; a
        finished one moves to finishing (released in a later plan)."""
        outputs = []
        tokens = iter(done.next_tokens)
        logprobs = iter(done.logprobs or (None,) * len(done.next_tokens))
        for rid, samples, end, _ in self.by_id.pop(done.batch_id):
            req = reqs[rid]
            req.inflight -= 1
            req.num_computed = max(req.num_computed, end)
            if not samples:
                continue
            token, logprob = next(tokens), next(logprobs)
            req.pending -= 1
            if req.phase is Phase.FINISHING:
                continue  # launched before its finish was known: discard
            if req.role == "send":  # held back until its KV has landed
                held = transfers.first_token(req, token, logprob, self.config.page_size)
                self.outbox.to_transfer(held)
                continue
            req.tokens.append(token)
            finish = finish_reason(req, token, self.config.eos_token_ids)
            cached = req.num_cached_tokens if req.num_outputs == 1 else None
            outputs.append(
                Output(
                    rid,
                    (token,),
                    finish,
                    num_cached_tokens=cached,
                    matched_token=token if finish == "stop" else None,
                    logprobs=None if logprob is None else (logprob,),
                )
            )
            if finish is not None:
                req.phase, req.finish = Phase.FINISHING, finish
        return outputs

    def forget(self, batch_id: int, reqs: Mapping[str, Req]) -> None:
        """A batch failed: it reads nothing any more, and its tokens never come."""
        for member in self.by_id.pop(batch_id):
            reqs[member.rid].inflight -= 1
