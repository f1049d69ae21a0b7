"""Every message that crosses a mailbox: frozen msgspec Structs, one tagged union per actor.
A message that asks for an answer carries a typed `reply` future (what each carries:
actors/replies.py). The executor's mailbox (a launch and its parts, a weight load) is
actors/executor_messages.py; the KV transfer actor's (disaggregation)
actors/transfer_messages.py.

Channels::

    api ──Generate/Abort──▶ tokenizer ──Admit/Abort──▶ scheduler ──PlanRequest──▶ cache manager
                              ▲                          │  ▲ ◀──────Plan────────────┘
                              └──────Outputs/Released────┘  │
                                                 Launch ▼   │ StepDone
                                                       executor
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from shoal.actors.replies import SchedulerSnapshot
from shoal.actors.writer_messages import ChangeMemory, Pause, UpdateWeights, WriteDone
from shoal.cache.stats import KVStats
from shoal.params import Bootstrap, ChatTemplateArgs, RoomLeft, SamplingParams
from shoal.results import (
    ErrorCode,
    FinishReason,
    TokenLogprob,
)

if TYPE_CHECKING:
    from shoal.actors.executor_messages import RowWriteMsg  # msgspec never resolves it here
    from shoal.actors.scheduler.pacing import PaceOrder
    from shoal.actors.tokenizer.encode import Prompt
    from shoal.results import RequestStream


# ---- into the tokenizer -------------------------------------------------------------------


class Generate(msgspec.Struct, frozen=True, tag=True):
    rid: str
    text: str | None
    input_ids: tuple[int, ...] | None
    messages: tuple[dict[str, Any], ...] | None
    sampling: SamplingParams
    stream: RequestStream
    session_id: str | None = None
    bootstrap: Bootstrap | None = None
    room: RoomLeft | None = None  # max_new_tokens not given: sized to the prompt (params.py)
    template: ChatTemplateArgs | None = None  # with messages: the template's tools and kwargs


class Encoded(msgspec.Struct, frozen=True, tag=True):
    """A prompt's measuring ended on the tokenizer's worker thread (posted by its own worker,
    actors/tokenizer/intake.py): the request `ticket` stands for, its prompt checked, or the
    refusal (or failure) that ended it."""

    ticket: int
    prompt: Prompt | None
    error: Exception | None


class Abort(msgspec.Struct, frozen=True, tag=True):
    """Stop a request wherever it is. `reason` is "abort", or "stop" for a matched stop string."""

    rid: str
    reason: FinishReason = "abort"
    message: str = ""
    keep_outputs: int | None = None  # "stop": outputs the caller kept (a session's history)


class ExpertRows(msgspec.Struct, frozen=True):
    """The routed experts (SamplingParams.return_routed_experts) of one request's positions
    first .. first + count - 1, as one forward chose them: int32 little-endian, C order
    [count, num_layers, top_k] (kernels/routed_experts.py). The tokenizer places each by its
    first position, so a retracted request's recomputed positions overwrite their rows."""

    first: int
    count: int
    ids: bytes


class Output(msgspec.Struct, frozen=True):
    rid: str
    token_ids: tuple[int, ...]
    finish: FinishReason | None = None
    message: str = ""
    code: ErrorCode | None = None  # an "error" that was the caller's mistake: which
    matched_token: int | None = None
    num_cached_tokens: int | None = None  # sent once, with the first output of a request
    logprobs: tuple[TokenLogprob, ...] | None = None
    # The next prompt positions' logprobs (logprob_start_len), in order, as a chunk computed
    # them: always before the request's first token
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # The routed experts of the positions a batch computed (return_routed_experts): before,
    # or with, the token their last position sampled
    routed_experts: ExpertRows | None = None


class Outputs(msgspec.Struct, frozen=True, tag=True):
    items: tuple[Output, ...]
    # A steady step's outputs as two columns: one token for each request, and nothing else
    # to tell (no finish, logprobs or cached count); delivered before `items`, which never
    # name the same request (docs/architecture.md, "A steady step").
    steady_rids: tuple[str, ...] = ()
    steady_tokens: tuple[int, ...] = ()


