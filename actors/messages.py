"""Every message that crosses a mailbox: frozen msgspec Structs, one tagged union per actor.
A message that asks for an answer carries a typed `reply` future (what each carries:
actors/replies.py). The KV transfer actor's mailbox (disaggregation) is
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

from shoal.actors.replies import SchedulerSnapshot, UpdateOutcome
from shoal.cache.stats import KVStats
from shoal.params import SamplingParams
from shoal.results import ErrorCode, FinishReason, TokenLogprob

if TYPE_CHECKING:
    from shoal.results import RequestStream


class Bootstrap(msgspec.Struct, frozen=True):
    """Prefill/decode disaggregation (docs/disaggregation.md): where this request's other
    half runs. SGLang's names: the prefill server's bootstrap host and port, and the room
    both servers know the request by."""

    host: str
    port: int
    room: int


class RowWriteMsg(msgspec.Struct, frozen=True):
    """Device request-slot table update: table[row, start:start + len(pages)] = pages."""

    row: int
    start: int
    pages: tuple[int, ...]


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


class Abort(msgspec.Struct, frozen=True, tag=True):
    """Stop a request wherever it is. `reason` is "abort", or "stop" for a matched stop string."""

    rid: str
    reason: FinishReason = "abort"
    message: str = ""
    keep_outputs: int | None = None  # "stop": outputs the caller kept (a session's history)


class Output(msgspec.Struct, frozen=True):
    rid: str
    token_ids: tuple[int, ...]
    finish: FinishReason | None = None
    message: str = ""
    code: ErrorCode | None = None  # an "error" that was the caller's mistake: which
    matched_token: int | None = None
    num_cached_tokens: int | None = None  # sent once, with the first output of a request
    logprobs: tuple[TokenLogprob, ...] | None = None


class Outputs(msgspec.Struct, frozen=True, tag=True):
    items: tuple[Output, ...]


class Released(msgspec.Struct, frozen=True, tag=True):
    """The cache manager confirmed these requests hold nothing anywhere
    (docs/architecture.md, "Lifecycle laws", law 2)."""

    rids: tuple[str, ...]


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class UpdateWeights(msgspec.Struct, frozen=True, tag=True):
    """Take the writer lock, load the checkpoint, flush the prefix cache, bump the version."""

    model_path: str
    abort_all: bool
    weight_version: int | None
    reply: asyncio.Future[UpdateOutcome]


class Pause(msgspec.Struct, frozen=True, tag=True):
    paused: bool


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


class WriteDone(msgspec.Struct, frozen=True, tag=True):
    """The writer's work finished (posted by the tokenizer's own write task)."""

    error: str | None


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
    reply: asyncio.Future[str | None]  # None: flushed; else why not


class FlushDeadline(msgspec.Struct, frozen=True, tag=True):
    flush_id: int


class SetPaused(msgspec.Struct, frozen=True, tag=True):
    """Pause: nothing new is scheduled, running requests keep their KV. False continues."""

    paused: bool


class Park(msgspec.Struct, frozen=True, tag=True):
    """Retract every request, dropping its KV; answer when no request holds anything and no
    batch is in flight. Used by a weight update during a pause."""

    reply: asyncio.Future[None]


class Gate(msgspec.Struct, frozen=True, tag=True):
    """Test stepping: hold=True stops planning and result processing until told to go on."""

    hold: bool


class Advance(msgspec.Struct, frozen=True, tag=True):
    """While held: plan and launch one step; the reply is the launched batch id or None."""

    reply: asyncio.Future[int | None]


class Deliver(msgspec.Struct, frozen=True, tag=True):
    """While held: process the oldest result (waiting for one); the reply is its batch id."""

    reply: asyncio.Future[int]


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
    | Gate
    | Advance
    | Deliver
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


class PlanRequest(msgspec.Struct, frozen=True, tag=True):
    step: int
    releases: tuple[ReleaseReq, ...]
    extends: tuple[ExtendReq, ...]
    admits: tuple[AdmitReq, ...]
    publishes: tuple[PublishReq, ...] = ()  # applied after releases, before trims
    trims: tuple[TrimReq, ...] = ()  # applied after publishes, before extends


class CheckIntegrity(msgspec.Struct, frozen=True, tag=True):
    """Check the books (the engine is idle); the reply is None or the violation. Without a
    reply (the scheduler's self-check on becoming idle) a violation is logged, and stops the
    engine under strict_integrity."""

    reply: asyncio.Future[str | None] | None = None


class CacheStats(msgspec.Struct, frozen=True, tag=True):
    reply: asyncio.Future[KVStats]


class FlushCache(msgspec.Struct, frozen=True, tag=True):
    """Empty the prefix tree (sent only while idle); the reply is None or what is wrong."""

    reply: asyncio.Future[str | None]


class CloseSession(msgspec.Struct, frozen=True, tag=True):
    """Give back the KV a session keeps (sent only when none of its turns is live)."""

    session_id: str


CacheMsg = PlanRequest | CheckIntegrity | CacheStats | FlushCache | CloseSession | Shutdown


# ---- into the executor --------------------------------------------------------------------


class RowInit(msgspec.Struct, frozen=True):
    """A request's sampling state, sent with its first chunk (again after a retraction)."""

    sampling: SamplingParams
    seed: int
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


class SeqChunk(msgspec.Struct, frozen=True):
    """One sequence of a batch: new tokens at positions start .. start + n - 1 of its row.

    input_ids None means a decode step whose input is the row's last sampled token.
    """

    row: int
    start: int
    num_tokens: int
    input_ids: tuple[int, ...] | None
    sample: bool
    init: RowInit | None = None


class Launch(msgspec.Struct, frozen=True, tag=True):
    batch_id: int
    writes: tuple[RowWriteMsg, ...]
    seqs: tuple[SeqChunk, ...]


class LoadWeights(msgspec.Struct, frozen=True, tag=True):
    """Swap in a checkpoint of the same architecture (only sent while nothing is in flight).
    The reply is None on success or the reason it was refused (old weights stay)."""

    model_path: str
    reply: asyncio.Future[str | None]


ExecutorMsg = Launch | LoadWeights | Shutdown


# Control messages from the API pass through the tokenizer, so they keep their order with
# the requests sent before them (an Advance never overtakes the Generate it follows).
SchedulerControl = Snapshot | FlushWhenIdle | Gate | Advance | Deliver
TokenizerMsg = (
    Generate
    | Abort
    | Outputs
    | Released
    | UpdateWeights
    | Pause
    | WriteDone
    | OpenSession
    | EndSession
    | SchedulerControl
    | Shutdown
)
