"""The batches the scheduler launched, from forming each to taking its result back (plain
Python, no asyncio, no torch).

A batch is in `by_id` from its `Launch` until its `StepDone` is processed, so its members'
counters go up in `form` and down in `result` or `forget`, and nowhere else (while a
`DecodeSet` is alive, in its columns: `form_steady`, and `result` hands over to it)::

    Req.inflight   launched batches that read the request's row: it is released only at 0
                   (docs/architecture.md, law 3)
    Req.pending    tokens sampled on the device but not yet received: a request never
                   decodes past max_new_tokens (`wants_decode`)

`form` takes decodes first (one token each, the input left to the device: the row's last
sampled token), then prompt chunks up to `chunk_size` each within the step's prefill budget;
a row's first chunk carries its `RowInit`, and the launch carries every table write the plans
made since the last launch. `result` appends each sampling member's token, decides its finish
(`finish_reason`) and discards a token sampled for a request that finished meanwhile; a
sequence's routed experts (StepDone.routed_experts) go out with its token, or alone before it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from shoal.actors.executor_messages import Launch, RowInit, RowWriteMsg, SeqChunk
from shoal.actors.messages import ExpertRows, Output, StepDone
from shoal.actors.scheduler import planner_transfers as transfers
from shoal.actors.scheduler.decode_set import DecodeSet, Ints
from shoal.actors.scheduler.request import Phase, PlannerConfig, Req, finish_reason
from shoal.actors.scheduler.request_table import Outbox
from shoal.actors.scheduler.speculation import Speculation
from shoal.results import TokenLogprob


class Member(NamedTuple):
    """One sequence of a launched batch."""

    rid: str
    samples: bool
    end: int  # its KV is written up to this position once the batch completes
    start: int  # its first query's position: it reads keys from start - kv_window + 1 on
    asks_logprobs: bool = False  # a prompt chunk that asked for prompt logprobs
    num_drafts: int = 0  # a speculating decode: its last token and this many drafts


@dataclass(slots=True)
class LaunchedBatch:
    """A launched batch's sequences, as its Launch has them: the decodes first (one token at
    each start, each sampling), then the prompt chunks."""

    decodes: list[Req]
    decode_starts: list[int]
    chunks: list[Member]
    # While a DecodeSet is alive (decode_set.py): the decodes' slots in it and their starts
    slots: Ints | None = None
    starts: Ints | None = None

    def members(self) -> list[Member]:
        """Every sequence, in batch order."""
        decodes = zip(self.decodes, self.decode_starts, strict=True)
        return [Member(r.rid, True, start + 1, start) for r, start in decodes] + self.chunks


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
    spec: Speculation | None = None  # speculative decoding's counters and backoffs
    by_id: dict[int, LaunchedBatch] = field(default_factory=dict)  # launched, result pending
    next_batch_id: int = 0
    pending_writes: list[RowWriteMsg] = field(default_factory=list)  # for the next launch
    prompt_progress: bool = False  # a result computed prompt positions (take_prompt_progress)

    def form(self, holding: list[Req], proposed: list[Req]) -> Launch | None:
        """The batch a plan allows: decodes of the `proposed` requests that still want one
        and whose row covers it (the plan extended it, or it had room), then prompt chunks
        (None if empty), capped as beside a decode while a row's drafts are in flight.
        `holding` is in arrival order (`Req.order`: the request table's
        insertion order)."""
        config = self.config
        verifying = sum(1 for r in holding if r.verifying)  # drafts launched before this one
        seqs: list[SeqChunk] = []
        members: list[Member] = []
        # Proposed, they wanted a decode; since then results only moved tokens from pending
        # to outputs, so only a finish (or retraction) can have taken that back.
        running = Phase.RUNNING
        decodes = [r for r in proposed if r.phase is running and r.num_launched < r.capacity]
        if config.disjoint:  # a share of the running requests, so every stage has one
            num_running = sum(r.phase is running for r in holding)
            decodes = decodes[: -(-num_running // config.stages)]
        decode_rows: list[int] = []
        decode_starts: list[int] = []
        num_drafted = 0
        plain: list[Req] = []
        for req in decodes:
            draft, req.draft = req.draft, ()
            if not draft or req.num_launched + len(draft) >= req.capacity:
                plain.append(req)  # no drafts, or its row could not take them
                continue
            assert req.row is not None and not req.pending and not req.inflight
            start = req.num_launched
            chunk = (req.tokens[start], *draft)
            seqs.append(SeqChunk(req.row, start, len(chunk), chunk, True, num_drafts=len(draft)))
            members.append(Member(req.rid, True, start + len(chunk), start, False, len(draft)))
            num_drafted += len(draft)
            req.num_launched = start + len(chunk)
            req.pending += 1
            req.inflight += 1
            req.verifying = True
        decodes = plain
        for req in decodes:
            assert req.row is not None
            assert req.num_launched == len(req.tokens) + req.pending - 1
            decode_rows.append(req.row)
            start = req.num_launched
            decode_starts.append(start)
            req.num_launched = start + 1
            req.pending += 1
            req.inflight += 1
        budget = config.prefill_budget(len(decode_rows) + len(members) + verifying) - num_drafted
        for req in holding:
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
            first, targets = req.logprob_targets(start, n)
            chunk = tuple(req.tokens[start : start + n])
            seqs.append(SeqChunk(req.row, start, n, chunk, sample, init, targets, first))
            members.append(Member(req.rid, sample, start + n, start, bool(targets)))
            budget -= n
            req.num_launched += n
            req.inflight += 1
            if sample:
                req.pending += 1
                req.phase = Phase.RUNNING
        if not members and not decodes:
            return None
        batch_id = self.next_batch_id
        self.next_batch_id += 1
        self.by_id[batch_id] = LaunchedBatch(decodes, decode_starts, members)
        writes, self.pending_writes = tuple(self.pending_writes), []
        return Launch(batch_id, writes, tuple(seqs), tuple(decode_rows), tuple(decode_starts))

    def form_steady(self, decode_set: DecodeSet, proposed: Ints) -> Launch | None:
        """`form` for a steady step (decode_set.py): the proposed members' decodes, as
        columns (None if none is left to launch)."""
        slots, starts = decode_set.form(proposed)
        if not slots.size:
            return None
        batch_id = self.next_batch_id
        self.next_batch_id += 1
        members = decode_set.members
        starts_list = starts.tolist()
        decodes = [members[slot] for slot in slots.tolist()]
        self.by_id[batch_id] = LaunchedBatch(decodes, starts_list, [], slots, starts)
        writes, self.pending_writes = tuple(self.pending_writes), []
        rows = tuple(decode_set.rows[slots].tolist())
        return Launch(batch_id, writes, (), rows, tuple(starts_list))

    def result(
        self, done: StepDone, reqs: Mapping[str, Req], decode_set: DecodeSet | None = None
    ) -> list[Output]:
        """A batch's tokens came back: one output per sampling member still going; a
        finished one moves to finishing (released in a later plan). A batch of the alive
        `decode_set` is taken as columns, its steady outputs too (`Outbox.steady`)."""
        batch = self.by_id.pop(done.batch_id)
        if decode_set is not None:
            assert batch.slots is not None and batch.starts is not None
            assert not done.logprobs and not done.routed_experts and not batch.chunks
            assert not done.row_errors  # a row with a grammar is never a member (DecodeSet.of)
            columns = np.array(done.next_tokens, dtype=np.int64)
            ended, steady = decode_set.result(batch.slots, batch.starts, columns, self.config)
            if steady[0]:
                self.outbox.steady.append(steady)
            return ended
        outputs: list[Output] = []
        tokens = done.next_tokens
        logprobs = done.logprobs or (None,) * len(tokens)
        routed = dict(done.routed_experts)  # place in batch order -> rows
        errors = dict(done.row_errors)  # place in batch order -> why its row ends
        decoded = zip(batch.decodes, batch.decode_starts, tokens, logprobs, strict=False)
        for place, (req, start, token, logprob) in enumerate(decoded):
            req.inflight -= 1
            req.pending -= 1
            if start >= req.num_computed:
                req.num_computed = start + 1
            self._sampled(req, token, logprob, outputs, routed.get(place), errors.get(place))
        i = len(batch.decodes)
        prompt_logprobs = iter(done.prompt_logprobs)
        drafted = dict(done.drafted)  # place in sampling order -> tokens before its last
        for place, (rid, samples, end, start, asks_logprobs, num_drafts) in enumerate(
            batch.chunks, i
        ):
            req = reqs[rid]
            req.inflight -= 1
            if num_drafts:
                req.pending -= 1
                self._verified(req, start, num_drafts, (*drafted.get(i, ()), tokens[i]), outputs)
                i += 1
                continue
            experts = routed.get(place)
            if end > req.num_computed:
                req.num_computed = end
                if start < req.num_prompt:
                    self.prompt_progress = True
            if asks_logprobs:  # before the chunk's token: a request's are all before its first
                items = next(prompt_logprobs)
                if req.phase is not Phase.FINISHING:
                    outputs.append(Output(rid, (), prompt_logprobs=items))
            if samples:
                req.pending -= 1
                self._sampled(req, tokens[i], logprobs[i], outputs, experts, errors.get(i))
                i += 1
            elif experts is not None and req.phase is not Phase.FINISHING:
                outputs.append(Output(rid, (), routed_experts=experts))
        return outputs

    def _sampled(
        self,
        req: Req,
        token: int,
        logprob: TokenLogprob | None,
        outputs: list[Output],
        experts: ExpertRows | None = None,
        error: str | None = None,
    ) -> None:
        """A token sampled for `req` came back: its output (with `experts`, the routed
        experts of the positions that computed it), unless it is to be discarded. `error`:
        its row's constraint refused the token (a grammar with nothing left to allow): the
        request ends with it, the token unsent."""
        if req.phase is Phase.FINISHING:
            return  # launched before its finish was known: discard
        if error is not None:
            outputs.append(Output(req.rid, (), "error", error, "invalid_value"))
            req.phase, req.finish = Phase.FINISHING, "error"
            return
        if req.role == "send":  # held back until its KV has landed
            held = transfers.first_token(req, token, logprob, self.config.page_size)
            self.outbox.to_transfer(held)
            return
        if req.sampling.max_new_tokens == 0:  # its prefill alone was asked: no output token
            cached = req.num_cached_tokens
            ended = Output(req.rid, (), "length", num_cached_tokens=cached, routed_experts=experts)
            outputs.append(ended)
            req.phase, req.finish = Phase.FINISHING, "length"
            return
        req.tokens.append(token)
        finish = finish_reason(req, token, self.config.eos_token_ids)
        first = len(req.tokens) - req.num_prompt == 1
        if finish is None and logprob is None and experts is None and not first:
            outputs.append(Output(req.rid, (token,)))  # the steady step's output
            return
        outputs.append(
            Output(
                req.rid,
                (token,),
                finish,
                num_cached_tokens=req.num_cached_tokens if first else None,
                matched_token=token if finish == "stop" else None,
                logprobs=None if logprob is None else (logprob,),
                routed_experts=experts,
            )
        )
        if finish is not None:
            req.phase, req.finish = Phase.FINISHING, finish

    def _verified(
        self, req: Req, start: int, num_drafts: int, tokens: tuple[int, ...], outputs: list[Output]
    ) -> None:
        """A speculating decode's tokens came back: its kept drafts and one more. Each goes
        out as a decode's would, up to a finish; the row's KV counts up to its last kept
        draft (a rejected draft's KV is overwritten by later steps, never kept)."""
        accepted = len(tokens) - 1
        assert self.spec is not None and 0 <= accepted <= num_drafts
        req.verifying = False
        self.spec.verified(req, num_drafts, accepted)
        for token in tokens:
            self._sampled(req, token, None, outputs)
            if req.phase is Phase.FINISHING:
                break
        req.num_launched = req.num_computed = min(start + 1 + accepted, len(req.tokens))

    def take_prompt_progress(self) -> bool:
        """Whether a result computed prompt positions since the last call."""
        progress, self.prompt_progress = self.prompt_progress, False
        return progress

    def forget(self, batch_id: int, reqs: Mapping[str, Req]) -> None:
        """A batch failed: it reads nothing any more, and its tokens never come."""
        batch = self.by_id.pop(batch_id)
        for req in batch.decodes:
            req.inflight -= 1
        for member in batch.chunks:
            req = reqs[member.rid]
            req.inflight -= 1
            req.verifying = False