class Released(msgspec.Struct, frozen=True, tag=True):
    """The cache manager confirmed these requests hold nothing anywhere
    (docs/architecture.md, "Lifecycle laws", law 2)."""

    rids: tuple[str, ...]


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class OpenSession(msgspec.Struct, frozen=True, tag=True):
    """Open a session; the reply raises RequestError if it cannot be (id in use, too many,
    too many of its client's)."""

    session_id: str
    timeout_s: float
    max_tokens: int | None
    reply: asyncio.Future[None]
    client: str | None = None  # who holds it (over HTTP: the peer address); None: not counted


class EndSession(msgspec.Struct, frozen=True, tag=True):
    """Close a session (deferred until its turn ends). A "timeout" never ends a live turn. The
    reply raises RequestError (session_not_found) if the session is not open."""

    session_id: str
    reason: Literal["close", "timeout"] = "close"
    reply: asyncio.Future[None] | None = None


# ---- into the scheduler -------------------------------------------------------------------


class Admit(msgspec.Struct, frozen=True, tag=True):
    rid: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    session_id: str | None = None
    session_prev_len: int = 0  # the history before this turn: what an abort rolls back to
    bootstrap: Bootstrap | None = None


class Admitted(msgspec.Struct, frozen=True):
    rid: str
    row: int
    num_cached_tokens: int
    pages: tuple[int, ...] = ()  # the row's pages, when the admission asked (export_pages)


class Plan(msgspec.Struct, frozen=True, tag=True):
    """The cache manager's answer to one PlanRequest, decisions in request order."""

    step: int
    released: tuple[str, ...]
    extended: tuple[str, ...]
    extend_failed: tuple[str, ...]
    admitted: tuple[Admitted, ...]
    admit_failed: tuple[str, ...]
    writes: tuple[RowWriteMsg, ...]


class StepDone(msgspec.Struct, frozen=True, tag=True):
    batch_id: int
    next_tokens: tuple[int, ...]  # one per sampling sequence, in batch order
    error: str | None = None
    logprobs: tuple[TokenLogprob | None, ...] = ()  # parallel to next_tokens, when any asked
    # One per prompt chunk of the launch that asked for prompt logprobs (SeqChunk.logprob_targets),
    # in batch order: its positions' logprobs
    prompt_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()
    # (place of the sequence in batch order, its rows) for each sequence of a request asking
    # for its routed experts (SamplingParams.return_routed_experts) that recorded positions
    routed_experts: tuple[tuple[int, ExpertRows], ...] = ()
    # (place in batch order, why) per sequence whose row constraint cannot go on (a grammar
    # that refused its token): that request alone ends with the error
    row_errors: tuple[tuple[int, str], ...] = ()
    # (place in sampling order, its kept drafts) per speculating decode that kept any: its
    # tokens are those, then its next_tokens entry (actors/executor/draft_asks.py)
    drafted: tuple[tuple[int, tuple[int, ...]], ...] = ()


class TransferEnded(msgspec.Struct, frozen=True, tag=True):
    """A room's KV transfer is over and nothing of it can still write into or read from the
    request's pages. error None: done (a decode server gets the prefill's first token).

    `held`: over for the request, not yet for its pages: a decode server's peer that may
    still write into them has not confirmed a cancel. The request ends now with the error;
    its pages stay until a last TransferEnded (held False) says nothing can write."""

    rid: str
    room: int
    error: str | None
    first_token: int = -1
    logprob: TokenLogprob | None = None
    code: ErrorCode | None = None  # the error's kind, when a client's status follows from it
    held: bool = False


class Snapshot(msgspec.Struct, frozen=True, tag=True):
    reply: asyncio.Future[SchedulerSnapshot]


class FlushWhenIdle(msgspec.Struct, frozen=True, tag=True):
    """Empty the prefix cache once the engine is idle; refuse if not idle by the deadline."""

    flush_id: int
    timeout_s: float
    reply: asyncio.Future[None]  # raises OperationRefused: engine_busy, integrity_violation


class FlushDeadline(msgspec.Struct, frozen=True, tag=True):
    flush_id: int


class SetPaused(msgspec.Struct, frozen=True, tag=True):
    """Pause: nothing new is scheduled, running requests keep their KV. False continues."""

    paused: bool


