"""One live request as the scheduler sees it, and when it is finished."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Literal

from shoal.params import Bootstrap, SamplingParams
from shoal.results import FinishReason, TokenLogprob

if TYPE_CHECKING:
    from shoal.actors.scheduler.speculation import RowDrafts, SpecConfig

Role = Literal["send", "receive"]  # a disaggregated request's half (docs/disaggregation.md)


class Phase(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    RETRACTING = "retracting"
    FINISHING = "finishing"
    TRANSFER = "transfer"  # its pages are being written: by this server (send) or into it


@dataclass(frozen=True)
class PlannerConfig:
    max_running: int
    chunk_size: int
    max_batch_tokens: int
    eos_token_ids: tuple[int, ...]
    max_mixed_prefill_tokens: int = 0  # prompt tokens in a step that also decodes; 0: no cap
    prefix_cache: bool = True  # False: no KV is ever kept in the tree for reuse
    page_size: int = 16
    # Pipeline stages (actors/executor/stages.py): with more than one, a request is in at most one
    # launched batch at a time (a decode's input is the last stage's token of its previous
    # batch), and a batch takes at most its share of the decodes, so that every stage has one.
    stages: int = 1
    # Prefill/decode disaggregation: a request with a bootstrap sends its prompt's KV
    # ("prefill") or receives it ("decode"); "null" serves every request alone.
    disaggregation: Literal["null", "prefill", "decode"] = "null"
    # Speculative decoding (speculation.py): None, off
    speculative: SpecConfig | None = None

    def role(self, bootstrap: Bootstrap | None) -> Role | None:
        if bootstrap is None or self.disaggregation == "null":
            return None
        return "send" if self.disaggregation == "prefill" else "receive"

    @property
    def disjoint(self) -> bool:
        return self.stages > 1

    def prefill_budget(self, num_decodes: int) -> int:
        """Prompt tokens a step with this many decodes may take: the batch's room, capped
        while decodes run so that a newcomer's prompt never stalls every stream for long."""
        room = self.max_batch_tokens - num_decodes
        if num_decodes and self.max_mixed_prefill_tokens:
            return min(room, self.max_mixed_prefill_tokens)
        return room


@dataclass
class Req:
    rid: str
    order: int
    sampling: SamplingParams
    seed: int
    num_prompt: int
    tokens: list[int]
    phase: Phase = Phase.WAITING
    finish: FinishReason | None = None
    row: int | None = None
    num_cached_tokens: int | None = None
    num_launched: int = 0
    num_computed: int = 0  # positions whose KV a finished batch wrote into the row
    num_published: int = 0  # of those, the prefix offered to the tree (KVCache.publish)
    # Positions the row's pages are known to cover (a lower bound: the cache manager may have
    # given more): a decode below it needs no extension (docs/architecture.md, "A steady step").
    capacity: int = 0
    pending: int = 0
    inflight: int = 0
    needs_init: bool = False
    release_sent: bool = False
    drop_kv: bool = False
    session_id: str | None = None
    session_prev_len: int = 0
    keep_outputs: int | None = None  # a stop string ended it: the outputs the caller kept
    # Disaggregation (actors/scheduler/planner_transfers.py): its half, the room, the row's pages as
    # admitted, whether a transfer may still touch them (no release until it is over), and
    # a prefill's first token, held back until its KV has landed.
    bootstrap: Bootstrap | None = None
    role: Role | None = None
    pages: tuple[int, ...] = ()
    transfer_open: bool = False
    held_first: tuple[int, TokenLogprob | None] | None = None
    # Prompt logprobs (SamplingParams.logprob_start_len): the next position whose logits a
    # chunk must still give, each the logprob of the prompt token after it; the prompt's last
    # position (it samples) once none is left. No cached KV is reused from here on
    # (`reuse_limit`), so every position asked for is computed, once.
    logprobs_next: int = field(init=False)
    # Speculative decoding (speculation.py): its n-gram index and backoff, once it drafted;
    # the drafts proposed for its next decode
    draft_state: RowDrafts | None = None
    draft: tuple[int, ...] = ()
    verifying: bool = False  # a launched batch verifies its drafts: nothing else decodes it

    def __post_init__(self) -> None:
        start, last = self.sampling.logprob_start_len, self.num_prompt - 1
        self.logprobs_next = min(max(start, 1) - 1, last) if start >= 0 else last

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def reuse_limit(self) -> int | None:
        """The most cached positions an admission may reuse (None: any): the positions from
        `logprobs_next` on must be computed for their logits, and those from
        routed_experts_start_len on for their routing, when asked (AdmitReq.reuse_limit)."""
        limit = self.logprobs_next
        if self.sampling.return_routed_experts:
            limit = min(limit, self.sampling.routed_experts_start_len)
        return limit if limit < self.num_prompt - 1 else None

    def logprob_targets(self, start: int, num_tokens: int) -> tuple[int, tuple[int, ...]]:
        """A chunk of positions start .. start + num_tokens - 1 is launched: the first of them
        whose logits it must give and the prompt tokens those logits are for (SeqChunk)."""
        first, end = max(start, self.logprobs_next), min(start + num_tokens, self.num_prompt - 1)
        if first >= end:
            return 0, ()
        assert start <= self.logprobs_next, (self.rid, start, self.logprobs_next)
        self.logprobs_next = end
        return first, tuple(self.tokens[first + 1 : end + 1])

    def kept_tokens(self, prefix_cache: bool) -> tuple[tuple[int, ...] | None, str | None]:
        """At release: the tokens whose KV to keep, and the session that keeps them."""
        if self.drop_kv:
            return None, None
        computed = self.tokens[: self.num_launched]
        if self.session_id is None or self.phase is Phase.RETRACTING:
            return (tuple(computed) if prefix_cache else None), None
        if self.finish == "abort":  # the turn is rolled back to the last completed one
            return tuple(computed[: self.session_prev_len]), self.session_id
        if self.keep_outputs is not None:
            computed = computed[: self.num_prompt + self.keep_outputs]
        return tuple(computed), self.session_id


def released_now(req: Req) -> bool:
    """Whether an ending request's release is asked now: nothing reads its row any more
    (docs/architecture.md, law 3), no transfer touches its pages, and it was not asked yet."""
    if req.inflight or req.release_sent or req.transfer_open:
        return False
    req.release_sent = True
    return True


def pages_for(num_tokens: int, page_size: int) -> int:
    """Whole pages that hold num_tokens positions."""
    return -(-num_tokens // page_size)


def finish_reason(req: Req, token: int, eos_token_ids: tuple[int, ...]) -> FinishReason | None:
    """After `token` was appended: "stop" (stop token or EOS), "length", or None. A row with a
    grammar samples EOS only where its grammar is complete (kernels/grammar_row.py), and ends
    there even with ignore_eos: its grammar allows nothing after."""
    sp = req.sampling
    if req.num_outputs >= sp.min_new_tokens:
        if token in sp.stop_token_ids:
            return "stop"
        if token in eos_token_ids and (not sp.ignore_eos or sp.grammar is not None):
            return "stop"
    if req.num_outputs >= sp.max_new_tokens:
        return "length"
    return None
