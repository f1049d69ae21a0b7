"""The decode side's rooms: one state machine per room, owned by the transfer actor.

    waiting ──the prefill server answers──▶ done (TransferEnded with its first token)
       │                                  ▶ failed (its cause)
       ├── unreachable and surely stopped (refused, reset) ──▶ failed
       └── DropRoom, a timeout, a fault ──▶ cancelling ──the prefill server confirms, or
                 │                             ▲          is surely stopped──▶ failed
                 │                             └── not confirmed: asked again every second
                 └─▶ the request ends now (TransferEnded held): its caller is answered

Every wait on the prefill server is bounded: the room's POST by disaggregation_timeout_s,
each cancel by the same. The request's pages are reserved (the planner holds them) from
ExpectKV until the last TransferEnded, sent only once no write of the room can still land in
them: the prefill server answers a room only after its write returned, confirms a cancel
only after that, and a peer whose connection was refused or reset has stopped. A room that
goes to "cancelling" ends its request at once (TransferEnded with `held`: the caller gets
the error), but its pages stay quarantined, counted in state "cancelling", until the peer
confirms or is gone: better held than overwritten.

Only the peers of `disaggregation_prefill_peers` are contacted (disagg/peers.py; the Engine
refuses a request naming another), with the server's key (disagg/bootstrap.py), and the KV
is taken only from a peer serving the same weights (its digest; else code
"weights_mismatch", a 400 the router passes on without a retry).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp

from shoal.actors.mailbox import Mailbox
from shoal.actors.messages import SchedulerMsg, TransferEnded
from shoal.actors.replies import TransferStats, rooms_in_states
from shoal.actors.transfer_messages import (
    CancelEnded,
    DropRoom,
    ExpectKV,
    PollEnded,
    TransferMsg,
)
from shoal.disagg.bootstrap import Unreachable, ask_room, cancel_room
from shoal.disagg.layout import KVLayout
from shoal.disagg.peers import PrefillPeers
from shoal.disagg.wire import RoomRequest, RoomResult
from shoal.params import Bootstrap
from shoal.results import ErrorCode

CANCEL_RETRY_S = 1.0
DROP_CANCEL_S = 5.0  # a cancel for a room never asked: fire and forget, bounded


@dataclass
class ReceiveRoom:
    rid: str
    bootstrap: Bootstrap
    state: str = "waiting"  # or "cancelling"
    cause: str = ""
    num_bytes: int = 0
    asked_at: float = 0.0


def base_url(bootstrap: Bootstrap) -> str:
    host = f"[{bootstrap.host}]" if ":" in bootstrap.host else bootstrap.host
    return f"http://{host}:{bootstrap.port}"


class ReceiveRooms:
    STATES = ("waiting", "cancelling")

    def __init__(
        self,
        endpoint: str,
        layout: KVLayout,
        mailbox: Mailbox[TransferMsg],
        scheduler: Mailbox[SchedulerMsg],
        timeout_s: float,
        weights_digest: Callable[[], str],
        peers: PrefillPeers,
        key: str | None = None,
    ) -> None:
        """`peers`: the only prefill servers contacted; `key`: what every call carries."""
        self.endpoint = endpoint
        self.layout = layout
        self.mailbox = mailbox
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self.weights_digest = weights_digest
        self.peers = peers
        self.key = key
        self.rooms: dict[int, ReceiveRoom] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.session: aiohttp.ClientSession | None = None
        self.num_transfers, self.num_bytes, self.transfer_s = 0, 0, 0.0  # received so far

    def stats(self) -> TransferStats:
        rooms = rooms_in_states(self.STATES, (room.state for room in self.rooms.values()))
        return TransferStats(rooms, self.num_transfers, self.num_bytes, self.transfer_s)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:  # no cap on connections: each waiting room holds one
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self.session

    # ---- events ----------------------------------------------------------------------------

    def expect(self, msg: ExpectKV) -> None:
        number = msg.bootstrap.room
        if number in self.rooms:
            cause = f"room {number} is already in use by another request"
            self.scheduler.put(TransferEnded(msg.rid, number, cause))
            return
        refusal = self.peers.refusal(msg.bootstrap.host, msg.bootstrap.port)
        if refusal is not None:  # the Engine refuses it first: never reached
            self.scheduler.put(TransferEnded(msg.rid, number, refusal[1], code="invalid_value"))
            return
        request = RoomRequest(
            self.endpoint, self.layout, msg.pages, msg.skip_tokens, msg.num_tokens,
            msg.prompt_digest, self.weights_digest(),
        )  # fmt: skip
        room = self.rooms[number] = ReceiveRoom(msg.rid, msg.bootstrap)
        room.num_bytes = 2 * self.layout.num_layers * self.layout.page_bytes * len(msg.pages)
        room.asked_at = time.perf_counter()
        self._spawn(self._poll(number, base_url(msg.bootstrap), request))

    async def _poll(self, number: int, url: str, request: RoomRequest) -> None:
        outcome = await ask_room(self._session(), url, number, request, self.timeout_s, self.key)
        if isinstance(outcome, Unreachable):
            self.mailbox.put(PollEnded(number, None, outcome.why, outcome.stopped))
        else:
            self.mailbox.put(PollEnded(number, outcome))

    def polled(self, msg: PollEnded) -> None:
        room = self.rooms.get(msg.room)
        if room is None or room.state != "waiting":
            return  # cancelling: the cancel's answer ends it
        result = msg.result
        if result is None:
            if msg.stopped:
                self._end(msg.room, msg.why)
            else:
                self._cancel(room, msg.room, msg.why)
            return
        mismatch = self._weights_mismatch(result)
        if mismatch is not None:  # answered: its write, if any, has returned
            self._end(msg.room, mismatch, "weights_mismatch")
            return
        if not result.ok:
            code: ErrorCode | None = "peer_refused" if result.refused else None
            self._end(msg.room, f"the prefill server: {result.error}", code)
            return
        del self.rooms[msg.room]
        self.num_transfers += 1
        self.num_bytes += room.num_bytes
        self.transfer_s += time.perf_counter() - room.asked_at
        self.scheduler.put(
            TransferEnded(room.rid, msg.room, None, result.first_token, result.logprob)
        )

    def _weights_mismatch(self, result: RoomResult) -> str | None:
        """Why KV of this answer cannot be used here (None: it can): the prefill server
        serves other weights than this server."""
        mine = self.weights_digest()
        if result.weights_digest == mine:
            return None
        return (
            f"the prefill server serves other weights (weights digest "
            f"{result.weights_digest[:40] or 'none'}, weight_version {result.weight_version}; "
            f"this server's digest is {mine}): load the same checkpoint on both"
        )

    def drop(self, msg: DropRoom) -> None:
        room = self.rooms.get(msg.bootstrap.room)
        if room is None or room.rid != msg.rid:
            # Never asked: tell the prefill server so its half ends now, not at a deadline.
            b = msg.bootstrap
            if self.peers.refusal(b.host, b.port) is None:  # only a listed peer, ever
                url, timeout_s = base_url(b), min(self.timeout_s, DROP_CANCEL_S)
                self._spawn(
                    cancel_room(self._session(), url, b.room, msg.cause, timeout_s, self.key)
                )
            return
        if room.state == "waiting":
            self._cancel(room, msg.bootstrap.room, msg.cause)

    def _cancel(self, room: ReceiveRoom, number: int, cause: str) -> None:
        """The request ends now with the cause (its caller is answered; one ended already
        hears nothing new); its pages stay held until the cancel is confirmed. The wait, if
        still open, is left to end by itself: the prefill server answers it with this cause
        once the cancel lands (closing it would say only "gone")."""
        room.state, room.cause = "cancelling", cause
        self.scheduler.put(TransferEnded(room.rid, number, cause, held=True))
        self._spawn(self._send_cancel(number, base_url(room.bootstrap), cause, delay_s=0.0))

    async def _send_cancel(self, number: int, url: str, cause: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        outcome = await cancel_room(self._session(), url, number, cause, self.timeout_s, self.key)
        if outcome is None or outcome.stopped:
            self.mailbox.put(CancelEnded(number, True))
        else:
            self.mailbox.put(CancelEnded(number, False, outcome.why))

    def cancelled(self, msg: CancelEnded) -> None:
        room = self.rooms.get(msg.room)
        if room is None:
            return
        if msg.confirmed:
            self._end(msg.room, room.cause)
        else:  # alive but silent: the pages stay reserved until it confirms
            url = base_url(room.bootstrap)
            self._spawn(self._send_cancel(msg.room, url, room.cause, delay_s=CANCEL_RETRY_S))

    def fail(self, number: int, cause: str, rid: str | None = None) -> None:
        """Supervision (actors/transfer/kv_transfer.py): a waiting room is cancelled (its pages free
        once the prefill server confirms); a cancelling one asks again; `rid`, when it
        waits for a TransferEnded no room will send, gets one."""
        room = self.rooms.get(number)
        if room is None or (rid is not None and room.rid != rid):
            if rid is not None:
                self.scheduler.put(TransferEnded(rid, number, cause))
            return
        if room.state == "waiting":
            self._cancel(room, number, cause)
        else:
            self.cancelled(CancelEnded(number, False, cause))

    def _end(self, number: int, cause: str, code: ErrorCode | None = None) -> None:
        room = self.rooms.pop(number)
        self.scheduler.put(TransferEnded(room.rid, number, cause, code=code))

    async def shutdown(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