class Park(msgspec.Struct, frozen=True, tag=True):
    """Retract every request, dropping its KV; answer when no request holds anything and no
    batch is in flight. Used by a weight update during a pause."""

    reply: asyncio.Future[None]


class Pace(msgspec.Struct, frozen=True, tag=True):
    """Test stepping: an order for the scheduler's pacer (actors/scheduler/pacing.py: hold,
    release, advance one step, deliver one result), which the scheduler hands over unread."""

    order: PaceOrder

    @property
    def reply(self) -> asyncio.Future[int] | asyncio.Future[int | None] | None:
        """The order's reply, if it has one: what supervision fails (fail_replies)."""
        return getattr(self.order, "reply", None)


SchedulerMsg = (
    Admit
    | Abort
    | Plan
    | StepDone
    | TransferEnded
    | Snapshot
    | FlushWhenIdle
    | FlushDeadline
    | SetPaused
    | Park
    | Pace
    | Shutdown
)


# ---- into the cache manager ---------------------------------------------------------------


class ReleaseReq(msgspec.Struct, frozen=True):
    rid: str
    computed_tokens: tuple[int, ...] | None  # cache these tokens' KV in the tree; None: drop
    session_id: str | None = None  # the session keeps that KV for its next turn


class PublishReq(msgspec.Struct, frozen=True):
    """A running request's computed prompt prefix: cache its full pages now (KVCache.publish),
    so requests admitted later share them."""

    rid: str
    computed_tokens: tuple[int, ...]


class TrimReq(msgspec.Struct, frozen=True):
    """Sliding window: no launched batch of `rid` and no later query reads a key below
    `keep_from_token` (page-aligned), so its own pages there are freed (KVCache.trim)."""

    rid: str
    keep_from_token: int


class ExtendReq(msgspec.Struct, frozen=True):
    rid: str
    total_tokens: int


class AdmitReq(msgspec.Struct, frozen=True):
    rid: str
    tokens: tuple[int, ...]
    reserve_tokens: int
    session_id: str | None = None
    export_pages: bool = False  # a KV transfer reads or writes the row's pages: name them
    # Reuse at most this many cached prompt positions (None: any): positions from here on
    # need their logits, for prompt logprobs (KVCache.admit)
    reuse_limit: int | None = None


class PlanRequest(msgspec.Struct, frozen=True, tag=True):
    step: int
    releases: tuple[ReleaseReq, ...]
    extends: tuple[ExtendReq, ...]
    admits: tuple[AdmitReq, ...]
    publishes: tuple[PublishReq, ...] = ()  # applied after releases, before trims
    trims: tuple[TrimReq, ...] = ()  # applied after publishes, before extends


class CheckIntegrity(msgspec.Struct, frozen=True, tag=True):
    """Check the books (the engine is idle); the reply raises OperationRefused
    (integrity_violation) on a violation. Without a reply (the scheduler's self-check on
    becoming idle) a violation is logged, and stops the engine under strict_integrity."""

    reply: asyncio.Future[None] | None = None


class CacheStats(msgspec.Struct, frozen=True, tag=True):
    reply: asyncio.Future[KVStats]


class FlushCache(msgspec.Struct, frozen=True, tag=True):
    """Empty the prefix tree (sent only while idle); the reply raises OperationRefused
    (integrity_violation) if the books do not close after it."""

    reply: asyncio.Future[None]


class CloseSession(msgspec.Struct, frozen=True, tag=True):
    """Give back the KV a session keeps (sent only when none of its turns is live)."""

    session_id: str


CacheMsg = PlanRequest | CheckIntegrity | CacheStats | FlushCache | CloseSession | Shutdown


# Control messages from the API pass through the tokenizer, so they keep their order with
# the requests sent before them (a Pace's Advance never overtakes the Generate it follows).
SchedulerControl = Snapshot | FlushWhenIdle | Pace
TokenizerMsg = (
    Generate
    | Abort
    | Outputs
    | Released
    | UpdateWeights
    | ChangeMemory
    | Pause
    | WriteDone
    | Encoded
    | OpenSession
    | EndSession
    | SchedulerControl
    | Shutdown
)
