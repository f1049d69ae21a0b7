"""The scheduler's state and planning, as plain Python over plain data (no asyncio, no torch).

Where a request can be (docs/architecture.md, "Lifecycle laws", law 1 — `idle` is true only
when every one of these is empty)::

    waiting ──admit──▶ prefill ──last chunk──▶ running ──eos/length/abort──▶ finishing ──▶ released
       ▲                  │                       │                              ▲
       └──── retracting ◀─┴───── out of pages ────┘                              │
                                   launched batches whose results are pending ───┘

A request holds its row and pages from admission to release (docs/architecture.md, law 3).
It is released only when no launched batch still reads it (`inflight == 0`); a token sampled
for a request that already finished is discarded. With a sliding window of W keys over every
layer (`kv_window`), a running request's own pages below the lowest key any of its launched
or next chunks reads are given back while it runs (window_trims.py). `tokens` holds the prompt
and
every output received; `pending` counts tokens sampled on the device but not yet received.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from shoal.actors.messages import (
    Admit,
    AdmitReq,
    ExtendReq,
    Launch,
    Output,
    Plan,
    PlanRequest,
    ReleaseReq,
    RowInit,
    RowWriteMsg,
    SeqChunk,
    StepDone,
    TransferEnded,
    TrimReq,
)
from shoal.actors.replies import SchedulerSnapshot
from shoal.actors.scheduler import planner_transfers as transfers
from shoal.actors.scheduler.prefix_sharing import prefixes_in_progress, publishes_due
from shoal.actors.scheduler.request import Phase, PlannerConfig, Req, finish_reason
from shoal.actors.scheduler.window_trims import window_trims
from shoal.actors.transfer_messages import TransferMsg
from shoal.results import ErrorCode, FinishReason


class Member(NamedTuple):
    """One sequence of a launched batch."""

    rid: str
    samples: bool
    end: int  # its KV is written up to this position once the batch completes
    start: int  # its first query's position: it reads keys from start - kv_window + 1 on


@dataclass
class Planner:
    config: PlannerConfig
    reqs: dict[str, Req] = field(default_factory=dict)
    waiting: deque[str] = field(default_factory=deque)
    batches: dict[int, list[Member]] = field(default_factory=dict)
    plan_pending: bool = False
    pressure: bool = False
    next_order: int = 0
    next_batch_id: int = 0
    released: list[str] = field(default_factory=list)
    errors: list[Output] = field(default_factory=list)
    pending_writes: list[RowWriteMsg] = field(default_factory=list)
    num_retractions: int = 0
    stalled: bool = False  # the last plan changed nothing: wait for a result or a request
    paused: bool = False  # schedule nothing new; only releases go on
    admitting: set[str] = field(default_factory=set)  # in the outstanding plan's admits
    kv_window: int | None = None  # W when every layer attends to the last W keys only
    trimmed_to: dict[str, int] = field(default_factory=dict)  # trims asked, per holding rid
    transfer_out: list[TransferMsg] = field(default_factory=list)  # for the transfer actor

    # ---- questions ------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Law 1 (docs/architecture.md): no request anywhere, no batch in flight, no plan
        outstanding."""
        return not self.reqs and not self.batches and not self.plan_pending

    @property
    def parked(self) -> bool:
        """No request holds a row or pages and nothing is in flight (requests may wait)."""
        return not self.holding() and not self.batches and not self.plan_pending

    def holding(self) -> list[Req]:
        return [r for r in self.reqs.values() if r.row is not None]

    def snapshot(self) -> SchedulerSnapshot:
        def phase(p: Phase) -> tuple[str, ...]:
            return tuple(r.rid for r in self.reqs.values() if r.phase is p)

        return SchedulerSnapshot(
            waiting=phase(Phase.WAITING),
            prefill=phase(Phase.PREFILL),
            running=phase(Phase.RUNNING),
            retracting=phase(Phase.RETRACTING),
            finishing=phase(Phase.FINISHING),
            transfer=phase(Phase.TRANSFER),
            launched_batches={b: tuple(m.rid for m in ms) for b, ms in self.batches.items()},
            rows={r.rid: r.row for r in self.reqs.values() if r.row is not None},
            progress={r.rid: r.num_launched for r in self.reqs.values()},
            plan_pending=self.plan_pending,
            paused=self.paused,
            num_retractions=self.num_retractions,
            idle=self.idle,
        )

    # ---- events ---------------------------------------------------------------------------

    def add(self, msg: Admit) -> None:
        assert msg.rid not in self.reqs, f"duplicate request id {msg.rid}"
        tokens = list(msg.prompt_ids)
        req = Req(msg.rid, self.next_order, msg.sampling, msg.seed, len(tokens), tokens)
        req.session_id, req.session_prev_len = msg.session_id, msg.session_prev_len
        req.bootstrap, req.role = msg.bootstrap, self.config.role(msg.bootstrap)
        self._to_transfer(transfers.claim(req))
        self.next_order += 1
        self.reqs[msg.rid] = req
        self.waiting.append(msg.rid)
        self.stalled = False

    def abort(
        self, rid: str, reason: FinishReason, message: str, keep_outputs: int | None = None
    ) -> list[Output]:
        """End a request wherever it is. A "stop" (stop string matched) emits nothing."""
        req = self.reqs.get(rid)
        if req is None or req.phase is Phase.FINISHING:
            return []
        req.finish, req.keep_outputs = (
            ("stop", keep_outputs) if reason == "stop" else ("abort", None)
        )
        out = [] if reason == "stop" else [Output(rid, (), "abort", message or "aborted")]
        self.stalled = False
        self._end(req)
        self._to_transfer(transfers.drop(req, message or "aborted"))
        return out

    def _end(self, req: Req) -> None:
        """Move a request to finishing; one that holds nothing is released at once. One whose
        admission is in flight stays in `waiting` until the plan answers (docs/architecture.md,
        law 5: it may be holding a row there already)."""
        if req.phase is Phase.WAITING and req.rid not in self.admitting:
            self.waiting.remove(req.rid)
            del self.reqs[req.rid]
            self.released.append(req.rid)
        else:
            req.phase = Phase.FINISHING

    def fail(self, rid: str, message: str, code: ErrorCode | None = None) -> list[Output]:
        """End one request with an error wherever it is; its KV is not cached. `code`: the
        error was the caller's mistake (a disaggregated request its peer refused)."""
        req = self.reqs.get(rid)
        if req is None or req.phase is Phase.FINISHING:
            return []
        req.drop_kv, req.finish = True, "error"
        self.stalled = False
        self._end(req)
        self._to_transfer(transfers.drop(req, message))
        return [Output(rid, (), "error", message, code)]

    def fail_all(self, message: str) -> list[Output]:
        """Executor failure: end every request with an error; their KV is not trusted."""
        out = []
        for req in list(self.reqs.values()):
            if req.phase is not Phase.FINISHING:
                out.append(Output(req.rid, (), "error", message))
            req.drop_kv, req.finish = True, "error"
            self._end(req)
            self._to_transfer(transfers.drop(req, message))
        return out

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self.stalled = False

    def park_all(self) -> None:
        """Retract every request that holds KV, dropping it (weights are about to change)."""
        for req in self.holding():
            req.drop_kv = True
            if req.phase in (Phase.RUNNING, Phase.PREFILL):
                req.phase = Phase.RETRACTING
        self.stalled = False

    def _to_transfer(self, msg: TransferMsg | None) -> None:
        if msg is not None:
            self.transfer_out.append(msg)

    def take_transfers(self) -> list[TransferMsg]:
        out, self.transfer_out = self.transfer_out, []
        return out

    def transfer_ended(self, done: TransferEnded) -> list[Output]:
        """A room's transfer is over (planner_transfers.py): its pages may be released."""
        req = self.reqs.get(done.rid)
        if req is None or not transfers.concerns(req, done):
            return []
        req.transfer_open = done.held  # held: the pages wait for a last TransferEnded
        self.stalled = False
        if req.phase is Phase.FINISHING:
            return []  # ended meanwhile; now it may be released
        if done.error is not None:
            req.role = None  # the room is over for the request: nothing to tell the actor
            return self.fail(req.rid, f"KV transfer failed: {done.error}", done.code)
        token, logprob, ends = transfers.succeeded(req, done, self.config.eos_token_ids)
        finish = req.finish if ends else None
        return [
            Output(
                req.rid,
                (token,),
                finish,
                num_cached_tokens=req.num_cached_tokens,
                matched_token=token if finish == "stop" else None,
                logprobs=None if logprob is None else (logprob,),
            )
        ]

    def take_released(self) -> list[str]:
        done, self.released = self.released, []
        return done

    # ---- planning -------------------------------------------------------------------------

    def propose(self, step: int) -> PlanRequest | None:
        releases = []
        for req in self.holding():
            done = req.phase in (Phase.FINISHING, Phase.RETRACTING)
            if done and req.inflight == 0 and not req.release_sent and not req.transfer_open:
                req.release_sent = True
                computed, session = req.kept_tokens(self.config.prefix_cache)
                releases.append(ReleaseReq(req.rid, computed, session))
        # A stall waits for a result or a request, but never holds back a release: a request
        # failed while its plan was out (a failed step) has nothing left to wait for.
        if self.stalled and not releases:
            return None
        if self.paused:
            if not releases:
                return None
            self.plan_pending = True
            return PlanRequest(step, tuple(releases), (), ())
        extends = [
            ExtendReq(r.rid, r.num_launched + 1) for r in self.holding() if self._wants_decode(r)
        ]
        publishes = publishes_due(self.holding(), self.config)
        trims = self._trims()
        budget = self.config.prefill_budget(len(extends))
        has_prefill = any(r.phase is Phase.PREFILL for r in self.reqs.values())
        admits: list[AdmitReq] = []
        if not self.pressure:
            computing = prefixes_in_progress(self.holding(), self.config)
            num_holding = len(self.holding()) - len(releases)
            for rid in self.waiting:
                if num_holding + len(admits) >= self.config.max_running:
                    break
                req = self.reqs[rid]
                if budget <= 0 and (admits or has_prefill or extends):
                    break
                if computing is not None and req.session_id is None and req.role != "receive":
                    if computing.should_wait(req.tokens):
                        continue  # admitted once the shared prefix is in the tree
                    computing.add(req.tokens, 0)
                reserve = transfers.reserve_tokens(req)
                exports = req.role is not None
                admits.append(AdmitReq(rid, tuple(req.tokens), reserve, req.session_id, exports))
                budget -= min(len(req.tokens), self.config.chunk_size)
        if not (releases or extends or admits or has_prefill or publishes):
            return None  # nothing launches: the trims are asked for again next time
        self.plan_pending = True
        self.admitting = {a.rid for a in admits}
        for trim in trims:
            self.trimmed_to[trim.rid] = trim.keep_from_token
        return PlanRequest(step, tuple(releases), tuple(extends), tuple(admits), publishes, trims)

    def _trims(self) -> tuple[TrimReq, ...]:
        if self.kv_window is None:
            return ()
        local = [r for r in self.holding() if r.role is None]  # a transfer reads every page
        return window_trims(
            local, self.batches, self.kv_window, self.config.page_size, self.trimmed_to
        )

    def _wants_decode(self, req: Req) -> bool:
        if req.phase is not Phase.RUNNING or (self.config.disjoint and req.inflight):
            return False
        if req.role == "send":
            return False  # a prefill server's request ends at its first token
        return req.num_outputs + req.pending < req.sampling.max_new_tokens

    def apply_plan(self, plan: Plan) -> Launch | None:
        """Take the cache manager's answer; form the batch it allows (None if empty)."""
        self.plan_pending = False
        retractions = self.num_retractions
        self.pending_writes.extend(plan.writes)
        for rid in plan.released:
            self.trimmed_to.pop(rid, None)  # a retracted request trims its next row anew
            req = self.reqs[rid]
            if req.phase is Phase.RETRACTING:
                self._requeue(req)
            else:
                del self.reqs[rid]
                self.released.append(rid)
        self.pressure = bool(plan.extend_failed)
        if plan.extend_failed:
            self._retract_youngest()
        self.admitting = set()
        for adm in plan.admitted:
            req = self.reqs[adm.rid]
            self.waiting.remove(adm.rid)
            ended = req.phase is Phase.FINISHING  # aborted while its admission was in flight
            req.row, req.num_launched = adm.row, adm.num_cached_tokens
            req.num_computed = req.num_published = adm.num_cached_tokens
            if not ended:
                req.phase, req.needs_init = Phase.PREFILL, True
            if req.num_cached_tokens is None:
                req.num_cached_tokens = adm.num_cached_tokens
            self._to_transfer(transfers.admitted(req, adm, self.config.page_size))
        for rid in plan.admit_failed:
            if self.reqs[rid].phase is Phase.FINISHING:
                self.waiting.remove(rid)
                del self.reqs[rid]
                self.released.append(rid)
        plan_failed = [rid for rid in plan.admit_failed if rid in self.reqs]
        if plan_failed and not self.holding():
            # Nothing else holds KV, so this request can never fit: fail it, don't hang.
            for rid in plan_failed:
                self.waiting.remove(rid)
                del self.reqs[rid]
                self.released.append(rid)
                self.errors.append(Output(rid, (), "error", "request does not fit in KV cache"))
        launch = None if self.paused else self._build_batch(set(plan.extended))
        changed = plan.released or plan.admitted or self.errors
        self.stalled = launch is None and not changed and retractions == self.num_retractions
        return launch

    def take_errors(self) -> list[Output]:
        done, self.errors = self.errors, []
        return done

    def _build_batch(self, extended: set[str]) -> Launch | None:
        seqs: list[SeqChunk] = []
        members: list[Member] = []
        by_order = sorted(self.holding(), key=lambda r: r.order)
        decodes = [r for r in by_order if r.rid in extended and self._wants_decode(r)]
        if self.config.disjoint:  # a share of the running requests, so every stage has one
            running = sum(r.phase is Phase.RUNNING for r in by_order)
            decodes = decodes[: -(-running // self.config.stages)]
        for req in decodes:  # those left out keep their extension for the next batch
            assert req.row is not None
            assert req.num_launched == len(req.tokens) + req.pending - 1
            seqs.append(SeqChunk(req.row, req.num_launched, 1, None, True))
            req.num_launched += 1
            members.append(Member(req.rid, True, req.num_launched, req.num_launched - 1))
            req.pending += 1
            req.inflight += 1
        budget = self.config.prefill_budget(len(seqs))
        for req in by_order:
            if req.phase is not Phase.PREFILL or budget <= 0:
                continue
            if self.config.disjoint and req.inflight:
                continue  # its previous chunk is still in the stages
            assert req.row is not None
            start = req.num_launched
            n = min(len(req.tokens) - start, self.config.chunk_size, budget)
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
        self.batches[batch_id] = members
        writes, self.pending_writes = tuple(self.pending_writes), []
        return Launch(batch_id, writes, tuple(seqs))

    def _retract_youngest(self) -> None:
        holding = self.holding()
        live = [r for r in holding if r.phase in (Phase.RUNNING, Phase.PREFILL)]
        if len(live) > 1:
            max(live, key=lambda r: r.order).phase = Phase.RETRACTING
            self.num_retractions += 1
        elif len(holding) == 1 and holding[0].phase is Phase.RUNNING:
            # Alone and still out of pages: it can never grow, so end it rather than spin.
            req = holding[0]
            req.phase, req.finish = Phase.FINISHING, "error"
            self.errors.append(Output(req.rid, (), "error", "out of KV cache pages"))

    def _requeue(self, req: Req) -> None:
        req.phase, req.row, req.release_sent = Phase.WAITING, None, False
        req.num_launched, req.drop_kv, req.finish = 0, False, None
        req.num_computed = req.num_published = 0
        position = sum(1 for rid in self.waiting if self.reqs[rid].order < req.order)
        self.waiting.insert(position, req.rid)

    # ---- results --------------------------------------------------------------------------

    def process(self, done: StepDone) -> list[Output]:
        members = self.batches.pop(done.batch_id)
        self.stalled = False
        if done.error is not None:
            for member in members:
                self.reqs[member.rid].inflight -= 1
            return self.fail_all(f"forward failed: {done.error}")
        outputs = []
        tokens = iter(done.next_tokens)
        logprobs = iter(done.logprobs or (None,) * len(done.next_tokens))
        for rid, samples, end, _ in members:
            req = self.reqs[rid]
            req.inflight -= 1
            req.num_computed = max(req.num_computed, end)
            if not samples:
                continue
            token, logprob = next(tokens), next(logprobs)
            req.pending -= 1
            if req.phase is Phase.FINISHING:
                continue  # launched before its finish was known: discard
            if req.role == "send":  # held back until its KV has landed
                self._to_transfer(transfers.first_token(req, token, logprob, self.config.page_size))
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
