"""The running requests while nothing but decoding goes on, as numpy columns: a steady step
with no per-request Python in planning and forming, and results taken as arrays
(docs/architecture.md, "A steady step"; plain Python and numpy, no asyncio, no torch).

While a set is alive it owns its members' step counters and their newest tokens:
`Req.num_launched`, `pending`, `inflight`, `num_computed` and `capacity` of an alive member
are stale, and the columns here are the truth; its `Req.tokens` lacks the tokens kept in
`recent` (a block of steps x members, moved into the lists when it fills, and a member's at
its detach). The planner keeps it so:

    build     when at least MIN_MEMBERS live requests run and every one is a running decoder
              (or a finished one waiting for its release), nothing waits, and every launched
              batch is decodes of them only (`DecodeSet.of`, steady_steps.py)
    steady    propose, form and result as column operations (`want`, `form`, `result`);
              a finish detaches its member (its counters and tokens go back to its Req) and
              marks the slot dead: the set lives on
    dissolve  on anything else (an arrival, an abort, a failed extension, logprobs, a pause,
              a snapshot, a quarter of the slots dead): every alive member's counters and
              tokens go back to its Req, and the planner's per-request code takes over

A slot is a member's index in `members`; slots are never reused while the set lives, so a
launched batch names its decodes by slot (`LaunchedBatch.slots`). The laws hold as they do
for the per-request code: `inflight` counts the launched batches that read a row (a dead
slot's batches count down on its Req), and a finished member's release waits for 0.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from shoal.actors.messages import Output
from shoal.actors.scheduler.request import Phase, PlannerConfig, Req, finish_reason, pages_for

Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
Steady = tuple[tuple[str, ...], tuple[int, ...]]  # outputs as columns: request ids, tokens

# A set whose dead slots pass this share of its members is dissolved and built anew.
MAX_DEAD_SHARE = 0.25
# Fewer running requests are planned one by one: a step of column operations costs about
# 40 µs of numpy calls whatever the batch, the per-request code about 2.3 µs a request
# (bench/planner_cost.py and bench/README.md, "Host cost per decode step": even at 16).
MIN_MEMBERS = 16
RECENT_STEPS = 64  # tokens kept as columns before they go into the requests' lists
COUNTERS = ("num_launched", "pending", "inflight", "num_computed", "capacity")


def _column(reqs: list[Req], name: str) -> Ints:
    return np.fromiter((getattr(r, name) for r in reqs), np.int64, len(reqs))


@dataclass
class DecodeSet:
    members: list[Req]
    all_rids: tuple[str, ...]  # the members' ids, by slot
    slot_of: dict[str, int]
    rows: Ints
    num_launched: Ints
    pending: Ints
    inflight: Ints
    num_computed: Ints
    capacity: Ints
    limit: Ints  # a member wants a decode while num_launched < limit
    num_prompt: Ints
    min_new: Ints
    max_new: Ints
    eos_ok: Bools  # EOS ends it (not ignore_eos)
    stop_slots: Ints  # members with stop token ids of their own
    alive: Bools
    num_alive: int
    recent: Ints  # [RECENT_STEPS, members]: tokens not yet in Req.tokens, by step
    num_recent: Ints  # per member: how many of its column are kept
    dying: list[Req] = field(default_factory=list)  # finished, detached, not yet released

    @classmethod
    def of(cls, reqs: Collection[Req]) -> DecodeSet | None:
        """A set of every live request if each is a running decoder holding its row, or a
        finished one whose batches are all back (it waits for its release), and at least
        `MIN_MEMBERS` run; else None.
        Logprobs and routed experts come back one by one (`LaunchedBatches.result`), and so
        may a grammar's per-row error and its end on EOS whatever ignore_eos says: a request
        that asks for any of them keeps the per-request code."""
        running: list[Req] = []
        dying: list[Req] = []
        if len(reqs) < MIN_MEMBERS:
            return None
        for req in reqs:
            sampling = req.sampling
            if req.row is None or req.role == "send" or sampling.wants_logprobs:
                return None
            if sampling.return_routed_experts or sampling.grammar is not None:
                return None
            if req.phase is Phase.RUNNING:
                running.append(req)
            elif req.phase is Phase.FINISHING and not req.inflight:
                dying.append(req)
            else:
                return None
        return cls.build(running, dying) if len(running) >= MIN_MEMBERS else None

    @classmethod
    def build(cls, running: list[Req], dying: list[Req]) -> DecodeSet:
        """A set of the `running` decoders (their counters move here) and the `dying`."""
        n = len(running)
        sampling = [r.sampling for r in running]
        prompt = _column(running, "num_prompt")
        max_new = np.fromiter((s.max_new_tokens for s in sampling), np.int64, n)
        return cls(
            members=running,
            all_rids=tuple(r.rid for r in running),
            slot_of={r.rid: i for i, r in enumerate(running)},
            rows=np.fromiter((r.row for r in running), np.int64, n),
            num_launched=_column(running, "num_launched"),
            pending=_column(running, "pending"),
            inflight=_column(running, "inflight"),
            num_computed=_column(running, "num_computed"),
            capacity=_column(running, "capacity"),
            limit=prompt + max_new - 1,
            num_prompt=prompt,
            min_new=np.fromiter((s.min_new_tokens for s in sampling), np.int64, n),
            max_new=max_new,
            eos_ok=np.fromiter((not s.ignore_eos for s in sampling), np.bool_, n),
            stop_slots=np.array(
                [i for i, s in enumerate(sampling) if s.stop_token_ids], dtype=np.int64
            ),
            alive=np.ones(n, np.bool_),
            num_alive=n,
            recent=np.zeros((RECENT_STEPS, n), np.int64),
            num_recent=np.zeros(n, np.int64),
            dying=dying,
        )

    @property
    def worn(self) -> bool:
        """Too many dead slots (or too few alive) to go on: dissolve and build anew."""
        few = self.num_alive < MIN_MEMBERS
        return few or self.num_alive <= len(self.members) * (1 - MAX_DEAD_SHARE)

    def detach(self, slot: int) -> Req:
        """The member's counters and tokens back to its Req; the slot is dead from now on."""
        req = self._tokens_back(slot)
        for name in COUNTERS:
            setattr(req, name, int(getattr(self, name)[slot]))
        self.alive[slot] = False
        self.num_alive -= 1
        return req

    def dissolve(self) -> None:
        """Every alive member's counters back to its Req (the set is not used again)."""
        for slot in np.flatnonzero(self.alive).tolist():
            self.detach(slot)

    def _tokens_back(self, slot: int) -> Req:
        """The member's kept tokens into its Req.tokens."""
        req = self.members[slot]
        kept = int(self.num_recent[slot])
        if kept:
            req.tokens.extend(self.recent[:kept, slot].tolist())
            self.num_recent[slot] = 0
        return req

    def _keep(self, slots: Ints, tokens: Ints) -> None:
        """One new token for each of `slots`, kept as a column (moved into the requests'
        lists first where a column is full)."""
        at = self.num_recent[slots]
        if at.size and int(at.max()) == RECENT_STEPS:
            for slot in slots[at == RECENT_STEPS].tolist():
                self._tokens_back(slot)
            at = self.num_recent[slots]
        self.recent[at, slots] = tokens
        self.num_recent[slots] = at + 1

    # ---- a steady step --------------------------------------------------------------------

    def want(self) -> Ints:
        """The alive members with a token to decode, in slot (arrival) order."""
        return np.flatnonzero(self.alive & (self.num_launched < self.limit))

    def needs_page(self, slots: Ints) -> Ints:
        """Of `slots`, those whose next position their row's pages do not cover yet."""
        return slots[self.num_launched[slots] >= self.capacity[slots]]

    def released(self, rid: str) -> None:
        """The cache manager released a finished member: it leaves the table."""
        self.dying = [r for r in self.dying if r.rid != rid]

    def extended(self, rid: str, page_size: int) -> None:
        """The cache manager extended `rid` to cover its next position, on whole pages."""
        slot = self.slot_of[rid]
        if not self.alive[slot]:  # finished meanwhile: detached, its own counters
            req = self.members[slot]
            req.capacity = max(req.capacity, pages_for(req.num_launched + 1, page_size) * page_size)
            return
        covers = pages_for(int(self.num_launched[slot]) + 1, page_size) * page_size
        self.capacity[slot] = max(int(self.capacity[slot]), covers)

    def form(self, proposed: Ints) -> tuple[Ints, Ints]:
        """Launch the proposed members still alive and covered: their slots and starts."""
        slots = proposed[self.alive[proposed]]
        slots = slots[self.num_launched[slots] < self.capacity[slots]]
        starts = self.num_launched[slots]  # a copy: fancy indexing
        self.num_launched[slots] += 1
        self.pending[slots] += 1
        self.inflight[slots] += 1
        return slots, starts

    def result(
        self, slots: Ints, starts: Ints, tokens: Ints, config: PlannerConfig
    ) -> tuple[list[Output], Steady]:
        """A batch of this set came back with one token per slot: the steady outputs as
        columns (request ids, tokens), the others (a finish, detached; a first token) one
        by one; a dead slot's token is discarded (it finished after this batch launched)."""
        alive = self.alive[slots]
        if not alive.all():
            for slot, start in zip(slots[~alive].tolist(), starts[~alive].tolist(), strict=True):
                req = self.members[slot]  # detached: its own counters
                req.inflight -= 1
                req.pending -= 1
                req.num_computed = max(req.num_computed, start + 1)
            slots, starts, tokens = slots[alive], starts[alive], tokens[alive]
        self.inflight[slots] -= 1
        self.pending[slots] -= 1
        self.num_computed[slots] = np.maximum(self.num_computed[slots], starts + 1)
        # with this token: len(Req.tokens) + its kept ones == num_launched - pending + 1
        num_outputs = self.num_launched[slots] - self.pending[slots] + 1 - self.num_prompt[slots]
        ends = num_outputs >= self.max_new[slots]
        eos = np.zeros(len(slots), np.bool_)
        for eos_id in config.eos_token_ids:
            eos |= tokens == eos_id
        stops = eos & self.eos_ok[slots]
        if self.stop_slots.size:
            own = np.isin(slots, self.stop_slots)
            for i in np.flatnonzero(own).tolist():
                stop_ids = self.members[int(slots[i])].sampling.stop_token_ids
                stops[i] |= int(tokens[i]) in stop_ids
        ends |= stops & (num_outputs >= self.min_new[slots])
        ends |= num_outputs <= 1  # never for a decode; its first output says more
        # `ends` may err only towards True: `_ended` decides with `finish_reason`
        self._keep(slots, tokens)
        if not ends.any():
            return [], (self._rids(slots.tolist()), tuple(tokens.tolist()))
        outputs = [
            self._ended(slot, token, config)
            for slot, token in zip(slots[ends].tolist(), tokens[ends].tolist(), strict=True)
        ]
        steady = ~ends
        return outputs, (self._rids(slots[steady].tolist()), tuple(tokens[steady].tolist()))

    def _rids(self, slots: list[int]) -> tuple[str, ...]:
        if len(slots) == len(self.members):
            return self.all_rids  # every member: the common steady step
        rids = self.all_rids
        return tuple([rids[slot] for slot in slots])

    def _ended(self, slot: int, token: int, config: PlannerConfig) -> Output:
        """The member's token ended it (or is its first): detach it, say how."""
        req = self._tokens_back(slot)  # this token last
        finish = finish_reason(req, token, config.eos_token_ids)
        first = req.num_outputs == 1
        if finish is not None:
            self.detach(slot)
            req.phase, req.finish = Phase.FINISHING, finish
            self.dying.append(req)
        return Output(
            req.rid,
            (token,),
            finish,
            num_cached_tokens=req.num_cached_tokens if first else None,
            matched_token=token if finish == "stop" else None,
        )
