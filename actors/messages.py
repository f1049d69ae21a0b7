"""Every message that crosses a mailbox: frozen msgspec Structs, one tagged union per actor.

Channels::

    api ──Generate/Abort──▶ tokenizer ──Admit/Abort──▶ scheduler ──PlanRequest──▶ cache manager
                              ▲                          │  ▲ ◀──────Plan────────────┘
                              └──────Outputs/Released────┘  │
                                                 Launch ▼   │ StepDone
                                                       executor
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec

from shoal.api.stream import TokenLogprob
from shoal.params import SamplingParams

if TYPE_CHECKING:
    from shoal.api.stream import RequestStream


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


class Abort(msgspec.Struct, frozen=True, tag=True):
    """Stop a request wherever it is. `reason` is "abort", or "stop" for a matched stop string."""

    rid: str
    reason: str = "abort"
    message: str = ""


class Output(msgspec.Struct, frozen=True):
    rid: str
    token_ids: tuple[int, ...]
    finish: str | None = None  # "stop" | "length" | "abort" | "error"
    message: str = ""
    matched_token: int | None = None
    num_cached_tokens: int | None = None  # sent once, with the first output of a request
    logprobs: tuple[TokenLogprob, ...] | None = None


class Outputs(msgspec.Struct, frozen=True, tag=True):
    items: tuple[Output, ...]


class Released(msgspec.Struct, frozen=True, tag=True):
    """The cache manager confirmed these requests hold nothing anywhere (law 2)."""

    rids: tuple[str, ...]


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


TokenizerMsg = Generate | Abort | Outputs | Released | Shutdown


# ---- into the scheduler -------------------------------------------------------------------


class Admit(msgspec.Struct, frozen=True, tag=True):
    rid: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int


class Admitted(msgspec.Struct, frozen=True):
    rid: str
    row: int
    num_cached_tokens: int


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


class Snapshot(msgspec.Struct, frozen=True, tag=True):
    reply: asyncio.Future[Any]


SchedulerMsg = Admit | Abort | Plan | StepDone | Snapshot | Shutdown


# ---- into the cache manager ---------------------------------------------------------------


class ReleaseReq(msgspec.Struct, frozen=True):
    rid: str
    computed_tokens: tuple[int, ...] | None  # cache these tokens' KV in the tree; None: drop


class ExtendReq(msgspec.Struct, frozen=True):
    rid: str
    total_tokens: int


class AdmitReq(msgspec.Struct, frozen=True):
    rid: str
    tokens: tuple[int, ...]
    reserve_tokens: int


class PlanRequest(msgspec.Struct, frozen=True, tag=True):
    step: int
    releases: tuple[ReleaseReq, ...]
    extends: tuple[ExtendReq, ...]
    admits: tuple[AdmitReq, ...]


class CheckIntegrity(msgspec.Struct, frozen=True, tag=True):
    reply: asyncio.Future[Any] | None = None


class CacheStats(msgspec.Struct, frozen=True, tag=True):
    reply: asyncio.Future[Any]


class FlushCache(msgspec.Struct, frozen=True, tag=True):
    reply: asyncio.Future[Any]


CacheMsg = PlanRequest | CheckIntegrity | CacheStats | FlushCache | Shutdown


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


ExecutorMsg = Launch | Shutdown
