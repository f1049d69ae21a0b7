"""The KV transfer actor's mailbox (actors/transfer/kv_transfer.py; prefill/decode disaggregation,
docs/disaggregation.md): what the scheduler, the Engine, the bootstrap endpoint and the actor's
own tasks send it. Its answer to the scheduler, `TransferEnded`, is in actors/messages.py
with the mailbox it travels in; the request's `Bootstrap` is public (params.py)."""

from __future__ import annotations

import asyncio

import msgspec

from shoal.actors.messages import Shutdown
from shoal.actors.replies import TransferStats
from shoal.disagg.wire import RoomRequest, RoomResult
from shoal.params import Bootstrap
from shoal.results import TokenLogprob


class ClaimRoom(msgspec.Struct, frozen=True, tag=True):
    """Prefill side: a request of this room was admitted; its KV will follow (SendKV)."""

    rid: str
    room: int
    prompt_digest: str


class SendKV(msgspec.Struct, frozen=True, tag=True):
    """Prefill side: the prompt's KV is in `pages` (positions 0 .. num_tokens - 1) and its
    first token sampled; write it into the decode server's pages. Answered by TransferEnded."""

    rid: str
    room: int
    pages: tuple[int, ...]
    num_tokens: int
    first_token: int
    logprob: TokenLogprob | None


class ExpectKV(msgspec.Struct, frozen=True, tag=True):
    """Decode side: `pages` (positions skip_tokens ..) are reserved for the room; ask the
    prefill server to fill them. Answered by TransferEnded."""

    rid: str
    bootstrap: Bootstrap
    pages: tuple[int, ...]
    skip_tokens: int
    num_tokens: int
    prompt_digest: str


class DropRoom(msgspec.Struct, frozen=True, tag=True):
    """The request ended (abort, error, disconnect) before its transfer did: end the room
    on both sides with this cause."""

    rid: str
    bootstrap: Bootstrap
    cause: str
    refused: bool = False  # this server refused the request as given (a 4xx)


class TransferCountsAsk(msgspec.Struct, frozen=True, tag=True):
    """The rooms in each state (what /get_server_info and /metrics show)."""

    reply: asyncio.Future[TransferStats]


class PeerArrived(msgspec.Struct, frozen=True, tag=True):
    """Prefill side, from the bootstrap endpoint: the decode server's pages for a room; the
    reply is sent once no write for it can still land."""

    room: int
    request: RoomRequest
    reply: asyncio.Future[RoomResult]


class PeerCancel(msgspec.Struct, frozen=True, tag=True):
    """Prefill side: the decode server ends the room; the reply once nothing can still write."""

    room: int
    cause: str
    reply: asyncio.Future[None]


class PeerGone(msgspec.Struct, frozen=True, tag=True):
    """Prefill side: the decode server's bootstrap connection dropped while it waited."""

    room: int


class WriteEnded(msgspec.Struct, frozen=True, tag=True):
    """Prefill side: the backend's write for a room returned (error None: every byte landed)."""

    room: int
    error: str | None


class PollEnded(msgspec.Struct, frozen=True, tag=True):
    """Decode side: the prefill server answered the room (result), or could not be reached
    (why; stopped: nothing of it can still write)."""

    room: int
    result: RoomResult | None
    why: str = ""
    stopped: bool = True


class CancelEnded(msgspec.Struct, frozen=True, tag=True):
    """Decode side: the prefill server confirmed the cancel (or is surely stopped), or not."""

    room: int
    confirmed: bool
    why: str = ""


class RoomDeadline(msgspec.Struct, frozen=True, tag=True):
    room: int
    serial: int  # which arming of the room's timer (a re-armed timer's old one is stale)


TransferMsg = (
    ClaimRoom
    | SendKV
    | ExpectKV
    | DropRoom
    | TransferCountsAsk
    | PeerArrived
    | PeerCancel
    | PeerGone
    | WriteEnded
    | PollEnded
    | CancelEnded
    | RoomDeadline
    | Shutdown
)
