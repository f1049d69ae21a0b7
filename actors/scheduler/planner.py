"""The scheduler's planning, as plain Python over plain data (no asyncio, no torch).

`Planner` composes three parts and owns the loop between them; the scheduler calls only it::

    RequestTable     request_table.py     every live request, the waiting queue, the phases
    LaunchedBatches  launched_batches.py  the batches on the device, from forming to result
    Outbox           request_table.py     released ids, errors, transfer messages to pass on

One step is one round trip, with one `PlanRequest` out at a time (`plan_pending`)::

    propose(step) ──PlanRequest──▶ cache manager ──Plan──▶ apply_plan ──Launch──▶ executor
                                                                            │
    outputs ◀── process ◀──StepDone─────────────────────────────────────────┘

`propose` asks for releases (finished or retracting requests no launched batch reads),
publishes of computed prompt pages (prefix_sharing.py), sliding-window trims
(window_trims.py), one-token extensions for the running requests and admissions in queue
order within `max_running` and the step's prefill budget. `apply_plan` hands the answer to the
request table and forms the batch it allows. While only decoding goes on, the three do it as
column operations over a `DecodeSet` (decode_set.py), which any other event dissolves first.
A plan that changed nothing leaves the planner `stalled` until a result or a request arrives
(not when one arrived while it was out: that one's change was not in the plan);
`paused` proposes releases only; `pressure` (the last plan failed an extension) admits
nothing new.
"""

from __future__ import annotations

import msgspec

from shoal.actors.executor_messages import Launch
from shoal.actors.messages import (
    Admit,
    AdmitReq,
    ExtendReq,
    Output,
    Plan,
    PlanRequest,
    PublishReq,
    ReleaseReq,
    StepDone,
    TransferEnded,
    TrimReq,
)
from shoal.actors.replies import SchedulerSnapshot
from shoal.actors.scheduler import planner_transfers as transfers
from shoal.actors.scheduler.admissions import admissions
from shoal.actors.scheduler.decode_set import DecodeSet
from shoal.actors.scheduler.launched_batches import LaunchedBatch, LaunchedBatches, wants_decode
from shoal.actors.scheduler.prefix_sharing import publishes_due
from shoal.actors.scheduler.request import Phase, PlannerConfig, Req, released_now
from shoal.actors.scheduler.request_table import Outbox, RequestTable
from shoal.actors.scheduler.speculation import Speculation
from shoal.actors.scheduler.steady_steps import SteadySteps
from shoal.actors.scheduler.window_trims import window_trims
from shoal.actors.transfer_messages import TransferMsg
from shoal.results import ErrorCode, FinishReason


