"""Every live request of the scheduler, the queue of those waiting, and the moves between
phases that events and the cache manager's plans make (plain Python, no asyncio, no torch).

Where a request can be (docs/architecture.md, "Lifecycle laws", law 1 — `Planner.idle` is true
only when every one of these is empty)::

    waiting ──admit──▶ prefill ──last chunk──▶ running ──eos/length/abort──▶ finishing ──▶ released
       ▲                  │                       │                              ▲
       └──── retracting ◀─┴───── out of pages ────┘                              │
                                   launched batches whose results are pending ───┘

Every arrow is made here but two, which a batch makes (launched_batches.py): prefill → running
when a request's last prompt chunk launches, running → finishing when a result's token ends
it. A disaggregated request also passes `transfer` (planner_transfers.py).

A request holds its row and pages from admission to release (law 3): it leaves the table when
the cache manager's plan says it released them (`cache_released`), or at once when it holds
nothing. One whose admission is in flight (`admitting`) may already hold a row there, so it
waits for the plan's answer (law 5).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.actors.messages import Admit, Admitted, Output, TransferEnded
from shoal.actors.replies import SchedulerSnapshot
from shoal.actors.scheduler import planner_transfers as transfers
from shoal.actors.scheduler.request import Phase, PlannerConfig, Req, pages_for
from shoal.actors.transfer_messages import TransferMsg
from shoal.results import ErrorCode, FinishReason


@dataclass
class Outbox:
    """What the planner has for the scheduler to pass on: the requests gone (`Released`, to
    the tokenizer), errors found while applying a plan (`Outputs`), and the transfer actor's
    messages."""

    released: list[str] = field(default_factory=list)
    errors: list[Output] = field(default_factory=list)
    transfers: list[TransferMsg] = field(default_factory=list)
    # a steady result's outputs as columns (decode_set.py): request ids, their tokens
    steady: list[tuple[tuple[str, ...], tuple[int, ...]]] = field(default_factory=list)

    def to_transfer(self, msg: TransferMsg | None) -> None:
        if msg is not None:
            self.transfers.append(msg)

    def take_released(self) -> list[str]:
        done, self.released = self.released, []
        return done

    def take_errors(self) -> list[Output]:
        done, self.errors = self.errors, []
        return done

    def take_transfers(self) -> list[TransferMsg]:
        done, self.transfers = self.transfers, []
        return done

    def take_steady(self) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
        done, self.steady = self.steady, []
        return done


@dataclass
class RequestTable:
    config: PlannerConfig
    outbox: Outbox
    reqs: dict[str, Req] = field(default_factory=dict)
    waiting: deque[str] = field(default_factory=deque)  # in arrival order, retracted ones too
    admitting: set[str] = field(default_factory=set)  # in the outstanding plan's admits
    next_order: int = 0
    num_retractions: int = 0

    def holding(self) -> list[Req]:
        return [r for r in self.reqs.values() if r.row is not None]

    def snapshot(
        self, launched: dict[int, tuple[str, ...]], plan_pending: bool, paused: bool, idle: bool
    ) -> SchedulerSnapshot:
        """Where every request is, with the planner's launched batches and flags."""

        def phase(p: Phase) -> tuple[str, ...]:
            return tuple(r.rid for r in self.reqs.values() if r.phase is p)

        return SchedulerSnapshot(
            waiting=phase(Phase.WAITING),
            prefill=phase(Phase.PREFILL),
            running=phase(Phase.RUNNING),
            retracting=phase(Phase.RETRACTING),
            finishing=phase(Phase.FINISHING),
            transfer=phase(Phase.TRANSFER),
            launched_batches=launched,
            rows={r.rid: r.row for r in self.reqs.values() if r.row is not None},
            progress={r.rid: r.num_launched for r in self.reqs.values()},
            plan_pending=plan_pending,
            paused=paused,
            num_retractions=self.num_retractions,
            idle=idle,
        )

    def live(self, rid: str) -> Req | None:
        """The request `rid` if it can still be ended: known, not yet finishing."""
        req = self.reqs.get(rid)
        return None if req is None or req.phase is Phase.FINISHING else req

    # ---- events ---------------------------------------------------------------------------

    def add(self, msg: Admit) -> None:
        assert msg.rid not in self.reqs, f"duplicate request id {msg.rid}"
        tokens = list(msg.prompt_ids)
        req = Req(msg.rid, self.next_order, msg.sampling, msg.seed, len(tokens), tokens)
        req.session_id, req.session_prev_len = msg.session_id, msg.session_prev_len
        req.bootstrap, req.role = msg.bootstrap, self.config.role(msg.bootstrap)
        self.outbox.to_transfer(transfers.claim(req))
        self.next_order += 1
        self.reqs[msg.rid] = req
        self.waiting.append(msg.rid)

    def abort(
        self, req: Req, reason: FinishReason, message: str, keep_outputs: int | None
    ) -> list[Output]:
        """End a live request wherever it is. A "stop" (stop string matched) emits nothing."""
        req.finish, req.keep_outputs = (
            ("stop", keep_outputs) if reason == "stop" else ("abort", None)
        )
        out = [] if reason == "stop" else [Output(req.rid, (), "abort", message or "aborted")]
        self._end(req)
        self.outbox.to_transfer(transfers.drop(req, message or "aborted"))
        return out

    def fail(self, req: Req, message: str, code: ErrorCode | None = None) -> list[Output]:
        """End a live request with an error wherever it is; its KV is not cached. `code`: the
        error was the caller's mistake (a disaggregated request its peer refused)."""
        req.drop_kv, req.finish = True, "error"
        self._end(req)
        self.outbox.to_transfer(transfers.drop(req, message))
        return [Output(req.rid, (), "error", message, code)]

    def fail_all(self, message: str) -> list[Output]:
        """Executor failure: end every request with an error; their KV is not trusted."""
        out = []
        for req in list(self.reqs.values()):
            if req.phase is not Phase.FINISHING:
                out.append(Output(req.rid, (), "error", message))
            req.drop_kv, req.finish = True, "error"
            self._end(req)
            self.outbox.to_transfer(transfers.drop(req, message))
        return out

    def park_all(self) -> None:
        """Retract every request that holds KV, dropping it (weights are about to change)."""
        for req in self.holding():
            req.drop_kv = True
            if req.phase in (Phase.RUNNING, Phase.PREFILL):
                req.phase = Phase.RETRACTING

    def transfer_ended(self, req: Req, done: TransferEnded) -> list[Output]:
        """A room's transfer that concerns `req` is over (planner_transfers.py): its pages may
        be released."""
        req.transfer_open = done.held  # held: the pages wait for a last TransferEnded
        if req.phase is Phase.FINISHING:
            return []  # ended meanwhile; now it may be released
        if done.error is not None:
            req.role = None  # the room is over for the request: nothing to tell the actor
            return self.fail(req, f"KV transfer failed: {done.error}", done.code)
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

    # ---- the cache manager's answers ------------------------------------------------------

    def cache_released(self, rid: str) -> None:
        """The cache manager released `rid`'s row and pages: a retracting request waits
        again, any other is gone."""
        req = self.reqs[rid]
        if req.phase is Phase.RETRACTING:
            self._requeue(req)
        else:
            self._forget(rid)

    def retract_youngest(self) -> None:
        """An extension found no pages: the youngest live request gives its KV back."""
        holding = self.holding()
        live = [r for r in holding if r.phase in (Phase.RUNNING, Phase.PREFILL)]
        if len(live) > 1:
            max(live, key=lambda r: r.order).phase = Phase.RETRACTING
            self.num_retractions += 1
        elif len(holding) == 1 and holding[0].phase is Phase.RUNNING:
            # Alone and still out of pages: it can never grow, so end it rather than spin.
            req = holding[0]
            req.phase, req.finish = Phase.FINISHING, "error"
            self.outbox.errors.append(Output(req.rid, (), "error", "out of KV cache pages"))

    def admissions_answered(self, admitted: Sequence[Admitted], failed: Sequence[str]) -> None:
        """The plan's answer to every admission asked. An admitted request holds its row and
        prefills (or waits for its KV, planner_transfers.py); one ended meanwhile stays
        finishing, to be released. A failed one waits on, unless nothing else holds KV: then
        it can never fit, and fails rather than hangs."""
        self.admitting = set()
        for adm in admitted:
            req = self.reqs[adm.rid]
            self.waiting.remove(adm.rid)
            ended = req.phase is Phase.FINISHING  # aborted while its admission was in flight
            req.row, req.num_launched = adm.row, adm.num_cached_tokens
            # KVCache.admit covers max(reserve, cached) positions with whole pages
            covered = max(transfers.reserve_tokens(req), adm.num_cached_tokens)
            req.capacity = pages_for(covered, self.config.page_size) * self.config.page_size
            req.num_computed = req.num_published = adm.num_cached_tokens
            if not ended:
                req.phase, req.needs_init = Phase.PREFILL, True
            if req.num_cached_tokens is None:
                req.num_cached_tokens = adm.num_cached_tokens
            self.outbox.to_transfer(transfers.admitted(req, adm, self.config.page_size))
        for rid in failed:
            if self.reqs[rid].phase is Phase.FINISHING:
                self.waiting.remove(rid)
                self._forget(rid)
        still_waiting = [rid for rid in failed if rid in self.reqs]
        if still_waiting and not self.holding():
            for rid in still_waiting:
                self.waiting.remove(rid)
                self._forget(rid)
                self.outbox.errors.append(
                    Output(rid, (), "error", "request does not fit in KV cache")
                )

    # ---- moves ----------------------------------------------------------------------------

    def _end(self, req: Req) -> None:
        """Move a request to finishing; one that holds nothing is released at once. One whose
        admission is in flight stays in `waiting` until the plan answers (it may be holding a
        row there already)."""
        if req.phase is Phase.WAITING and req.rid not in self.admitting:
            self.waiting.remove(req.rid)
            self._forget(req.rid)
        else:
            req.phase = Phase.FINISHING

    def _forget(self, rid: str) -> None:
        """`rid` holds nothing: it leaves the table, and the tokenizer hears it is released."""
        del self.reqs[rid]
        self.outbox.released.append(rid)

    def _requeue(self, req: Req) -> None:
        req.phase, req.row, req.release_sent = Phase.WAITING, None, False
        req.num_launched, req.drop_kv, req.finish, req.capacity = 0, False, None, 0
        req.num_computed = req.num_published = 0
        position = sum(1 for rid in self.waiting if self.reqs[rid].order < req.order)
        self.waiting.insert(position, req.rid)