class Planner:
    def __init__(self, config: PlannerConfig, kv_window: int | None = None) -> None:
        self.config = config
        self.kv_window = kv_window  # W when every layer attends to the last W keys only
        self.outbox = Outbox()
        self.requests = RequestTable(config, self.outbox)
        spec = config.speculative
        self.spec = None if spec is None else Speculation(spec)
        self.launched = LaunchedBatches(config, self.outbox, self.spec)
        self.plan_pending = False
        self.pressure = False
        self.stalled = False  # the last plan changed nothing: wait for a result or a request
        # Events that change a request (`_changed`), counted: a plan applied after one landed
        # while it was out does not stall, since the event may have made work it did not see.
        self.events = 0
        self.events_proposed = 0
        self.paused = False  # schedule nothing new; only releases go on
        self.trimmed_to: dict[str, int] = {}  # trims asked, per holding rid
        self.proposed_decodes: list[Req] = []  # the outstanding plan's decodes, in order
        self.steady = SteadySteps()  # while only decoding goes on (steady_steps.py)
        # A request's computed prompt may have grown (a result, an admission, a transfer)
        # since publishes_due last ran (prefix_sharing.py).
        self.publishes_may_be_due = False

    # ---- questions ------------------------------------------------------------------------

    @property
    def reqs(self) -> dict[str, Req]:
        """Every live request, its counters up to date (a decode set gives them back)."""
        self._dissolve()
        return self.requests.reqs

    @property
    def batches(self) -> dict[int, LaunchedBatch]:
        """Launched batches whose results are not yet processed, by batch id."""
        return self.launched.by_id

    @property
    def num_retractions(self) -> int:
        return self.requests.num_retractions

    @property
    def idle(self) -> bool:
        """Law 1 (docs/architecture.md): no request anywhere, no batch in flight, no plan
        outstanding."""
        return not self.requests.reqs and not self.batches and not self.plan_pending

    @property
    def parked(self) -> bool:
        """No request holds a row or pages and nothing is in flight (requests may wait)."""
        return not self.requests.holding() and not self.batches and not self.plan_pending

    def holding(self) -> list[Req]:
        self._dissolve()
        return self.requests.holding()

    def snapshot(self) -> SchedulerSnapshot:
        self._dissolve()
        launched = {b: tuple(m.rid for m in batch.members()) for b, batch in self.batches.items()}
        snapshot = self.requests.snapshot(launched, self.plan_pending, self.paused, self.idle)
        if self.spec is None:
            return snapshot
        counters = self.spec.counters
        return msgspec.structs.replace(
            snapshot,
            spec_steps=counters.steps,
            spec_drafted=counters.drafted,
            spec_accepted=counters.accepted,
        )

    # ---- events: each that changes a request ends a stall ---------------------------------

    def add(self, msg: Admit) -> None:
        self.requests.add(msg)
        self._changed()

    def abort(
        self, rid: str, reason: FinishReason, message: str, keep_outputs: int | None = None
    ) -> list[Output]:
        """End a request wherever it is. A "stop" (stop string matched) emits nothing."""
        self._dissolve()
        req = self.requests.live(rid)
        if req is None:
            return []
        self._changed()
        return self.requests.abort(req, reason, message, keep_outputs)

    def fail(self, rid: str, message: str, code: ErrorCode | None = None) -> list[Output]:
        """End one request with an error wherever it is; its KV is not cached."""
        self._dissolve()
        req = self.requests.live(rid)
        if req is None:
            return []
        self._changed()
        return self.requests.fail(req, message, code)

    def fail_all(self, message: str) -> list[Output]:
        """Executor failure: end every request with an error; their KV is not trusted."""
        self._dissolve()
        return self.requests.fail_all(message)

    def set_paused(self, paused: bool) -> None:
        self._dissolve()
        self.paused = paused
        self._changed()

    def park_all(self) -> None:
        """Retract every request that holds KV, dropping it (weights are about to change)."""
        self._dissolve()
        self.requests.park_all()
        self._changed()

    def transfer_ended(self, done: TransferEnded) -> list[Output]:
        """A room's transfer is over (planner_transfers.py): its pages may be released."""
        self._dissolve()
        req = self.requests.reqs.get(done.rid)
        if req is None or not transfers.concerns(req, done):
            return []
        self._changed()
        self.publishes_may_be_due = True
        return self.requests.transfer_ended(req, done)

    def _changed(self) -> None:
        """A request changed (a result, a request, an abort ..): the stall ends, and a plan
        out now is applied knowing it was proposed before."""
        self.stalled = False
        self.events += 1

    def take_released(self) -> list[str]:
        return self.outbox.take_released()

    def take_errors(self) -> list[Output]:
        return self.outbox.take_errors()

    def take_transfers(self) -> list[TransferMsg]:
        return self.outbox.take_transfers()

    def take_steady(self) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
        """Steady outputs as columns (`Outputs.steady_rids`, `steady_tokens`), in order."""
        return self.outbox.take_steady()

    # ---- the loop -------------------------------------------------------------------------

    def propose(self, step: int) -> PlanRequest | None:
        self.events_proposed = self.events
        if self._steady_set() is not None:
            request = self.steady.ask(step, self.config.prefix_cache, self.stalled)
            self.plan_pending = request is not None
            return request
        holding = self.requests.holding()
        config = self.config
        releases = []
        decodes: list[Req] = []  # running requests with a token to decode
        has_prefill = False
        spec = self.spec if self._speculates() else None
        # While a row's drafts are in flight no other row decodes: a decode launched beside
        # them would split the rows into groups that take turns, each paying a whole step
        # for part of the rows; at its result every row goes in one launch (speculation.py)
        # A row whose drafts are in flight is a stream still, though it launches nothing now:
        # a prompt chunk beside it is capped as beside a decode (`prefill_budget`)
        verifying = sum(1 for req in holding if req.verifying)
        hold = spec is not None and verifying > 0
        decoding = len(self.requests.reqs)
        for req in holding:
            phase = req.phase
            if phase is Phase.RUNNING:
                if wants_decode(req, config) and not req.verifying and not hold:
                    draft = () if spec is None else spec.draft(req, decoding)
                    if draft is None:
                        continue  # it drafts once its tokens on their way are back
                    req.draft = draft
                    decodes.append(req)
            elif phase is Phase.PREFILL:
                has_prefill = True
            elif (phase is Phase.FINISHING or phase is Phase.RETRACTING) and released_now(req):
                computed, session = req.kept_tokens(config.prefix_cache)
                releases.append(ReleaseReq(req.rid, computed, session))
        # A stall waits for a result or a request, but never holds back a release: a request
        # failed while its plan was out (a failed step) has nothing left to wait for.
        if self.stalled and not releases:
            return None
        if self.paused:
            if not releases:
                return None
            self.plan_pending = True
            self.proposed_decodes = []
            return PlanRequest(step, tuple(releases), (), ())
        # A steady decode asks nothing of the cache manager: only a request about to cross
        # its row's last page is extended.
        extends = [
            ExtendReq(r.rid, r.num_launched + 1 + len(r.draft))
            for r in decodes
            if r.num_launched + len(r.draft) >= r.capacity
        ]
        publishes: tuple[PublishReq, ...] = ()
        if self.publishes_may_be_due:  # only a prompt's progress makes one due
            self.publishes_may_be_due = False
            publishes = publishes_due(holding, config)
        trims = self._trims()
        budget = config.prefill_budget(len(decodes) + verifying)
        admits: list[AdmitReq] = []
        if not self.pressure:  # prefix sharing's bookkeeping runs only when something waits
            busy = has_prefill or bool(decodes)
            admits = admissions(self.requests, holding, len(releases), budget, busy)
        if not (releases or decodes or admits or has_prefill or publishes):
            return None  # nothing launches: the trims are asked for again next time
        self.plan_pending = True
        self.proposed_decodes = decodes
        self.requests.admitting = {a.rid for a in admits}
        for trim in trims:
            self.trimmed_to[trim.rid] = trim.keep_from_token
        return PlanRequest(step, tuple(releases), tuple(extends), tuple(admits), publishes, trims)

    def _trims(self) -> tuple[TrimReq, ...]:
        if self.kv_window is None:
            return ()
        local = [r for r in self.requests.holding() if r.role is None]  # a transfer reads all
        return window_trims(
            local,
            [batch.members() for batch in self.batches.values()],
            self.kv_window,
            self.config.page_size,
            self.trimmed_to,
        )

    def apply_plan(self, plan: Plan) -> Launch | None:
        """Take the cache manager's answer; form the batch it allows (None if empty)."""
        self.plan_pending = False
        if plan.extend_failed or plan.admitted or plan.admit_failed:
            self._dissolve()  # requests move between phases
        decode_set = self.steady.decode_set
        retractions = self.num_retractions
        self.launched.pending_writes.extend(plan.writes)
        for rid in plan.released:
            self.trimmed_to.pop(rid, None)  # a retracted request trims its next row anew
            if decode_set is not None:
                decode_set.released(rid)
            self.requests.cache_released(rid)
        self.pressure = bool(plan.extend_failed)
        if plan.extend_failed:
            self.requests.retract_youngest()
        self.requests.admissions_answered(plan.admitted, plan.admit_failed)
        if plan.admitted:
            self.publishes_may_be_due = True
        self.steady.extended(plan.extended, self.requests.reqs, self.config.page_size)
        decodes, self.proposed_decodes = self.proposed_decodes, []
        slots, self.steady.proposed = self.steady.proposed, None
        if self.paused:
            launch = None
        elif decode_set is not None and slots is not None:
            launch = self.launched.form_steady(decode_set, slots)
        else:
            launch = self.launched.form(self.requests.holding(), decodes)
        changed = plan.released or plan.admitted or self.outbox.errors
        self.stalled = (
            launch is None
            and not changed
            and retractions == self.num_retractions
            and self.events == self.events_proposed  # nothing landed while the plan was out
        )
        return launch

    def process(self, done: StepDone) -> list[Output]:
        """A batch's result: its tokens out, or every request failed with the step."""
        self._changed()
        if done.error is not None or done.logprobs or done.routed_experts:
            self._dissolve()  # a failure ends every request; logprobs, experts go one by one
        if done.error is not None:
            self.launched.forget(done.batch_id, self.requests.reqs)
            return self.fail_all(f"forward failed: {done.error}")
        outputs = self.launched.result(done, self.requests.reqs, self.steady.decode_set)
        self.publishes_may_be_due |= self.launched.take_prompt_progress()
        return outputs

    # ---- a steady step (steady_steps.py) --------------------------------------------------

    def _speculates(self) -> bool:
        """Whether this step's decodes may carry drafts (speculation.py): few requests live,
        and no prompt waiting or being prefilled. A step with a prompt chunk computes, so a
        draft beside it costs its whole share; and a burst's first requests would otherwise
        draft (and wait for their tokens to) before the rest of the burst has come."""
        spec, requests = self.spec, self.requests
        if spec is None or not spec.active(len(requests.reqs)) or requests.waiting:
            return False
        return not any(req.phase is Phase.PREFILL for req in requests.holding())

    def _steady_set(self) -> DecodeSet | None:
        busy = self.paused or self.config.disjoint or self.publishes_may_be_due
        busy = busy or self._speculates()
        quiet = not busy and self.kv_window is None
        return self.steady.current(quiet, self.requests, self.batches)

    def _dissolve(self) -> None:
        """Every request's counters and tokens up to date (steady_steps.py)."""
        proposed = self.steady.dissolve(self.batches)
        if proposed is not None:
            self.proposed_decodes = proposed
